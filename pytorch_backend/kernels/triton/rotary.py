"""NeoX-style RoPE applied in place to q[T, Hq, D] and k[T, Hk, D] (strided views allowed).

cos_sin_cache: [max_position, rotary_dim] = cat(cos, sin); dims past rotary_dim pass through.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, t, num_heads, cos, sin,
                  HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    p1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_c, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, num_q_heads, cos, sin, HALF, HQ_PAD, HALF_PAD)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, num_k_heads, cos, sin, HALF, HK_PAD, HALF_PAD)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    num_tokens = q.shape[0]
    half = cos_sin_cache.shape[-1] // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos_sin_cache.stride(0), q.shape[1], k.shape[1],
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
            HQ_PAD=triton.next_power_of_2(q.shape[1]), HK_PAD=triton.next_power_of_2(k.shape[1]))
    return q, k
