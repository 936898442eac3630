"""TurboMind's packed float matmul (lmd.turbomind._turbomind.ops.linear_packed, csrc/kernels/cpu/gemm.h):
the AVX2 GEMM/GEMV against its scalar C++ reference, bit for bit, over a grid of shapes (tile
and chunk remainders in M, N and K) and weight dtypes; the reference against torch in float64;
rows independent of the batch and of the thread count; the panel layout and its round trip;
then the checks on bad arguments."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack as dl

from lmd.turbomind import _turbomind

ops = _turbomind.ops
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# the float64 result vs the reference: the inputs are exact, so only the float32 sums and
# the output's rounding to its dtype differ
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def pack(w: torch.Tensor) -> torch.Tensor:
    packed = torch.full(((w.shape[0] + 15) // 16, w.shape[1], 16), float('nan'), dtype=w.dtype)
    ops.pack_linear(dl(w), dl(packed))
    return packed


def linear_packed(x, packed, bias, n, reference=False):
    """packed: a tensor or an ops.HostTensor made of one."""
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    handle = packed if isinstance(packed, ops.HostTensor) else dl(packed)
    ops.linear_packed(dl(x), handle, None if bias is None else dl(bias), dl(y), reference=reference)
    return y


def with_threads(n, fn):
    old = ops.num_threads()
    try:
        ops.set_num_threads(n)
        return fn()
    finally:
        ops.set_num_threads(old)


# -- the panel layout -----------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K', [(1, 1), (16, 5), (17, 8), (40, 33)])
def test_pack_layout_and_round_trip(N, K, dtype):
    w = rand(N, K, dtype=dtype, seed=N + K)
    packed = pack(w)
    assert packed.shape == ((N + 15) // 16, K, 16)
    n = torch.arange(N)
    assert torch.equal(packed[n // 16, :, n % 16], w)            # packed[p, k, j] = w[16 p + j, k]
    tail = packed.permute(0, 2, 1).reshape(-1, K)[N:]
    assert torch.equal(tail, torch.zeros_like(tail))              # columns past N are zero
    back = torch.empty_like(w)
    ops.unpack_linear(dl(packed), dl(back))
    assert torch.equal(back, w)


# -- the AVX2 kernel against the reference ----------------------------------------------------------

# M: the small-M paths (1..5), 6-row tiles and their remainders; K: below, at and past the
# 256-wide chunks of k; N: whole and partial panels. (130, K=576) and (70, K=1536) span two
# blocks of rows.
SHAPES = [(1, 8), (7, 13), (16, 64), (17, 257), (100, 576), (45, 1536)]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K', SHAPES)
@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 33, 70])
def test_linear_packed_equals_reference(M, N, K, dtype):
    x, w, b = rand(M, K, dtype=dtype, seed=1), rand(N, K, dtype=dtype, seed=2), rand(N, dtype=dtype, seed=3)
    packed = pack(w)
    for bias in (None, b):
        got = linear_packed(x, packed, bias, N)
        ref = linear_packed(x, packed, bias, N, reference=True)
        assert torch.equal(got, ref), (got.double() - ref.double()).abs().max()
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        torch.testing.assert_close(ref.double(), want, atol=TOL[dtype]['atol'] * K ** 0.5, rtol=TOL[dtype]['rtol'])


@pytest.mark.parametrize('M,K', [(130, 576), (70, 1536)])
def test_linear_packed_row_blocks(M, K):
    x, w = rand(M, K, seed=4), rand(40, K, seed=5)
    packed = pack(w)
    assert torch.equal(linear_packed(x, packed, None, 40), linear_packed(x, packed, None, 40, reference=True))


@pytest.mark.parametrize('x_dtype,w_dtype', [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize('M', [1, 9])
def test_linear_packed_mixed_dtypes(M, x_dtype, w_dtype):
    x, w, b = rand(M, 96, dtype=x_dtype, seed=6), rand(50, 96, dtype=w_dtype, seed=7), rand(50, dtype=w_dtype, seed=8)
    packed = pack(w)
    got, ref = linear_packed(x, packed, b, 50), linear_packed(x, packed, b, 50, reference=True)
    assert got.dtype == x_dtype and torch.equal(got, ref)


@pytest.mark.parametrize('dtype', DTYPES)
def test_non_finite_and_overflowing_values_round_alike(dtype):
    """inf, NaN and sums that overflow the output's dtype: the same bits as the reference."""
    big = torch.finfo(dtype).max
    x = torch.tensor([[1.0, 0.0], [float('inf'), 1.0], [float('nan'), 1.0], [big, big], [-big, -big], [1.0, 1.0]],
                     dtype=dtype)
    w = torch.tensor([[1.0, 1.0], [1.0, -1.0], [0.5, 0.25], [-1.0, 1.0 / 3]] * 5, dtype=dtype)
    packed = pack(w)
    for M in (1, 6):
        got, ref = linear_packed(x[:M], packed, None, 20), linear_packed(x[:M], packed, None, 20, reference=True)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits), ref.view(bits))
    assert not torch.isfinite(got).all()


