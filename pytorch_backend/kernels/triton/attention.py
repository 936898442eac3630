"""Paged decode attention: one query token per sequence over its cached context.

One program per (sequence, query head) walks the sequence's block table with an
online softmax in float32. Steps that carry prefill chunks take the torch
version (gather + SDPA) until a Triton prefill kernel lands.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...context import StepContext
from .. import torch_ops


@triton.jit
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, ctx_len_ptr, out_ptr,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh, stride_bt, stride_ot, stride_oh, scale,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_h = h // GROUP
    ctx_len = tl.load(ctx_len_ptr + b)
    offs_d = tl.arange(0, D_PAD)
    offs_s = tl.arange(0, BS_PAD)
    dmask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qt + h * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BS_PAD], float('-inf'), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BS_PAD], tl.float32), axis=0)
    acc = tl.zeros([D_PAD], tl.float32)
    num_blocks = tl.cdiv(ctx_len, BLOCK_SIZE)
    for j in range(0, num_blocks):
        block = tl.load(table_ptr + b * stride_bt + j).to(tl.int64)
        pos = j * BLOCK_SIZE + offs_s
        smask = (offs_s < BLOCK_SIZE) & (pos < ctx_len)
        mask = smask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + block * stride_kb + offs_s[:, None] * stride_ks + kv_h * stride_kh + offs_d[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(smask, s, float('-inf'))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(vc_ptr + block * stride_vb + offs_s[:, None] * stride_vs + kv_h * stride_vh + offs_d[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    ctx: StepContext, scale: float, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    # prefill chunks, sliding-window, soft-capped and sink layers (none here yet): torch
    if not ctx.is_decode or window or softcap or sinks is not None:
        return torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale, window=window, softcap=softcap, sinks=sinks)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    tables = ctx.block_tables
    _paged_decode_kernel[(batch, num_heads)](
        q, k_cache, v_cache, tables, ctx.context_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1), scale,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BS_PAD=triton.next_power_of_2(block_size))
    return out
