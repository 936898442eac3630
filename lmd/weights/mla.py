"""DeepSeek-V2's multi-head latent attention (``ModelConfig.mla``): its weights by HF name, and the forms
both engines run them in.

A layer's attention holds, under ``model.layers.{i}.self_attn.``: ``q_proj`` [Hq (nope + rope), H], or
with ``q_lora_rank`` r the low-rank pair ``q_a_proj`` [r, H] -> ``q_a_layernorm`` [r] -> ``q_b_proj``
[Hq (nope + rope), r]; ``kv_a_proj_with_mqa`` [L + rope, H] (the latent, then one rotated key shared by
every head), ``kv_a_layernorm`` [L], ``kv_b_proj`` [Hq (nope + v), L] (per head its keys' plain dims,
then its values, from the normed latent) and ``o_proj`` [H, Hq v].

The cache holds per token one row [L + rope]: the normed latent c, then the rotated key k_pe. Attention
runs on it without expanding keys or values, by absorbing ``kv_b_proj`` into the query and the output:
with W_UK [Hq, nope, L] and W_UV [Hq, v, L] its two halves (``absorbed_weights``),
q_nope · k_nope = q_nope · (W_UK c) = (q_nope W_UK) · c, so a head's latent query [q_nope W_UK | q_pe]
attends over the cached rows as one shared KV head whose values are the rows' first L dims, and its
latent output o_c [L] becomes the head's output W_UV o_c. Prefill chunks take the same path.

HF rotates the rope dims as interleaved pairs (2i, 2i + 1); the kernels rotate NeoX style (i, i + rope/2).
A dot product of two rotated vectors does not change when both have their dims permuted alike, so the
rope rows of q's and of the shared key's projections are reordered at load, evens then odds
(``deinterleave_rope_rows``): the NeoX rotation of the reordered rows is HF's rotation, reordered.
"""
from __future__ import annotations

import torch

from ..model_config import ModelConfig


def mla_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor of layer ``layer``'s latent attention."""
    mla, H, Hq = config.mla, config.hidden_size, config.num_heads
    p = f'model.layers.{layer}.self_attn.'
    q_rows = Hq * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    if mla.q_lora_rank is None:
        shapes = {p + 'q_proj.weight': (q_rows, H)}
    else:
        r = mla.q_lora_rank
        shapes = {p + 'q_a_proj.weight': (r, H), p + 'q_a_layernorm.weight': (r,), p + 'q_b_proj.weight': (q_rows, r)}
    L = mla.kv_lora_rank
    shapes.update({p + 'kv_a_proj_with_mqa.weight': (L + mla.qk_rope_head_dim, H), p + 'kv_a_layernorm.weight': (L,),
                   p + 'kv_b_proj.weight': (Hq * (mla.qk_nope_head_dim + mla.v_head_dim), L),
                   p + 'o_proj.weight': (H, Hq * mla.v_head_dim)})
    return shapes


def rope_order(rope_dim: int) -> torch.Tensor:
    """The rope dims in NeoX order: the evens, then the odds (see the module docstring)."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def deinterleave_rope_rows(weight: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """weight [heads * head_dim, K] whose rows are per head ``head_dim - rope_dim`` plain ones then
    ``rope_dim`` rotated ones in HF's interleaved pairs -> the same with each head's rope rows in NeoX
    order. q_proj / q_b_proj take head_dim = nope + rope; kv_a_proj_with_mqa is one 'head' of L + rope."""
    heads = weight.shape[0] // head_dim
    order = torch.cat([torch.arange(head_dim - rope_dim), head_dim - rope_dim + rope_order(rope_dim)])
    return weight.view(heads, head_dim, -1)[:, order].reshape(weight.shape).contiguous()


def absorbed_weights(config: ModelConfig, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [Hq (nope + v), L] -> (W_UK [Hq, nope, L], W_UV [Hq, v, L])."""
    mla = config.mla
    per_head = kv_b.view(config.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    w_uk, w_uv = per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
    return w_uk.contiguous(), w_uv.contiguous()


def fuse_mla(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s latent attention under TurboMind's names (``layers.{i}.mla.*``), in ``dtype``:
    ``q`` (q_proj, or q_b_proj after ``q_a`` and ``q_a_norm``) and ``kv_a`` with their rope rows
    de-interleaved, ``kv_a_norm``, and kv_b_proj absorbed: ``w_uk_t`` [Hq, L, nope] (W_UK transposed per
    head, the plain query's matmul into the latent) and ``w_uv`` [Hq, v, L]. o_proj is the layer's ``o``."""
    mla = config.mla
    a, q = f'model.layers.{layer}.self_attn.', f'layers.{layer}.mla.'

    def get(name: str) -> torch.Tensor:
        return weights[name].to(dtype).contiguous()

    head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    out = {}
    if mla.q_lora_rank is None:
        out[q + 'q'] = deinterleave_rope_rows(get(a + 'q_proj.weight'), head_dim, mla.qk_rope_head_dim)
    else:
        out.update({q + 'q_a': get(a + 'q_a_proj.weight'), q + 'q_a_norm': get(a + 'q_a_layernorm.weight'),
                    q + 'q': deinterleave_rope_rows(get(a + 'q_b_proj.weight'), head_dim, mla.qk_rope_head_dim)})
    w_uk, w_uv = absorbed_weights(config, get(a + 'kv_b_proj.weight'))
    out.update({q + 'kv_a': deinterleave_rope_rows(get(a + 'kv_a_proj_with_mqa.weight'), mla.cache_dim,
                                                   mla.qk_rope_head_dim),
                q + 'kv_a_norm': get(a + 'kv_a_layernorm.weight'),
                q + 'w_uk_t': w_uk.transpose(1, 2).contiguous(), q + 'w_uv': w_uv})
    return out
