"""Rotary position embedding tables, computed once per model as HF computes them.

``cos_sin_cache[max_position, rotary_dim]`` = ``cat(cos, sin)`` over the
``rotary_dim // 2`` frequencies, times the rope type's attention factor, in the
model dtype (HF rounds cos/sin to the activations' dtype before using them).

LongRoPE (Phi-3) has two sets of per-frequency factors, and HF picks one per forward pass by the
sequence length it runs: ``long_factor`` past ``original_max_position_embeddings``, else
``short_factor``. A table is fixed per position, so here the set is picked by the longest sequence
the engine serves (its ``session_len``): short when that fits the original context (then every
sequence gets exactly what HF gives it), long when it does not (exact for sequences past the
original context; shorter ones then get the long factors where HF would use the short ones).
``default_session_len`` (``memory.py``) keeps a LongRoPE model's session within the original
context unless asked for more.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig

# Positions beyond this get no precomputed row; the table for a 128k-context model
# at head_dim 128 in float32 is 64 MiB, which is still fine to hold once.
MAX_CACHED_POSITIONS = 1 << 18


def rope_params(config: ModelConfig) -> dict:
    scaling = dict(config.rope_scaling or {})
    rope_type = scaling.get('rope_type') or scaling.get('type') or 'default'
    scaling['rope_type'] = 'longrope' if rope_type == 'su' else rope_type  # 'su': Phi-3's early name
    return scaling


def longrope_original_len(config: ModelConfig) -> int | None:
    """A LongRoPE model's original context (``original_max_position_embeddings``), else None."""
    p = rope_params(config)
    if p['rope_type'] != 'longrope':
        return None
    return int(p.get('original_max_position_embeddings') or config.raw.get('original_max_position_embeddings')
               or config.max_position_embeddings)


# families whose heads HF rotates only in part when config.json does not say (GLM's configs default to half)
_DEFAULT_ROTARY_FACTOR = {'glm': 0.5, 'glm4': 0.5}


def rotary_dim(config: ModelConfig) -> int:
    """The rotated dims of each head: ``partial_rotary_factor`` of head_dim, read from rope_scaling, the
    top level of config.json, or its ``rope_parameters`` (transformers >= 5 keeps GLM's there)."""
    nested = config.raw.get('rope_parameters')
    factor = (rope_params(config).get('partial_rotary_factor') or config.raw.get('partial_rotary_factor')
              or (nested.get('partial_rotary_factor') if isinstance(nested, dict) else None)
              or _DEFAULT_ROTARY_FACTOR.get(config.family, 1.0))
    return int(config.head_dim * float(factor))


def compute_inv_freq(config: ModelConfig, session_len: int | None = None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [rotary_dim // 2] (float32) and the cos/sin scale of the rope type, for
    sequences up to ``session_len`` (default: the model's context; LongRoPE picks its factors by it)."""
    p = rope_params(config)
    rope_type = p['rope_type']
    base = float(p.get('rope_theta') or config.rope_theta)
    dim = rotary_dim(config)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == 'default':
        return inv_freq, 1.0
    if rope_type == 'linear':
        return inv_freq / float(p['factor']), 1.0
    if rope_type == 'llama3':
        factor = float(p['factor'])
        low_freq_factor = float(p['low_freq_factor'])
        high_freq_factor = float(p['high_freq_factor'])
        old_len = float(p['original_max_position_embeddings'])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == 'yarn':
        return _yarn_inv_freq(p, base, dim, config)
    if rope_type == 'longrope':
        return _longrope_inv_freq(p, base, dim, config, session_len or config.max_position_embeddings)
    raise ModelFormatError(
        f"rope_scaling type {rope_type!r} is not supported by lmd "
        f"(supported: default, linear, llama3, yarn, longrope)")


def _longrope_inv_freq(p: dict, base: float, dim: int, config: ModelConfig,
                       session_len: int) -> tuple[torch.Tensor, float]:
    """HF's ``_compute_longrope_parameters`` at seq_len = ``session_len``: the inverse frequencies
    divided by the long factors past the original context, else the short ones; cos/sin scaled by
    sqrt(1 + ln(s) / ln(original)), s = ``factor`` or max_position_embeddings / original."""
    old_len = longrope_original_len(config)
    factor = p.get('factor') or config.max_position_embeddings / old_len
    attention_factor = p.get('attention_factor')
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = p['long_factor'] if session_len > old_len else p['short_factor']
    if len(ext) != dim // 2:
        raise ModelFormatError(f'rope_scaling: longrope factors have {len(ext)} entries; rotary dim {dim} '
                               f'needs {dim // 2}')
    ext = torch.tensor(ext, dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), float(attention_factor)


def _yarn_inv_freq(p: dict, base: float, dim: int, config: ModelConfig) -> tuple[torch.Tensor, float]:
    old_len = p.get('original_max_position_embeddings') or config.max_position_embeddings
    factor = p.get('factor') or config.max_position_embeddings / old_len

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get('attention_factor')
    if attention_factor is None:
        if p.get('mscale') and p.get('mscale_all_dim'):
            attention_factor = get_mscale(factor, p['mscale']) / get_mscale(factor, p['mscale_all_dim'])
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get('beta_fast') or 32
    beta_slow = p.get('beta_slow') or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get('truncate', True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def build_cos_sin_cache(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                        session_len: int | None = None, local: bool = False) -> torch.Tensor:
    """The table for sequences up to ``session_len`` (``compute_inv_freq``), a row per position of the
    model's context; ``local``: the sliding layers' own (``ModelConfig.rope_local_theta``, unscaled:
    Gemma 3)."""
    if local:
        config = replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
    inv_freq, scale = compute_inv_freq(config, session_len)
    max_positions = min(config.max_position_embeddings, MAX_CACHED_POSITIONS)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
    return cache.to(dtype=dtype, device=device).contiguous()
