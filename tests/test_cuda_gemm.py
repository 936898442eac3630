"""The quantized matmuls on the GPU (lmd.kernels.cuda.linear_w4a16 / linear_w8a16) against their CPU
references (ops.linear_w4a16 / linear_w8a16 with reference=True) on the same inputs, over the
shapes of SmolLM2-135M and Llama-8B, odd shapes, group sizes 32 and 128 and the three activation
dtypes; and the batch invariance the kernels promise (row m of y is the same bits whatever M).
Skipped without a CUDA device or a CUDA build."""
import math

import pytest
import torch

from lmd.kernels import cuda, ops
from lmd.weights.quant_layouts import unpack_int4
from cuda_utils import cap, requires_cuda_kernels, stream

pytestmark = requires_cuda_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, K) of SmolLM2-135M's matmuls: q/o, k/v, gate/up, down, lm head; then Llama-8B's q/o, gate/up, down
SMOL = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
LLAMA = [(4096, 4096), (14336, 4096), (4096, 14336)]
# N not a multiple of the kernel's 64 columns, K not a multiple of its 1024-wide slices (a last
# slice of one 32-wide chunk, or of 128), K below one slice
ODD = [(70, 96, 32), (130, 2080, 32), (33, 1152, 128), (1, 128, 128)]
# the relative spacing of the output dtype's values: one rounding of the same float may land on
# either side of a tie that the two sums straddle
EPS = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def inputs(kind, M, N, K, G, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    ng = K // G
    scales = torch.rand(N, ng, generator=g) * 0.02 + 1e-3
    if kind.startswith('w4'):
        qweight = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
        mins = -torch.rand(N, ng, generator=g) * 8 * scales  # Q4_0 / AWQ-like: min = -z s, z in 0..8
    else:
        qweight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        mins = None
    b = torch.randn(N, generator=g) if bias else None
    return x, qweight, scales, mins, b


def reference(kind, x, qweight, scales, mins, bias, G):
    y = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    b = cap(bias) if bias is not None else None
    if kind.startswith('w4'):
        ops.linear_w4a16(cap(x), cap(qweight), cap(scales), cap(mins), b, cap(y), G, reference=True)
    else:
        ops.linear_w8a16(cap(x), cap(qweight), cap(scales), b, cap(y), G, reference=True)
    return y


def on_gpu(kind, x, qweight, scales, mins, bias, G, y=None):
    """The kernel on GPU copies of the inputs (or on them if already there), into y (NaN-filled)."""
    d = lambda t: t.cuda() if t is not None else None  # noqa: E731
    x, qweight, scales, mins, bias = d(x), d(qweight), d(scales), d(mins), d(bias)
    if y is None:
        y = torch.full((x.shape[0], qweight.shape[0]), float('nan'), dtype=x.dtype, device='cuda')
    b = cap(bias) if bias is not None else None
    if kind == 'w4':
        cuda.linear_w4a16(cap(x), cap(qweight), cap(scales), cap(mins), b, cap(y), G, stream())
    elif kind == 'w4mma':
        cuda.linear_w4a16_mma(cap(x), cap(qweight), cap(scales), cap(mins), b, cap(y), G, stream())
    else:
        cuda.linear_w8a16(cap(x), cap(qweight), cap(scales), b, cap(y), G, stream())
    return y


def magnitude(kind, x, qweight, scales, mins, bias, G):
    """sum_k |x[m, k]| (|q[n, k]| scale[n, g] + |min[n, g]|) + |bias[n]|, on the GPU: what the
    float rounding of either sum is relative to (the min term's own products included, since
    q s + min may cancel)."""
    xa = x.cuda().float().abs()
    q = (unpack_int4(qweight.cuda()) if kind.startswith('w4') else qweight.cuda()).float().abs()
    wa = q * scales.cuda().repeat_interleave(G, dim=1)
    if mins is not None:
        wa += mins.cuda().abs().repeat_interleave(G, dim=1)
    s = xa @ wa.T
    if bias is not None:
        s += bias.cuda().abs()
    return s


def check(kind, M, N, K, G, dtype, bias, seed=0):
    if K % G:
        G = 64  # SmolLM2's K = 576 = 9 * 64 takes groups of 64 where a model would have 128
    x, qweight, scales, mins, b = inputs(kind, M, N, K, G, dtype, bias, seed)
    ref = reference(kind, x, qweight, scales, mins, b, G).cuda().float()
    out = on_gpu(kind, x, qweight, scales, mins, b, G).float()
    # Both sides add the same float32 products, exactly (an int4/int8 times a float32 scale and
    # a float16/bfloat16/float32 x): only the order of the additions differs. A sum of n terms in
    # float32 is within about n u sum|terms| (u = 2^-24) of the exact one; the reference's
    # longest chain is G products + K / G groups (+ scale, min, bias), the kernel's 32 in a chunk,
    # 5 of the warp's tree, one a 1024-wide slice (+ the same 3). Then each side rounds once to
    # the output dtype: at most one spacing (EPS |y|) apart on top. A wrong nibble, group or
    # column moves y by about |x| |w| ~ S / K, far over this bound. The tensor-core kernel adds
    # one 32-wide chunk inside mma (whose float accumulation need not round to nearest: counted
    # twice) and then the K / 32 chunks in a row.
    if kind == 'w4mma':
        n = (G + K // G + 3) + 2 * (32 + K // 32 + 3)
    else:
        n = (G + K // G + 3) + (32 + 5 + math.ceil(K / 1024) + 3)
    S = magnitude(kind, x, qweight, scales, mins, b, G)
    tol = n * 2.0 ** -24 * S * (1 + EPS[dtype]) + EPS[dtype] * ref.abs() + 1e-6
    err = (out - ref).abs()
    bad = ~(err <= tol)  # NaN (an output never written) counts as bad
    assert not bad.any(), (f'{int(bad.sum())} of {bad.numel()} outside the bound; worst err/tol '
                           f'{float((err / tol).nan_to_num(float("inf")).max()):.3g}')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('G', [32, 128])
@pytest.mark.parametrize('N,K', SMOL)
@pytest.mark.parametrize('M', [1, 3, 8, 9, 64, 200])
def test_w4a16_smollm(M, N, K, G, dtype):
    check('w4', M, N, K, G, dtype, bias=M % 2 == 1)  # bias with the odd M, none with the even


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('G', [32, 128])
@pytest.mark.parametrize('N,K', LLAMA)
@pytest.mark.parametrize('M', [1, 8, 9])
def test_w4a16_llama(M, N, K, G, dtype):
    check('w4', M, N, K, G, dtype, bias=M == 9)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('G', [32, 128])
@pytest.mark.parametrize('N,K', SMOL)
@pytest.mark.parametrize('M', [1, 3, 9, 64])
def test_w8a16_smollm(M, N, K, G, dtype):
    check('w8', M, N, K, G, dtype, bias=M % 2 == 1)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('N,K', LLAMA)
@pytest.mark.parametrize('M', [1, 9])
def test_w8a16_llama(M, N, K, dtype):
    check('w8', M, N, K, 32, dtype, bias=M == 9)


@pytest.mark.parametrize('kind', ['w4', 'w8'])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K,G', ODD)
@pytest.mark.parametrize('M', [1, 5, 13])
def test_odd_shapes(M, N, K, G, dtype, kind):
    check(kind, M, N, K, G, dtype, bias=True)


@pytest.mark.parametrize('kind', ['w4', 'w8'])
@pytest.mark.parametrize('dtype', DTYPES)
def test_strided_rows(kind, dtype):
    """x and y as column slices of wider tensors (row stride != K, N)."""
    M, N, K, G = 11, 200, 2048, 128
    x, qweight, scales, mins, b = inputs(kind, M, N, K, G, dtype, True, 7)
    xw = torch.zeros(M, K + 96, dtype=dtype)
    xw[:, 32:32 + K] = x
    yw = torch.full((M, N + 40), float('nan'), dtype=dtype, device='cuda')
    on_gpu(kind, xw.cuda()[:, 32:32 + K], qweight, scales, mins, b, G, y=yw[:, 8:8 + N])
    assert yw[:, :8].isnan().all() and yw[:, 8 + N:].isnan().all()  # nothing written outside y
    # the same kernel on the contiguous copy: the strides must not change a bit
    torch.testing.assert_close(yw[:, 8:8 + N], on_gpu(kind, x, qweight, scales, mins, b, G), atol=0, rtol=0)
    check(kind, M, N, K, G, dtype, True, seed=7)


@pytest.mark.parametrize('kind', ['w4', 'w8'])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K', [(1536, 576), (4096, 14336)])
def test_batch_invariance(kind, N, K, dtype):
    """One kernel serves every M and computes each row alone, in an order that depends only on K:
    a row's result is the same bits in a batch of 1 (decode), of 3 or 8, or of 200 (prefill), at
    any position."""
    G = 64
    x, qweight, scales, mins, b = inputs(kind, 200, N, K, G, dtype, True, 3)
    xd, qd, sd = x.cuda(), qweight.cuda(), scales.cuda()
    md = mins.cuda() if mins is not None else None
    full = on_gpu(kind, xd, qd, sd, md, b, G)
    for lo, hi in [(0, 1), (7, 8), (0, 3), (0, 8), (5, 14), (100, 164), (199, 200)]:
        part = on_gpu(kind, xd[lo:hi], qd, sd, md, b, G)
        assert torch.equal(part, full[lo:hi]), f'rows {lo}:{hi} differ from the same rows in a batch of 200'
    assert torch.equal(on_gpu(kind, xd, qd, sd, md, b, G), full)  # and from run to run


MMA_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize('dtype', MMA_DTYPES)
@pytest.mark.parametrize('G', [32, 128])
@pytest.mark.parametrize('N,K', SMOL)
@pytest.mark.parametrize('M', [9, 64, 200])
def test_w4a16_mma_smollm(M, N, K, G, dtype):
    check('w4mma', M, N, K, G, dtype, bias=M % 2 == 1)


@pytest.mark.parametrize('dtype', MMA_DTYPES)
@pytest.mark.parametrize('G', [32, 128])
@pytest.mark.parametrize('N,K', LLAMA)
@pytest.mark.parametrize('M', [9, 64])
def test_w4a16_mma_llama(M, N, K, G, dtype):
    check('w4mma', M, N, K, G, dtype, bias=M == 9)


@pytest.mark.parametrize('dtype', MMA_DTYPES)
@pytest.mark.parametrize('N,K,G', ODD)
@pytest.mark.parametrize('M', [1, 13, 70])
def test_w4a16_mma_odd_shapes(M, N, K, G, dtype):
    check('w4mma', M, N, K, G, dtype, bias=True)


@pytest.mark.parametrize('dtype', MMA_DTYPES)
def test_w4a16_mma_batch_invariance(dtype):
    """Each output of the tensor-core kernel comes from its own row of x and the same
    per-chunk steps: a row is the same bits in any batch and at any position in a 64-row tile
    (not the same bits as linear_w4a16, whose additions go in another order)."""
    N, K, G = 1536, 4096, 128
    x, qweight, scales, mins, b = inputs('w4', 200, N, K, G, dtype, True, 5)
    xd, qd, sd, md = x.cuda(), qweight.cuda(), scales.cuda(), mins.cuda()
    full = on_gpu('w4mma', xd, qd, sd, md, b, G)
    for lo, hi in [(0, 9), (5, 14), (100, 164), (150, 200), (199, 200)]:
        part = on_gpu('w4mma', xd[lo:hi], qd, sd, md, b, G)
        assert torch.equal(part, full[lo:hi]), f'rows {lo}:{hi} differ from the same rows in a batch of 200'
    assert torch.equal(on_gpu('w4mma', xd, qd, sd, md, b, G), full)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('M,K', [(1, 576), (7, 4096), (64, 1536), (3, 100), (5, 14336)])
def test_quantize_per_token(M, K, dtype):
    """The same float operations as the reference (127 / absmax, x * inv, round to nearest
    even, absmax / 127): the same bits."""
    g = torch.Generator().manual_seed(M * 7 + K)
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)
    x[M // 2] = 0  # a zero row: sx = 0 and xq = 0
    xq_ref, sx_ref = torch.empty(M, K, dtype=torch.int8), torch.empty(M)
    ops.quantize_per_token(cap(x), cap(xq_ref), cap(sx_ref), reference=True)
    xq = torch.full((M, K), -128, dtype=torch.int8, device='cuda')  # -128: never a result (|xq| <= 127)
    sx = torch.full((M,), float('nan'), device='cuda')
    cuda.quantize_per_token(cap(x.cuda()), cap(xq), cap(sx), stream())
    assert torch.equal(xq.cpu(), xq_ref) and torch.equal(sx.cpu(), sx_ref)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K', [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (4096, 14336), (70, 100)])
@pytest.mark.parametrize('M', [1, 9, 64])
def test_w8a8(M, N, K, dtype):
    """The int32 dot is exact in any order and the rest are the reference's float operations
    (float(dot) * sx * sw + bias, rounded once to y's dtype): float32 outputs are the same
    bits; float16/bfloat16 ones are held to one spacing of the dtype, should the two sides
    round the same float differently. K = 100 takes the unaligned, byte-by-byte weight path."""
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    qweight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, generator=g) * 0.01 + 1e-4
    bias = torch.randn(N, generator=g) if M != 9 else None
    ref = torch.empty(M, N, dtype=dtype)
    ops.linear_w8a8(cap(x), cap(qweight), cap(scales), cap(bias) if bias is not None else None, cap(ref),
                    reference=True)
    y = torch.full((M, N), float('nan'), dtype=dtype, device='cuda')
    cuda.linear_w8a8(cap(x.cuda()), cap(qweight.cuda()), cap(scales.cuda()),
                     cap(bias.cuda()) if bias is not None else None, cap(y), stream())
    out, ref = y.cpu().float(), ref.float()
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    else:
        assert ((out - ref).abs() <= EPS[dtype] * ref.abs() + 1e-6).all()


def test_bad_input_is_named():
    x = torch.zeros(2, 64, device='cuda')
    qw = torch.zeros(8, 32, dtype=torch.uint8, device='cuda')
    s = torch.zeros(8, 2, device='cuda')
    y = torch.zeros(2, 8, device='cuda')
    with pytest.raises(ValueError, match='not on a CUDA device'):
        cuda.linear_w4a16(cap(x.cpu()), cap(qw), cap(s), cap(s), None, cap(y), 32, stream())
    with pytest.raises(ValueError, match='group_size'):
        cuda.linear_w4a16(cap(x), cap(qw), cap(s), cap(s), None, cap(y), 48, stream())
    with pytest.raises(ValueError, match='^mins '):
        cuda.linear_w4a16(cap(x), cap(qw), cap(s), cap(s[:, :1].contiguous()), None, cap(y), 32, stream())
    with pytest.raises(ValueError, match='^y '):
        cuda.linear_w4a16(cap(x), cap(qw), cap(s), cap(s), None, cap(y.half()), 32, stream())
    with pytest.raises(ValueError, match='^bias '):
        cuda.linear_w4a16(cap(x), cap(qw), cap(s), cap(s), cap(torch.zeros(7, device='cuda')), cap(y), 32, stream())
    with pytest.raises(ValueError, match='^x .*float16 or bfloat16'):
        cuda.linear_w4a16_mma(cap(x), cap(qw), cap(s), cap(s), None, cap(y), 32, stream())
    with pytest.raises(ValueError, match='^scales '):
        cuda.linear_w8a8(cap(x), cap(qw.to(torch.int8).view(4, 64)), cap(s), None, cap(y[:, :4]), stream())
    with pytest.raises(ValueError, match='^xq '):
        cuda.quantize_per_token(cap(x), cap(torch.zeros(2, 64, dtype=torch.uint8, device='cuda')),
                                cap(torch.zeros(2, device='cuda')), stream())
    unaligned = torch.zeros(8 * 32 + 1, dtype=torch.uint8, device='cuda')[1:].view(8, 32)
    with pytest.raises(ValueError, match='16-byte aligned'):
        cuda.linear_w4a16(cap(x), cap(unaligned), cap(s), cap(s), None, cap(y), 32, stream())
    with pytest.raises(ValueError, match='^qweight .*int8'):
        cuda.linear_w8a16(cap(x), cap(qw), cap(s), None, cap(y), 32, stream())  # uint8, not int8
    with pytest.raises(ValueError, match="^qweight .*K = 64"):
        cuda.linear_w8a16(cap(x), cap(qw.to(torch.int8)), cap(s), None, cap(y), 32, stream())  # [8, 32], K = 64
