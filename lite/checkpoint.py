"""Writing what ``lmd lite`` makes: a quantized HF-style checkpoint or calibration statistics.

Everything is written into a hidden temp directory beside ``work_dir`` and renamed into place
at the end, so an interrupted run never leaves a directory that looks complete. An existing
``work_dir`` is replaced only if it is empty or an earlier ``lmd lite`` output.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import torch

from lmd.weights.schema import LINEARS

# What `lmd lite calibrate` writes (layout in calibrate.py).
STATS_FILE = 'calib_stats.safetensors'

# Copied from the source model beside the weights (not lmd_conversion.json: the output is no GGUF conversion).
SIDE_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'tokenizer.model',
              'vocab.json', 'merges.txt', 'added_tokens.json', 'chat_template.jinja', 'chat_template.json',
              'generation_config.json')
WEIGHTS_FILE = 'model.safetensors'


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first tensor (and so its layer) with a NaN or Inf."""
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f'tensor {name!r} has {bad} NaN/Inf values; nothing was written '
                             '(try --dtype float32, or other calibration data)')


def _earlier_output(path: str) -> bool:
    if os.path.isfile(os.path.join(path, STATS_FILE)):
        return True
    try:
        with open(os.path.join(path, 'config.json'), encoding='utf-8') as f:
            method = (json.load(f).get('quantization_config') or {}).get('quant_method')
    except (OSError, ValueError):
        return False
    return method in ('awq', 'gptq', 'smooth_quant')


def _usual_modes(path: str) -> None:
    """The modes a plain mkdir / open would have given (the temp directory is private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o666 & ~umask)


@contextlib.contextmanager
def atomic_dir(work_dir: str):
    """Yields a temp directory to fill; on success it becomes ``work_dir``, on error it is removed."""
    work_dir = os.path.abspath(os.path.expanduser(work_dir))
    if os.path.isfile(work_dir):
        raise ValueError(f'--work-dir {work_dir} is a file')
    if os.path.isdir(work_dir) and os.listdir(work_dir) and not _earlier_output(work_dir):
        raise ValueError(f'--work-dir {work_dir} holds files that are not an earlier lmd lite output; '
                              'pass a new or empty directory')
    parent, name = os.path.split(work_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{name}.tmp-', dir=parent)
    try:
        yield tmp
        _usual_modes(tmp)
        if os.path.isdir(work_dir):
            old = tempfile.mkdtemp(prefix=f'.{name}.old-', dir=parent)
            os.replace(work_dir, os.path.join(old, name))
            os.replace(tmp, work_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, work_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_checkpoint(work_dir: str, model_dir: str, tensors: dict[str, torch.Tensor], quant_config: dict,
                     torch_dtype: str = 'float16') -> str:
    """``tensors`` as ``work_dir/model.safetensors``, the source's config.json with
    ``quantization_config`` and ``torch_dtype``, and its tokenizer and generation config files."""
    from safetensors.torch import save_file
    check_finite(tensors)
    with open(os.path.join(model_dir, 'config.json'), encoding='utf-8') as f:
        config = json.load(f)
    config.update(quantization_config=quant_config, torch_dtype=torch_dtype)
    if 'dtype' in config:  # transformers >= 5 writes this key instead
        config['dtype'] = torch_dtype
    with atomic_dir(work_dir) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, WEIGHTS_FILE),
                  metadata={'format': 'pt'})
        with open(os.path.join(tmp, 'config.json'), 'w', encoding='utf-8') as f:
            json.dump(config, f, indent=2)
        for name in SIDE_FILES:
            if os.path.isfile(os.path.join(model_dir, name)):
                shutil.copy(os.path.join(model_dir, name), tmp)
    return os.path.abspath(os.path.expanduser(work_dir))


def float_tensors(model, skip: set[str], dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Every parameter of the HF ``model`` not in ``skip``, in ``dtype``; a tied lm_head is left out
    (it stays tied to the embedding)."""
    tied = model.config.tie_word_embeddings
    return {name: t.detach().to(dtype) for name, t in model.state_dict().items()
            if name not in skip and not (tied and name == 'lm_head.weight')}


def quantized_linears(model) -> dict[str, torch.nn.Linear]:
    """The seven matmuls of every decoder layer, by their full names (``model.layers.0.self_attn.q_proj``)."""
    return {f'model.layers.{i}.{name}': layer.get_submodule(name)
            for i, layer in enumerate(model.model.layers) for name in LINEARS}

