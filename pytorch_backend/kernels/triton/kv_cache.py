"""Scatter the new tokens' k, v[T, Hk, D] into k_cache, v_cache[num_blocks, block_size, Hk, D].

slot_mapping[T] = block_id * block_size + offset; a negative slot skips the token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fill_kv_cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_kcs, stride_kch, stride_vcs, stride_vch, num_kv_heads,
                          HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(kc_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
                 k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
                 v.to(vc_ptr.dtype.element_ty), mask=mask)


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    # a slot is one (block, offset) row of the cache: stride(1) steps slots within and across blocks
    if num_tokens:
        _fill_kv_cache_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), num_kv_heads,
            HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads),
            D_PAD=triton.next_power_of_2(head_dim))
