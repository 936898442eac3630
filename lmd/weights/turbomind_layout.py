"""TurboMind's own layout (``lmd convert --backend turbomind``), and ``load_fused``: the fused
tensors TurboMind runs from any model directory.

The layout is a fused checkpoint, so it belongs to the weights layer: ``lmd convert`` (the core)
writes it and TurboMind reads it, and neither imports the other. Nothing in it is TurboMind's
C++: the GEMM panels are packed at load (``lmd.turbomind.model.pack_matmuls``).

``load_fused`` reads any directory TurboMind takes into the tensors ``LlamaModel`` takes:

- an HF checkpoint in float (``model_format`` 'hf');
- a GGUF conversion (``lmd convert X.gguf``): its Q4_0/Q4_1 matmuls in W4A16, a Q8_0 lm_head in
  W8A16, and the other block types (k-quants, Q5_0 ..., a mixed file's parts) as the file stores them,
  bit-exact ('gguf'; 'hf' runs its float weights instead);
- a quantized checkpoint ('awq', 'w8a8', 'gptq', 'compressed-tensors', 'fp8'; ``source_format.py``),
  detected from config.json;
- a directory in TurboMind's own layout, which ``export`` writes (the tensors come fused)::

    OUT/config.json, tokenizer.json, tokenizer_config.json, generation_config.json, ...
        the HF side, copied (tokenizer, chat template; config.json's torch_dtype is the dtype
        of the tensors)
    OUT/turbomind/config.json
        {"format": "lmd-turbomind", "version": 1, "architecture", "dtype", "source_format",
         "model": {hidden_size, ...}, "linears": {"layers.0.qkv": "w4a16", ...},
         "tensors": {"embed": {"dtype", "shape", "sha256"}, ...}}
    OUT/turbomind/model.safetensors
        the fused tensors (``schema.fuse_weights``) but ``cos_sin`` (rebuilt from the config) and a
        tied ``lm_head`` (it is ``embed``)

  Reading it back checks the version, the architecture and sizes against config.json, and every
  tensor's presence, dtype, shape and digest; what fails is a ``TurbomindFormatError`` naming the
  file and the tensor.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch

from lmd.conversion import TURBOMIND_CONFIG
from lmd.errors import ModelFormatError
from lmd.model_config import QUANTIZED_FORMATS, ModelConfig

from .dtype import DTYPE_NAMES, DTYPES, resolve_dtype
from .gguf_linears import gguf_blocks_for, gguf_head_w8a16_for, gguf_w4a16_for
from .moe import moe_matmuls
from .rope import build_cos_sin_cache
from .schema import fuse_weights, layer_matmuls, linear_formats, matmul_parts
from .source_format import quantized_linears, source_format

FORMAT = 'lmd-turbomind'
FORMAT_VERSION = 1
WEIGHTS_FILE = os.path.join('turbomind', 'model.safetensors')
# Files of the HF side a converted directory keeps: config, tokenizer, chat template.
HF_FILES = ('config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
            'special_tokens_map.json', 'added_tokens.json', 'tokenizer.model', 'vocab.json', 'merges.txt',
            'chat_template.jinja', 'chat_template.json')
MODEL_KEYS = ('hidden_size', 'intermediate_size', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
              'vocab_size', 'tie_word_embeddings', 'qk_norm')
_TENSOR_DTYPES = {**DTYPES, 'uint8': torch.uint8, 'int8': torch.int8, 'int32': torch.int32}


class TurbomindFormatError(ModelFormatError):
    """A directory in TurboMind's layout is incomplete, damaged or does not match its config."""


def is_converted(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, TURBOMIND_CONFIG))


