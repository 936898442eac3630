"""Rotary position embedding tables, computed once per model as HF computes them.

``cos_sin_cache[max_position, rotary_dim]`` = ``cat(cos, sin)`` over the
``rotary_dim // 2`` frequencies, times the rope type's attention factor, in the
model dtype (HF rounds cos/sin to the activations' dtype before using them).
"""
from __future__ import annotations

import math

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig

# Positions beyond this get no precomputed row; the table for a 128k-context model
# at head_dim 128 in float32 is 64 MiB, which is still fine to hold once.
MAX_CACHED_POSITIONS = 1 << 18


def rope_params(config: ModelConfig) -> dict:
    scaling = dict(config.rope_scaling or {})
    rope_type = scaling.get('rope_type') or scaling.get('type') or 'default'
    scaling['rope_type'] = rope_type
    return scaling


def rotary_dim(config: ModelConfig) -> int:
    factor = rope_params(config).get('partial_rotary_factor') or config.raw.get('partial_rotary_factor', 1.0)
    return int(config.head_dim * float(factor))


def compute_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [rotary_dim // 2] (float32) and the cos/sin scale of the rope type."""
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
    raise ModelFormatError(
        f"rope_scaling type {rope_type!r} is not supported by lmd "
        f"(supported: default, linear, llama3, yarn)")


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


def build_cos_sin_cache(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    inv_freq, scale = compute_inv_freq(config)
    max_positions = min(config.max_position_embeddings, MAX_CACHED_POSITIONS)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
    return cache.to(dtype=dtype, device=device).contiguous()
