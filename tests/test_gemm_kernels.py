"""The kernel library's packed matmuls (lmd.kernels.ops.linear_packed, linear_w4a16_packed, linear_w8a16_packed;
lib/kernels/csrc/cpu/gemm.h): each AVX2 and AVX-512 GEMM/GEMV (the kernel_isa fixture) against its
scalar C++ reference, bit for bit, over a grid of shapes (tile, chunk and row-block remainders in M,
N and K) and dtypes; the reference against torch in float64; rows independent of the batch and of
the thread count; the panel layouts and their round trips; then the checks on bad arguments."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack as dl

from lmd.kernels import ops
from lmd.turbomind import quant

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
def test_linear_packed_equals_reference(M, N, K, dtype, kernel_isa):
    x, w, b = rand(M, K, dtype=dtype, seed=1), rand(N, K, dtype=dtype, seed=2), rand(N, dtype=dtype, seed=3)
    packed = pack(w)
    for bias in (None, b):
        got = linear_packed(x, packed, bias, N)
        ref = linear_packed(x, packed, bias, N, reference=True)
        assert torch.equal(got, ref), (got.double() - ref.double()).abs().max()
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        torch.testing.assert_close(ref.double(), want, atol=TOL[dtype]['atol'] * K ** 0.5, rtol=TOL[dtype]['rtol'])


@pytest.mark.parametrize('M,K', [(130, 576), (70, 1536)])
def test_linear_packed_row_blocks(M, K, kernel_isa):
    x, w = rand(M, K, seed=4), rand(40, K, seed=5)
    packed = pack(w)
    assert torch.equal(linear_packed(x, packed, None, 40), linear_packed(x, packed, None, 40, reference=True))


@pytest.mark.parametrize('x_dtype,w_dtype', [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize('M', [1, 9])
def test_linear_packed_mixed_dtypes(M, x_dtype, w_dtype, kernel_isa):
    x, w, b = rand(M, 96, dtype=x_dtype, seed=6), rand(50, 96, dtype=w_dtype, seed=7), rand(50, dtype=w_dtype, seed=8)
    packed = pack(w)
    got, ref = linear_packed(x, packed, b, 50), linear_packed(x, packed, b, 50, reference=True)
    assert got.dtype == x_dtype and torch.equal(got, ref)


@pytest.mark.parametrize('dtype', DTYPES)
def test_non_finite_and_overflowing_values_round_alike(dtype, kernel_isa):
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
def test_rows_do_not_depend_on_the_batch_or_the_threads(dtype, kernel_isa):
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


# -- W4A16 in panels ------------------------------------------------------------------------------

def rand_w4a16(n, k, group_size, seed=0):
    """A random W4A16 weight shaped like a real one: w = scale * (q - z), z near 8."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001
    mins = -scales * (8 + torch.randn(n, k // group_size, generator=g))
    return quant.pack_int4(q), scales, mins


def pack_w4a16(qweight, scales, mins):
    panels = (qweight.shape[0] + 63) // 64
    qp = torch.full((panels, qweight.shape[1] // 4, 64), -1, dtype=torch.int32)
    sp, mp = (torch.full((panels, scales.shape[1], 64), float('nan'), dtype=scales.dtype) for _ in range(2))
    ops.pack_w4a16(dl(qweight), dl(scales), dl(mins), dl(qp), dl(sp), dl(mp))
    return qp, sp, mp


def w4a16_packed(x, panels, bias, n, reference=False):
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    ops.linear_w4a16_packed(dl(x), *(p if isinstance(p, ops.HostTensor) else dl(p) for p in panels),
                            None if bias is None else dl(bias), dl(y), reference=reference)
    return y


@pytest.mark.parametrize('scale_dtype', [torch.float32, torch.float16])
def test_w4a16_pack_layout_and_round_trip(scale_dtype):
    N, K, G = 70, 96, 32
    qweight, scales, mins = rand_w4a16(N, K, G, seed=1)
    scales, mins = scales.to(scale_dtype), mins.to(scale_dtype)
    qp, sp, mp = pack_w4a16(qweight, scales, mins)
    assert qp.shape == (2, K // 8, 64) and sp.shape == mp.shape == (2, K // G, 64)
    n = torch.arange(N)
    words = qweight.view(torch.int32)                             # the row's bytes as little-endian words
    assert torch.equal(qp[n // 64, :, n % 64], words)
    assert torch.equal(sp[n // 64, :, n % 64], scales) and torch.equal(mp[n // 64, :, n % 64], mins)
    assert (qp[1, :, N - 64:] == 0).all() and (sp[1, :, N - 64:] == 0).all()   # columns past N
    back = torch.empty_like(qweight), torch.empty_like(scales), torch.empty_like(mins)
    ops.unpack_w4a16(dl(qp), dl(sp), dl(mp), *(dl(t) for t in back))
    assert all(torch.equal(a, b) for a, b in zip(back, (qweight, scales, mins)))


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K,G', [(1, 32, 32), (7, 64, 32), (70, 576, 32), (33, 1536, 64), (100, 384, 128)])
@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 6, 7, 13, 70])
@pytest.mark.parametrize('scale_dtype', [torch.float32, torch.float16])
def test_w4a16_packed_equals_reference(M, N, K, G, dtype, scale_dtype, kernel_isa):
    """And the reference stays within tests/test_quant_kernels.py's tolerance of the float64
    product with the dequantized weights. Scales and mins in float16 (GGUF's blocks) give the
    same result as the same values in float32."""
    qweight, scales, mins = rand_w4a16(N, K, G, seed=M + N)
    if scale_dtype == torch.float16:
        scales, mins = scales.half(), mins.half()
        as_f32 = w4a16_packed(rand(M, K, dtype=dtype, seed=2), pack_w4a16(qweight, scales.float(), mins.float()),
                              None, N)
    panels = pack_w4a16(qweight, scales, mins)
    if scale_dtype == torch.float16:
        assert torch.equal(w4a16_packed(rand(M, K, dtype=dtype, seed=2), panels, None, N), as_f32)
        scales, mins = scales.float(), mins.float()
    x, b = rand(M, K, dtype=dtype, seed=2), rand(N, seed=3)
    for bias in (None, b):
        got, ref = w4a16_packed(x, panels, bias, N), w4a16_packed(x, panels, bias, N, reference=True)
        assert torch.equal(got, ref), (got.double() - ref.double()).abs().max()
        want = F.linear(x.double(), quant.dequantize_w4a16(qweight, scales, mins).double(),
                        None if bias is None else bias.double())
        tol = dict(atol=2e-6 * K ** 0.5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
        torch.testing.assert_close(ref.double(), want, **tol)


def assert_rows_independent(run, x, sizes=(1, 2, 3, 4, 5, 6, 13), rows=(7,)):
    """run(x rows) -> y: each row of y is bitwise the same whatever rows share the call (the first
    M, or one alone) and on 1, 2 or 3 threads."""
    full = with_threads(2, lambda: run(x))
    for threads in (1, 2, 3):
        for M in (*sizes, x.shape[0]):
            assert torch.equal(with_threads(threads, lambda: run(x[:M])), full[:M]), (threads, M)
        for m in (*rows, x.shape[0] - 1):
            assert torch.equal(with_threads(threads, lambda: run(x[m:m + 1]))[0], full[m]), (threads, m)


def test_w4a16_rows_do_not_depend_on_the_batch_or_the_threads(kernel_isa):
    N, K, G = 300, 576, 32
    panels = [ops.HostTensor(dl(t)) for t in pack_w4a16(*rand_w4a16(N, K, G, seed=4))]
    b = rand(N, seed=6)
    assert_rows_independent(lambda x: w4a16_packed(x, panels, b, N), rand(140, K, seed=5))


# -- W8A16 in panels ------------------------------------------------------------------------------

def rand_w8a16(n, k, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001


def pack_w8a16(qweight, scales):
    panels = (qweight.shape[0] + 15) // 16
    qp = torch.full((panels, qweight.shape[1], 16), -1, dtype=torch.int8)
    sp = torch.full((panels, scales.shape[1], 16), float('nan'), dtype=scales.dtype)
    ops.pack_w8a16(dl(qweight), dl(scales), dl(qp), dl(sp))
    return qp, sp


def w8a16_packed(x, panels, bias, n, reference=False):
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    ops.linear_w8a16_packed(dl(x), *(p if isinstance(p, ops.HostTensor) else dl(p) for p in panels),
                            None if bias is None else dl(bias), dl(y), reference=reference)
    return y


@pytest.mark.parametrize('scale_dtype', [torch.float32, torch.float16])
def test_w8a16_pack_layout_and_round_trip(scale_dtype):
    N, K, G = 37, 96, 32
    q, s = rand_w8a16(N, K, G, seed=1)
    s = s.to(scale_dtype)
    qp, sp = pack_w8a16(q, s)
    n = torch.arange(N)
    assert torch.equal(qp[n // 16, :, n % 16], q) and torch.equal(sp[n // 16, :, n % 16], s)
    assert (qp[2, :, N - 32:] == 0).all() and (sp[2, :, N - 32:] == 0).all()   # columns past N
    back = torch.empty_like(q), torch.empty_like(s)
    ops.unpack_w8a16(dl(qp), dl(sp), *(dl(t) for t in back))
    assert torch.equal(back[0], q) and torch.equal(back[1], s)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K,G', [(1, 32, 32), (7, 64, 32), (70, 576, 32), (33, 1536, 64), (100, 384, 128),
                                   (40, 512, 16)])
@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 6, 7, 13, 40, 41, 70])
@pytest.mark.parametrize('scale_dtype', [torch.float32, torch.float16])
def test_w8a16_packed_equals_reference(M, N, K, G, dtype, scale_dtype, kernel_isa):
    """M: the GEMV tiles (1..5), the per-panel row tiles (6..40) and the GEMM past them. The reference
    stays within float32 rounding of the float64 product with the dequantized weights."""
    q, s = rand_w8a16(N, K, G, seed=M + N)
    s = s.to(scale_dtype)
    panels = pack_w8a16(q, s)
    x, b = rand(M, K, dtype=dtype, seed=2), rand(N, seed=3)
    for bias in (None, b):
        got, ref = w8a16_packed(x, panels, bias, N), w8a16_packed(x, panels, bias, N, reference=True)
        assert torch.equal(got, ref), (got.double() - ref.double()).abs().max()
        w = q.double() * s.double().repeat_interleave(G, dim=1)
        want = F.linear(x.double(), w, None if bias is None else bias.double())
        tol = dict(atol=2e-6 * K ** 0.5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
        torch.testing.assert_close(ref.double(), want, **tol)


def test_w8a16_rows_do_not_depend_on_the_batch_or_the_threads(kernel_isa):
    q, s = rand_w8a16(300, 576, 32, seed=7)
    panels = [ops.HostTensor(dl(t)) for t in pack_w8a16(q, s)]
    b = rand(300, seed=8)
    assert_rows_independent(lambda x: w8a16_packed(x, panels, b, 300), rand(140, 576, seed=9),
                            sizes=(1, 2, 3, 4, 5, 6, 13, 40, 41))


@pytest.mark.parametrize('M', [17, 40])
def test_many_panels_and_row_tiles_equal_reference(M, kernel_isa):
    """Enough panels on one thread for the AVX-512 kernels to take them in several L2-sized blocks
    (about 384 KiB of weights each), each met by every 16-row tile: float32, W4A16 and W8A16."""
    K = 576
    x = rand(M, K, seed=20)
    w = rand(700, K, seed=21)
    packed = pack(w)
    got = with_threads(1, lambda: linear_packed(x, packed, None, 700))
    assert torch.equal(got, linear_packed(x, packed, None, 700, reference=True))
    panels = pack_w4a16(*rand_w4a16(1400, K, 32, seed=22))
    got = with_threads(1, lambda: w4a16_packed(x, panels, None, 1400))
    assert torch.equal(got, w4a16_packed(x, panels, None, 1400, reference=True))
    panels = pack_w8a16(*rand_w8a16(800, K, 32, seed=23))
    got = with_threads(1, lambda: w8a16_packed(x, panels, None, 800))
    assert torch.equal(got, w8a16_packed(x, panels, None, 800, reference=True))


def test_rows_past_the_interleave_limit_equal_reference(kernel_isa):
    """Past 2^20 elements of x the AVX-512 kernels take the GEMM instead of 16-row tiles: the same bits."""
    M, K, N = 1100, 960, 40
    x = rand(M, K, seed=24)
    packed = pack(rand(N, K, seed=25))
    assert torch.equal(linear_packed(x, packed, None, N), linear_packed(x, packed, None, N, reference=True))
    panels = pack_w4a16(*rand_w4a16(N, K, 32, seed=26))
    assert torch.equal(w4a16_packed(x, panels, None, N), w4a16_packed(x, panels, None, N, reference=True))
    panels = pack_w8a16(*rand_w8a16(N, K, 32, seed=27))
    assert torch.equal(w8a16_packed(x, panels, None, N), w8a16_packed(x, panels, None, N, reference=True))


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
    qp, sp, mp = pack_w4a16(*rand_w4a16(20, 64, 32))
    with pytest.raises(ValueError, match=r'qpanels .*\[P4, K / 8, 64\]'):
        ops.linear_w4a16_packed(dl(rand(3, 64)), dl(qp[:, :, :16].contiguous()), dl(sp), dl(mp), None,
                                dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match='K = 64'):
        ops.linear_w4a16_packed(dl(rand(3, 32)), dl(qp), dl(sp), dl(mp), None, dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match=r'ceil\(N / 64\) = 1 panels'):
        ops.linear_w4a16_packed(dl(rand(3, 64)), dl(qp), dl(sp), dl(mp), None, dl(torch.empty(3, 70)))
    with pytest.raises(ValueError, match='float32 \\[N\\]'):
        ops.linear_w4a16_packed(dl(rand(3, 64)), dl(qp), dl(sp), dl(mp), dl(torch.zeros(20, dtype=torch.float16)),
                                dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match="mpanels .*must have spanels' shape and dtype"):
        ops.linear_w4a16_packed(dl(rand(3, 64)), dl(qp), dl(sp.half()), dl(mp), None, dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match="scales .*of spanels' dtype, float16"):
        q, s, m = rand_w4a16(20, 64, 32)
        ops.pack_w4a16(dl(q), dl(s), dl(m), dl(qp), dl(sp.half()), dl(mp.half()))
    qp8, sp8 = pack_w8a16(*rand_w8a16(20, 64, 32))
    with pytest.raises(ValueError, match=r'qpanels .*int8 \[P, K, 16\]'):
        ops.linear_w8a16_packed(dl(rand(3, 64)), dl(qp8.int()), dl(sp8), None, dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match='K = 64'):
        ops.linear_w8a16_packed(dl(rand(3, 32)), dl(qp8), dl(sp8), None, dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match=r'ceil\(N / 16\) = 2 panels'):
        ops.linear_w8a16_packed(dl(rand(3, 64)), dl(qp8), dl(sp8), None, dl(torch.empty(3, 40)))
    with pytest.raises(ValueError, match='G a multiple of 16'):  # 16: GGUF Q6_K's groups
        ops.linear_w8a16_packed(dl(rand(3, 64)), dl(qp8), dl(torch.zeros(2, 8, 16)), None, dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match=r'qpanels .*must be \[3, 64, 16\] for qweight \[40, 64\]'):
        ops.pack_w8a16(dl(rand_w8a16(40, 64, 32)[0]), dl(rand_w8a16(40, 64, 32)[1]), dl(qp8), dl(sp8))
