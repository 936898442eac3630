"""A GGUF conversion's quantized matmuls as they are: its Q4_0 / Q4_1 matmuls in the W4A16 layout
and a Q8_0 lm_head in W8A16 (``quant_layouts.py``), bit-exact, instead of the dequantized float
weights ``lmd convert`` wrote beside them.

``gguf_w4a16_for`` / ``gguf_head_w8a16_for`` take a directory ``lmd convert`` made from a GGUF
file (its marker names the file, ``lmd.conversion``) and cache what they read in it::

    DIR/turbomind/w4a16.safetensors        <hf name>.qweight / .scales / .mins
    DIR/turbomind/head_w8a16.safetensors   qweight, scales
"""
from __future__ import annotations

import os

import numpy as np
import torch

from lmd.conversion import conversion_source
from lmd.gguf_model import gguf_metadata, hf_tensor_name, open_gguf, rope_permuted_heads, unpermute_rope

from .quant_layouts import from_gguf_q4_0, from_gguf_q4_1, from_gguf_q8_0
from .schema import LINEARS


# The matmul weights that run in W4A16 straight from a GGUF file.
_GGUF_W4_READERS = {'Q4_0': from_gguf_q4_0, 'Q4_1': from_gguf_q4_1}
_LINEAR_SUFFIXES = tuple(f'.{name}.weight' for name in LINEARS)


def read_gguf_w4a16(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF name -> (qweight, scales, mins) for every Q4_0 / Q4_1 matmul weight of a GGUF file,
    in the W4A16 layout (group size 32), bit-exact; llama.cpp's row permutation of q and k
    undone as ``lmd.gguf_model`` undoes it. Tensors of other types are left out (the caller
    takes them from the dequantized model)."""
    reader = open_gguf(path)
    permuted = rope_permuted_heads(gguf_metadata(reader, path))
    heads = None if permuted is None else dict(zip(('q_proj.weight', 'k_proj.weight'), permuted))
    out = {}
    for t in reader.tensors:
        convert = _GGUF_W4_READERS.get(t.tensor_type.name)
        name = hf_tensor_name(t.name, path)
        if convert is None or not name.endswith(_LINEAR_SUFFIXES):
            continue
        k, n = (int(d) for d in t.shape)  # GGUF lists dims fastest first
        qweight, scales, mins = convert(t.data, n, k)
        suffix = name.rsplit('.', 2)[-2] + '.weight'
        if heads is not None and suffix in heads:  # a row permutation: whole rows move, groups intact
            rows = torch.from_numpy(unpermute_rope(np.arange(n), heads[suffix]).copy())
            qweight, scales, mins = qweight[rows], scales[rows], mins[rows]
        out[name] = (qweight.contiguous(), scales.contiguous(), mins.contiguous())
    return out


# Beside the converted model, in a folder of its own so weight loaders never mistake them for shards.
W4A16_CACHE_FILE = os.path.join('turbomind', 'w4a16.safetensors')
HEAD_W8A16_CACHE_FILE = os.path.join('turbomind', 'head_w8a16.safetensors')


def _cached(model_dir: str, cache_file: str, build) -> dict[str, torch.Tensor] | None:
    """Flat tensors from model_dir/cache_file, or ``build(gguf_source)`` (None: nothing to cache),
    then written there atomically (skipped in a read-only directory). None when model_dir is
    not a GGUF conversion and has no cache."""
    import tempfile

    from safetensors.torch import load_file, save_file
    cache = os.path.join(model_dir, cache_file)
    if os.path.isfile(cache):
        return load_file(cache)
    source = conversion_source(model_dir)
    if source is None:
        return None
    flat = build(source)
    if flat:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix='.cache-', suffix='.tmp', dir=os.path.dirname(cache))
            os.close(fd)
            save_file(flat, tmp)
            os.replace(tmp, cache)
        except OSError:
            pass
    return flat


def gguf_w4a16_for(model_dir: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """The W4A16 matmul weights of a directory that ``lmd convert`` made from a GGUF file
    (``read_gguf_w4a16``), cached in the directory; None for any other directory."""
    fields = ('qweight', 'scales', 'mins')

    def build(source):
        return {f'{n}.{f}': t for n, parts in read_gguf_w4a16(source).items() for f, t in zip(fields, parts)}
    flat = _cached(model_dir, W4A16_CACHE_FILE, build)
    if not flat:
        return None
    names = {k.rsplit('.', 1)[0] for k in flat}
    return {n: tuple(flat[f'{n}.{f}'] for f in fields) for n in names}


def gguf_head_w8a16_for(model_dir: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qweight int8, scales) of the lm_head of a GGUF conversion whose head (``output.weight``,
    or the tied ``token_embd.weight``) is Q8_0, bit-exact; None otherwise."""
    def build(source):
        head = read_gguf_head_q8_0(source)
        return None if head is None else {'qweight': head[0], 'scales': head[1]}
    flat = _cached(model_dir, HEAD_W8A16_CACHE_FILE, build)
    return None if not flat else (flat['qweight'], flat['scales'])


def read_gguf_head_q8_0(path: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qweight int8, scales) in the W8A16 layout of a GGUF's lm_head (``output.weight``, or the tied
    ``token_embd.weight``) when it is Q8_0, bit-exact; None otherwise."""
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get('output.weight', tensors.get('token_embd.weight'))
    if t is None or t.tensor_type.name != 'Q8_0':
        return None
    k, n = (int(d) for d in t.shape)
    return from_gguf_q8_0(t.data, n, k)