# -- batch invariance -------------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', DTYPES)
def test_rows_do_not_depend_on_the_batch_or_the_threads(dtype):
    """Row m is bitwise the same alone (the GEMV), inside any batch (GEMM tiles, row blocks), and
    on 1, 2 or 3 threads."""
    N, K = 300, 576
    x, w, b = rand(140, K, dtype=dtype, seed=9), rand(N, K, dtype=dtype, seed=10), rand(N, dtype=dtype, seed=11)
    packed = ops.HostTensor(dl(pack(w)))
    full = with_threads(2, lambda: linear_packed(x, packed, b, N))
    for threads in (1, 2, 3):
        for M in (1, 2, 3, 4, 5, 6, 7, 13, 64, 140):
            got = with_threads(threads, lambda: linear_packed(x[:M], packed, b, N))
            assert torch.equal(got, full[:M]), (threads, M)
        for m in (0, 5, 77, 139):
            alone = with_threads(threads, lambda: linear_packed(x[m:m + 1], packed, b, N))
            assert torch.equal(alone[0], full[m]), (threads, m)


def test_strided_rows_and_weight_handle():
    x = rand(9, 200, seed=12)[:, 10:138]      # row stride 200, unit stride inside a row
    w = rand(40, 128, seed=13)
    handle = ops.HostTensor(dl(pack(w)))
    assert handle.shape == (3, 128, 16) and handle.dtype == 'float32'
    y = torch.empty(9, 64)[:, :40]            # row stride 64
    ops.linear_packed(dl(x), handle, None, dl(y))
    assert torch.equal(y, linear_packed(x.contiguous(), handle, None, 40, reference=True))


# -- bad arguments ---------------------------------------------------------------------------------

def test_bad_arguments_are_clear_errors():
    w = rand(20, 8)
    packed = pack(w)
    x = rand(3, 8)
    with pytest.raises(ValueError, match=r'packed .*must be \[2, 8, 16\] with w\'s dtype'):
        ops.pack_linear(dl(w), dl(torch.zeros(1, 8, 16)))
    with pytest.raises(ValueError, match='contiguous float \\[P, K, 16\\]'):
        ops.pack_linear(dl(w), dl(torch.zeros(2, 8, 8)))
    with pytest.raises(ValueError, match="K must match x's 9"):
        ops.linear_packed(dl(rand(3, 9)), dl(packed), None, dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match=r'ceil\(N / 16\) = 2 panels'):
        ops.linear_packed(dl(x), dl(packed), None, dl(torch.empty(3, 40)))
    with pytest.raises(ValueError, match="x's M and dtype"):
        ops.linear_packed(dl(x), dl(packed), None, dl(torch.empty(3, 20, dtype=torch.float16)))
    with pytest.raises(ValueError, match="must be \\[N\\] with packed's dtype"):
        ops.linear_packed(dl(x), dl(packed), dl(torch.zeros(20, dtype=torch.float16)), dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match='ceil\\(N / 16\\) = P'):
        ops.unpack_linear(dl(packed), dl(torch.empty(40, 8)))
