"""ops.argmax (lib/kernels/csrc/cpu/argmax.h), both engines' greedy token: the AVX2 row and the
scalar reference against torch.argmax (ties to the lowest index, the first NaN before any number)
over lengths around the vector widths, ties, signed zeros, infinities, NaNs, row strides and both
index dtypes."""
from __future__ import annotations

import pytest
import torch
from torch.utils.dlpack import to_dlpack as dl

from lmd.kernels import ops


def argmax(x: torch.Tensor, reference: bool = False, dtype=torch.int64) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=dtype)
    ops.argmax(dl(x), dl(out), reference=reference)
    return out


def rows(V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, V, generator=g)
    x[1] = torch.randint(-3, 3, (V,), generator=g).float()        # many ties
    x[2] = -torch.inf                                              # all -inf: index 0
    x[3, V // 2:] = torch.inf                                      # the first +inf
    x[4] = 0.0                                                     # signed zeros: the first zero
    x[4, ::2] = -0.0
    x[5, V - 1] = torch.nan                                        # a NaN in the tail
    x[6, V // 3] = torch.nan                                       # NaNs: the first one
    x[6, V - 1] = torch.nan
    x[7, 0] = torch.nan
    x[8] = x[8].abs().neg()
    x[8, V - 1] = 1e30                                             # the last index
    return x


@pytest.mark.parametrize('V', [1, 7, 8, 9, 31, 32, 33, 100, 1000, 49152])
def test_argmax_equals_torch(V, kernel_isa):
    x = rows(V, seed=V)
    want = torch.argmax(x, dim=-1)
    assert torch.equal(argmax(x), want)
    assert torch.equal(argmax(x, reference=True), want)
    assert torch.equal(argmax(x, dtype=torch.int32), want.int())


def test_argmax_rows_with_a_stride_and_many_rows():
    big = torch.randn(40, 50000)
    x = big[:, 17:17 + 49152]                                      # unit stride in V, a row stride of 50000
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))


def test_argmax_bad_arguments_are_named():
    with pytest.raises(ValueError, match='logits'):
        argmax(torch.randn(3, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match='logits'):
        argmax(torch.randn(10, 3).T)                               # not unit stride in V
    with pytest.raises(ValueError, match='out'):
        ops.argmax(dl(torch.randn(3, 10)), dl(torch.empty(4, dtype=torch.int64)))
    with pytest.raises(ValueError, match='out'):
        ops.argmax(dl(torch.randn(3, 10)), dl(torch.empty(3, dtype=torch.float32)))
