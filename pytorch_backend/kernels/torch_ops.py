"""Plain torch kernels: the reference every other backend is checked against, and the CPU path.

Layouts shared by every backend:
- activations are token-major: ``x[T, hidden]``, ``q[T, num_heads, head_dim]``,
  ``k, v[T, num_kv_heads, head_dim]``;
- k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``;
- cos_sin_cache: ``[max_position, rotary_dim]`` = ``cat(cos, sin)`` of the
  ``rotary_dim // 2`` frequencies, in the model dtype (HF rounds cos/sin to it too),
  applied NeoX style (``rotate_half``), as HF Llama/Qwen do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..context import StepContext


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, round to x's dtype, then scale by weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The pre-norm residual stream: residual += x (in place), then rms_norm(residual)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q[T, Hq, D] and k[T, Hk, D] by their positions; returns new tensors.

    x * cos + rotate_half(x) * sin, with rotate_half(x) * sin written as
    roll(x, D/2) * cat(-sin, sin): three ops per tensor, same rounding as HF.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    rot = 2 * cos.shape[-1]
    if rot < q.shape[-1]:  # partial rotary: the tail passes through
        return _rotate_partial(q, cos, sin), _rotate_partial(k, cos, sin)
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((-sin, sin), dim=-1)
    return (torch.addcmul(q * cos, q.roll(rot // 2, -1), sin),
            torch.addcmul(k * cos, k.roll(rot // 2, -1), sin))


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]), dim=-1)


def prepare_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return weight, bias


def linear(x: torch.Tensor, params: tuple) -> torch.Tensor:
    """x[T, K] @ weight[N, K].T (+ bias)."""
    return F.linear(x, params[0], params[1])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k, v[T, Hk, D] into the caches at slot_mapping[T] (block_id * block_size + offset)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def rope_fill_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                 apply_rotary=apply_rotary, fill_kv_cache=fill_kv_cache) -> torch.Tensor:
    """Split a fused qkv[T, (Hq + 2 Hk) * D], rotate q and k, write k and v into the caches;
    returns the rotated q [T, Hq, D]."""
    num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    q, k = apply_rotary(q, k, positions, cos_sin_cache)
    fill_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's cached K or V in order: [context_len, Hk, D]."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.flatten(0, 1)[:context_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    ctx: StepContext, scale: float) -> torch.Tensor:
    """Attention of the new tokens q[T, Hq, D] over each sequence's whole cached context.

    The new tokens of sequence i sit at positions context_len_i - query_len_i ...
    context_len_i - 1 and see every cached token at or before their own position.
    Returns [T, Hq, D] in q's dtype; scores and softmax run in float32 for
    half-precision inputs (as HF eager does).
    """
    if ctx.is_decode:
        return _decode_attention(q, k_cache, v_cache, ctx, scale)
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(ctx.query_lens_list, ctx.context_lens_list)):
        out[start:start + q_len] = attend_one(q[start:start + q_len], k_cache, v_cache, ctx.block_tables[i],
                                              ctx_len, scale)
        start += q_len
    return out


def attend_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               context_len: int, scale: float) -> torch.Tensor:
    """One sequence's new tokens q[Lq, Hq, D], the last Lq of its context_len cached tokens."""
    k = _gather_context(k_cache, block_table, context_len)
    v = _gather_context(v_cache, block_table, context_len)
    return _prefill_one(q, k, v, scale)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q[Lq, Hq, D] against k, v[Lk, Hk, D]: the queries are the last Lq of the Lk positions."""
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gqa = num_heads != num_kv_heads
    if q_len == ctx_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # bottom-right aligned causal mask: query j sits at position ctx_len - q_len + j
        qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      ctx: StepContext, scale: float) -> torch.Tensor:
    """One query per sequence. The B contexts are gathered padded to the longest and masked;
    GQA groups the query heads of one KV head so K/V are never repeated."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_len = ctx.max_context_len
    num_blocks = (max_len + block_size - 1) // block_size
    table = ctx.block_tables[:, :num_blocks]
    if batch == 1:
        table = table[0]
        # k: [Hk, L, D]
        k = k_cache.index_select(0, table).flatten(0, 1)[:max_len].transpose(0, 1)
        v = v_cache.index_select(0, table).flatten(0, 1)[:max_len].transpose(0, 1)
        qg = q.view(num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, k.transpose(1, 2))            # [Hk, G, L]
        probs = _softmax(scores, scale, q.dtype)
        return torch.matmul(probs, v).view(1, num_heads, head_dim)
    # k: [B, Hk, L, D]
    flat = table.flatten()
    gathered = (batch, num_blocks * block_size, num_kv_heads, head_dim)
    k = k_cache.index_select(0, flat).view(gathered)[:, :max_len].transpose(1, 2)
    v = v_cache.index_select(0, flat).view(gathered)[:, :max_len].transpose(1, 2)
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(2, 3))                 # [B, Hk, G, L]
    if min(ctx.context_lens_list) < max_len:
        lens = ctx.context_lens.to(device=q.device, dtype=torch.long)
        pad = torch.arange(max_len, device=q.device)[None, :] >= lens[:, None]
        scores.masked_fill_(pad[:, None, None, :], float('-inf'))
    probs = _softmax(scores, scale, q.dtype)
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)


def _softmax(scores: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if scores.dtype == torch.float32:
        return torch.softmax(scores.mul_(scale), dim=-1)
    return torch.softmax(scores.float().mul_(scale), dim=-1).to(dtype)
