"""silu(gate) * up over x[T, 2I] = [gate | up]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(-1) == 1
    num_tokens, two_i = x.shape
    inter = two_i // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0),
                                                                       inter, BLOCK=block)
    return out
