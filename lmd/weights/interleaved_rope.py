"""GLM's interleaved RoPE, run by the half-split kernels: q's and k's rows permuted at load.

GLM (HF's glm, glm4 modeling) rotates adjacent pairs of each head's first ``rot`` dims, (2i, 2i + 1)
by frequency i (GPT-J style); both engines' kernels rotate (i, i + rot / 2) by frequency i (NeoX
style, ``rope_fill_kv``). Moving dim 2i to i and dim 2i + 1 to i + rot / 2 turns one rotation into
the other, and q · k is a sum over a head's dims, so the same permutation of q's and k's dims leaves
every score as it was: permuting the rows of q_proj and k_proj (and of their biases) once at load is
all it takes. v and o are untouched, so the attention's output is too.
"""
from __future__ import annotations

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig

from .rope import rotary_dim


def half_split_order(rot: int, head_dim: int) -> torch.Tensor:
    """The new order of a head's dims: the even rotated ones, the odd rotated ones, then the rest."""
    return torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, head_dim)])


def to_half_split(config: ModelConfig, weights: dict[str, torch.Tensor],
                  quantized: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """``weights`` with q_proj's and k_proj's rows (and biases) in ``half_split_order`` within each head
    where ``config.rope_interleaved`` (GLM), a new dict (the caller's is left as it was); else ``weights``."""
    if not config.rope_interleaved:
        return weights
    names = [f'model.layers.{n}.self_attn.{m}_proj.weight' for n in range(config.num_layers) for m in 'qk']
    if quantized and any(n in quantized for n in names):
        raise ModelFormatError(f'{config.architecture}: quantized q_proj / k_proj are not supported yet: '
                               'their rows would need the interleaved RoPE undone (lmd.weights.interleaved_rope)')
    D = config.head_dim
    order = half_split_order(rotary_dim(config), D)
    out = dict(weights)
    for name in names:
        for field in (name, name[:-len('weight')] + 'bias'):
            t = weights.get(field)
            if t is not None:  # [heads * D, ...] -> each head's D rows reordered
                out[field] = t.reshape(-1, D, *t.shape[1:])[:, order].reshape(t.shape)
    return out