def load_fused(model_dir: str, config: ModelConfig, dtype: torch.dtype,
               model_format: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors ``LlamaModel`` takes for ``model_dir``, and the format they came from."""
    from lmd.model_loader import load_weights
    if is_converted(model_dir):
        return read(model_dir, config, dtype, model_format)
    fmt = source_format(model_dir, config, model_format)
    if fmt in QUANTIZED_FORMATS:  # read as stored: fp16 scales cast to bfloat16 would not be exact
        weights = load_weights(model_dir)
        quantized = quantized_linears(fmt, weights, config.quantization_config, os.path.join(model_dir, ''))
    else:
        weights = load_weights(model_dir, dtype)
        quantized = {} if fmt == 'hf' else gguf_matmuls(model_dir, config)
        fmt = 'gguf' if quantized else 'hf'
    return fuse_weights(config, weights, dtype, quantized), fmt


def gguf_matmuls(model_dir: str, config: ModelConfig) -> dict[str, tuple]:
    """The quantized matmuls of a GGUF conversion, per fused matmul: W4A16 when all its parts are
    Q4_0 / Q4_1 / Q4_K, else the file's blocks as stored when all its parts are of a block type the kernels
    run (a mixed file's q/k/v in Q5_0, Q5_0 and Q8_0, say), else none (float); the lm_head in W8A16
    when it is Q8_0, else its blocks."""
    w4a16 = gguf_w4a16_for(model_dir) or {}
    blocks = gguf_blocks_for(model_dir) or {}
    quantized = {}
    for n in range(config.num_layers):
        for fused in layer_matmuls(config):
            parts = matmul_parts(config, n, fused)
            source = w4a16 if all(p in w4a16 for p in parts) else blocks if all(p in blocks for p in parts) else {}
            quantized.update({p: source[p] for p in parts if p in source})
        if config.is_sparse(n):  # the experts' and shared expert's blocks, as stored
            quantized.update({p: blocks[p] for parts in moe_matmuls(config, n).values() for p in parts
                              if p in blocks})
    head = gguf_head_w8a16_for(model_dir)
    if head is None:
        head = blocks.get('lm_head.weight')
    if head is not None:
        quantized['lm_head.weight'] = head
    return quantized


# ---- TurboMind's own layout -----------------------------------------------------------------------------

def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix('torch.')


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _model_dims(config: ModelConfig) -> dict:
    return {k: getattr(config, k) for k in MODEL_KEYS}


def export(model_dir: str, out_dir: str, dtype: str = 'auto', model_format: str | None = None) -> None:
    """Write ``model_dir`` (any directory ``load_fused`` reads) into ``out_dir`` in TurboMind's layout;
    ``dtype`` 'auto' keeps the checkpoint's."""
    from safetensors.torch import save_file
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    tensors, fmt = load_fused(model_dir, config, torch_dtype, model_format)
    formats = linear_formats(config, tensors)
    del tensors['cos_sin']
    tensors.pop('cos_sin_local', None)  # rebuilt from the config too
    if tensors.get('lm_head') is tensors['embed']:
        del tensors['lm_head']
    os.makedirs(os.path.join(out_dir, 'turbomind'), exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={'format': FORMAT})
    record = {'format': FORMAT, 'version': FORMAT_VERSION, 'architecture': config.architecture,
              'dtype': DTYPE_NAMES[torch_dtype], 'source_format': fmt, 'model': _model_dims(config),
              'linears': formats,
              'tensors': {n: {'dtype': _dtype_name(t), 'shape': list(t.shape),
                              'sha256': _digest(t)} for n, t in sorted(tensors.items())}}
    with open(os.path.join(out_dir, TURBOMIND_CONFIG), 'w', encoding='utf-8') as f:
        json.dump(record, f, indent=1)
    for name in HF_FILES:
        if os.path.isfile(os.path.join(model_dir, name)):
            shutil.copyfile(os.path.join(model_dir, name), os.path.join(out_dir, name))
    hf_config = dict(config.raw, torch_dtype=DTYPE_NAMES[torch_dtype])  # what 'auto' resolves to on loading
    if 'dtype' in hf_config:  # transformers >= 5 writes this key instead
        hf_config['dtype'] = DTYPE_NAMES[torch_dtype]
    with open(os.path.join(out_dir, 'config.json'), 'w', encoding='utf-8') as f:
        json.dump(hf_config, f, indent=2)


def _read_record(path: str) -> dict:
    try:
        with open(path, encoding='utf-8') as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise TurbomindFormatError(f'{path}: cannot read it as JSON ({e})') from None
    if not isinstance(record, dict) or record.get('format') != FORMAT:
        raise TurbomindFormatError(f'{path}: not a TurboMind model config (format is not {FORMAT!r})')
    if record.get('version') != FORMAT_VERSION:
        raise TurbomindFormatError(f'{path}: format version {record.get("version")!r} is not one this lmd reads '
                                   f'({FORMAT_VERSION}); convert the model again with this lmd')
    for key, kind in (('architecture', str), ('dtype', str), ('source_format', str), ('model', dict),
                      ('linears', dict), ('tensors', dict)):
        if not isinstance(record.get(key), kind):
            raise TurbomindFormatError(f'{path}: {key!r} is missing or not a {kind.__name__}')
    if record['dtype'] not in DTYPES:
        raise TurbomindFormatError(f'{path}: dtype {record["dtype"]!r} is not one TurboMind runs')
    return record


def read(model_dir: str, config: ModelConfig, dtype: torch.dtype,
         model_format: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The fused tensors of a directory ``export`` wrote, each checked against its config."""
    from safetensors.torch import load_file
    cfg_path = os.path.join(model_dir, TURBOMIND_CONFIG)
    record = _read_record(cfg_path)
    hf_path = os.path.join(model_dir, 'config.json')
    if record['architecture'] != config.architecture:
        raise TurbomindFormatError(f'{cfg_path} is for {record["architecture"]}, but {hf_path} names '
                                   f'{config.architecture}')
    dims = _model_dims(config)
    wrong = [f'{k} {record["model"].get(k)!r} vs {dims[k]!r}' for k in MODEL_KEYS if record['model'].get(k) != dims[k]]
    if wrong:
        raise TurbomindFormatError(f'{cfg_path} does not match {hf_path}: ' + ', '.join(wrong))
    if DTYPES[record['dtype']] != dtype:
        raise ValueError(f'{model_dir} was converted in {record["dtype"]}, not {DTYPE_NAMES.get(dtype, dtype)}; '
                         "use dtype='auto' or convert it again with --dtype")
    if model_format not in (None, record['source_format']):
        raise ValueError(f'{model_dir} was converted from a {record["source_format"]!r} model; model_format='
                         f'{model_format!r} cannot change that (use None, or convert it again)')
    path = os.path.join(model_dir, WEIGHTS_FILE)
    try:
        tensors = load_file(path)
    except Exception as e:  # SafetensorError, OSError: a missing, truncated or garbled file
        raise TurbomindFormatError(f'{path}: not a readable safetensors file ({e})') from None
    for name, want in record['tensors'].items():
        t = tensors.get(name)
        if t is None:
            raise TurbomindFormatError(f'{path}: tensor {name!r} is missing ({cfg_path} lists it)')
        if not isinstance(want, dict) or _TENSOR_DTYPES.get(want.get('dtype')) != t.dtype \
                or want.get('shape') != list(t.shape):
            raise TurbomindFormatError(f'{path}: tensor {name!r} is {_dtype_name(t)} {list(t.shape)}, but '
                                       f'{cfg_path} says {want}')
        if want.get('sha256') != _digest(t):
            raise TurbomindFormatError(f'{path}: tensor {name!r} is damaged (its sha256 differs from {cfg_path})')
    extra = sorted(set(tensors) - set(record['tensors']))
    if extra:
        raise TurbomindFormatError(f'{path}: tensor {extra[0]!r} is not in {cfg_path} ({len(extra)} such)')
    formats = linear_formats(config, tensors)
    if config.tie_word_embeddings and formats['lm_head'] == 'float' and 'lm_head' not in tensors:
        tensors['lm_head'] = tensors.get('embed')
    if formats != record['linears']:
        bad = next(n for n in formats if formats[n] != record['linears'].get(n))
        raise TurbomindFormatError(f'{path}: matmul {bad!r} is stored as {formats[bad]}, but {cfg_path} says '
                                   f'{record["linears"].get(bad)}')
    tensors['cos_sin'] = build_cos_sin_cache(config, dtype, 'cpu')
    if config.local_rope_layers:
        tensors['cos_sin_local'] = build_cos_sin_cache(config, dtype, 'cpu', local=True)
    return tensors, record['source_format']
