"""Weights of an HF-style directory as one ``{hf_name: tensor}`` dict on the CPU.

Reading order: ``model.safetensors.index.json`` (sharded) > ``*.safetensors`` >
``pytorch_model.bin.index.json`` > ``pytorch_model*.bin``. ``.bin`` files are read
with ``torch.load(weights_only=True)``, so a pickle cannot run code.
"""
from __future__ import annotations

import glob
import json
import logging
import os

import torch

from .errors import ModelFormatError

# Files that sit next to a model's weights but are not its weights (LoRA adapters, optimizer state).
_NOT_WEIGHTS = ('adapter_model', 'optimizer', 'training_args')

logger = logging.getLogger('lmd')


def _from_index(model_dir: str, index_name: str) -> tuple[list[str], dict[str, str]]:
    index = os.path.join(model_dir, index_name)
    try:
        with open(index, encoding='utf-8') as f:
            weight_map = json.load(f)['weight_map']
        if not isinstance(weight_map, dict):
            raise TypeError('weight_map is not an object')
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(f'{index}: cannot read the shard index ({type(e).__name__}: {e})') from None
    files = []
    for shard in dict.fromkeys(weight_map.values()):
        path = os.path.join(model_dir, shard)
        if not os.path.isfile(path):
            raise ModelFormatError(f'{index} lists shard {shard}, which is missing from {model_dir}')
        files.append(path)
    return files, weight_map


def weight_files(model_dir: str) -> tuple[list[str], dict[str, str] | None]:
    """The weight files to read and, for a sharded checkpoint, its tensor -> shard map."""
    for index in ('model.safetensors.index.json', 'pytorch_model.bin.index.json'):
        if os.path.isfile(os.path.join(model_dir, index)):
            if index.startswith('pytorch') and glob.glob(os.path.join(glob.escape(model_dir), '*.safetensors')):
                break
            return _from_index(model_dir, index)
    for pattern in ('*.safetensors', 'pytorch_model*.bin'):
        files = sorted(p for p in glob.glob(os.path.join(glob.escape(model_dir), pattern))
                       if not os.path.basename(p).startswith(_NOT_WEIGHTS))
        if files:
            return files, None
    raise ModelFormatError(f'{model_dir} has no weights (model.safetensors, *.safetensors or pytorch_model*.bin)')


def _read_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith('.safetensors'):
        from safetensors.torch import load_file
        try:
            return load_file(path, device='cpu')
        except Exception as e:  # SafetensorError, OSError, ...: a damaged or truncated file
            raise ModelFormatError(f'{path}: not a readable safetensors file ({e})') from None
    try:
        state = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError (bad zip), EOFError, ...
        raise ModelFormatError(f'{path}: not a readable PyTorch weights file ({type(e).__name__}: {e})') from None
    if isinstance(state, dict) and 'state_dict' in state and isinstance(state['state_dict'], dict):
        state = state['state_dict']
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelFormatError(f'{path}: holds a {type(state).__name__}, not a dict of tensors')
    return state


def load_weights(model_dir: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``model_dir`` under their HF names; floating ones cast to ``dtype`` if given."""
    if not os.path.isdir(model_dir):
        raise ModelFormatError(f'{model_dir} is not a directory')
    files, weight_map = weight_files(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        for name, t in _read_file(path).items():
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            weights[name] = t
    if weight_map is not None:
        missing = [n for n in weight_map if n not in weights]
        if missing:
            shard = weight_map[missing[0]]
            raise ModelFormatError(
                f'{os.path.join(model_dir, shard)}: missing tensor {missing[0]!r} that the shard index '
                f'places there ({len(missing)} missing in all)')
    return with_backbone_prefix(weights, model_dir)


def with_backbone_prefix(weights: dict[str, torch.Tensor], model_dir: str = '') -> dict[str, torch.Tensor]:
    """A checkpoint saved from the backbone alone (HF's base model: ``embed_tokens.weight``,
    ``layers.*``, ``norm.weight``, no ``model.`` prefix and no head, as Qwen3-Embedding ships) under
    the names of its ``*ForCausalLM``, as ``from_pretrained`` loads it; the head it lacks is its
    embedding (which a tied model's head is anyway; an untied one's logits then mean nothing, but
    an embedder reads only the hidden states). Any other checkpoint is returned as it is."""
    if 'embed_tokens.weight' not in weights or 'norm.weight' not in weights or \
            any(name.startswith('model.') for name in weights):
        return weights
    out = {name if name == 'lm_head.weight' else f'model.{name}': t for name, t in weights.items()}
    if 'lm_head.weight' not in out:
        out['lm_head.weight'] = out['model.embed_tokens.weight']
        logger.info('%s holds a backbone without a language-model head (an embedding model\'s): its head is '
                    'taken to be its embedding', model_dir or 'the checkpoint')
    return out
