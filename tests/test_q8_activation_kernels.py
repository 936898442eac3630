"""The matmuls with activations quantized to int8 per 32 k, as llama.cpp's Q8_0 / Q8_1 blocks: W4A8 on
the W4A16 panels (ops.linear_w4a8_packed; lib/kernels/csrc/cpu/gemm.h) and W8A8 by groups on the
W8A16 layout (ops.linear_w8a8_group; lib/kernels/csrc/cpu/quant.h). Each AVX2 kernel (and W4A8's
AVX-512 VNNI one: the kernel_isa fixture) against its scalar C++ reference bit for bit over tile,
block and group remainders; the reference against the definition computed in torch (float64 sums of
the exact integer dots); the error against the float product within the activations' rounding bound;
rows independent of the batch and the thread count."""
from __future__ import annotations

import pytest
import torch
from torch.utils.dlpack import to_dlpack as dl

from lmd.kernels import ops
from lmd.turbomind import quant
from test_gemm_kernels import DTYPES, assert_rows_independent, pack_w4a16, rand, rand_w4a16


def w4a8_packed(x, panels, bias, n, reference=False):
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    ops.linear_w4a8_packed(dl(x), *(p if isinstance(p, ops.HostTensor) else dl(p) for p in panels),
                           None if bias is None else dl(bias), dl(y), reference=reference)
    return y


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (xq int64 [M, K], dx float32 [M, K / 32]) as gemm.h defines them."""
    blocks = x.view(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1) / torch.tensor(127.0)
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * inv[..., None]).clamp(-127, 127)  # torch.round: to nearest even
    return xq.view_as(x).long(), dx


def w4a8_definition(x, qweight, scales, mins, bias):
    """y in float64 from the integer dots and sums of each 32-block: what the kernel rounds to float32,
    the product of the dequantized w and x' = xq dx."""
    xf = x.float()
    M, K = xf.shape
    G = K // scales.shape[1]
    q = quant.unpack_int4(qweight).long()                       # [N, K]
    xq, dx = quantize_q8(xf)
    dots = torch.einsum('mbk,nbk->mnb', xq.view(M, -1, 32), q.view(q.shape[0], -1, 32))   # exact
    d = (dots.double() * dx.double()[:, None, :]).view(M, q.shape[0], -1, G // 32).sum(-1)
    xsum = (xq.view(M, -1, 32).sum(-1).double() * dx.double()).view(M, -1, G // 32).sum(-1)  # Q8_1's sums
    y = (d * scales.double()[None]).sum(-1) + xsum @ mins.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K,G', [(1, 32, 32), (7, 64, 32), (70, 576, 32), (33, 1536, 64), (100, 384, 128),
                                   (130, 96, 96)])
@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 6, 9, 37])
@pytest.mark.parametrize('scale_dtype', [torch.float32, torch.float16])
def test_w4a8_packed_equals_reference(M, N, K, G, dtype, scale_dtype, kernel_isa):
    qweight, scales, mins = rand_w4a16(N, K, G, seed=M + N)
    scales, mins = scales.to(scale_dtype), mins.to(scale_dtype)
    panels = pack_w4a16(qweight, scales, mins)
    x, b = rand(M, K, dtype=dtype, seed=2), rand(N, seed=3)
    x[0, :32] = 0  # a zero block: dx = 0
    for bias in (None, b):
        got, ref = w4a8_packed(x, panels, bias, N), w4a8_packed(x, panels, bias, N, reference=True)
        assert torch.equal(got, ref), (got.double() - ref.double()).abs().max()
        want = w4a8_definition(x, qweight, scales.float(), mins.float(), bias)
        tol = dict(atol=2e-6 * K ** 0.5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(ref.double(), want, **tol)


def test_w4a8_error_is_within_the_activation_rounding_bound(kernel_isa):
    """|y - x w| <= sum over k of |w[n, k]| dx[m, k / 32] / 2 (each xq off by at most half a step),
    and in practice far below it."""
    N, K, G = 200, 1536, 32
    qweight, scales, mins = rand_w4a16(N, K, G, seed=11)
    x = rand(8, K, seed=12)
    y = w4a8_packed(x, pack_w4a16(qweight, scales, mins), None, N).double()
    w = quant.dequantize_w4a16(qweight, scales, mins).double()
    exact = x.double() @ w.T
    _, dx = quantize_q8(x)
    bound = (dx.double().repeat_interleave(32, dim=1) / 2) @ w.abs().T
    err = (y - exact).abs()
    assert (err <= bound + 1e-4).all()
    assert err.max() < 0.25 * bound.max()          # the errors of a row's k mostly cancel
    assert err.max() < 2e-2 * exact.abs().max()    # a relative error of the order of 1 / 127


def test_w4a8_rows_do_not_depend_on_the_batch_or_the_threads(kernel_isa):
    N, K, G = 300, 576, 32
    panels = [ops.HostTensor(dl(t)) for t in pack_w4a16(*rand_w4a16(N, K, G, seed=4))]
    b = rand(N, seed=6)
    assert_rows_independent(lambda x: w4a8_packed(x, panels, b, N), rand(140, K, seed=5))


def test_w4a8_bad_arguments_are_the_w4a16_errors():
    qp, sp, mp = pack_w4a16(*rand_w4a16(20, 64, 32))
    with pytest.raises(ValueError, match='K = 64'):
        ops.linear_w4a8_packed(dl(rand(3, 32)), dl(qp), dl(sp), dl(mp), None, dl(torch.empty(3, 20)))
    with pytest.raises(ValueError, match='float32 \\[N\\]'):
        ops.linear_w4a8_packed(dl(rand(3, 64)), dl(qp), dl(sp), dl(mp), dl(torch.zeros(20, dtype=torch.float16)),
                               dl(torch.empty(3, 20)))


# -- W8A8 by groups ---------------------------------------------------------------------------------

def rand_w8(n, k, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, k // group_size, generator=g) * 0.01 + 1e-4


def w8a8_group(x, q, s, bias, n, group_size, reference=False):
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    ops.linear_w8a8_group(dl(x), *(p if isinstance(p, ops.HostTensor) else dl(p) for p in (q, s)),
                          None if bias is None else dl(bias), dl(y), group_size, reference=reference)
    return y


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('N,K,G', [(1, 32, 32), (7, 64, 32), (33, 576, 32), (130, 1536, 64), (9, 384, 128)])
@pytest.mark.parametrize('M', [1, 2, 3, 5, 9, 70])
def test_w8a8_group_equals_reference(M, N, K, G, dtype):
    q, s = rand_w8(N, K, G, seed=M + N)
    x, b = rand(M, K, dtype=dtype, seed=7), rand(N, seed=8)
    x[0, 32:64] = 0  # a zero block past the first (K = 32 keeps its one block)
    for bias in (None, b):
        got, ref = w8a8_group(x, q, s, bias, N, G), w8a8_group(x, q, s, bias, N, G, reference=True)
        assert torch.equal(got, ref), (got.double() - ref.double()).abs().max()
        xq, dx = quantize_q8(x.float())
        dots = torch.einsum('mbk,nbk->mnb', xq.view(M, -1, 32), q.long().view(N, -1, 32))
        want = (dots.double() * dx.double()[:, None, :] * s.double().repeat_interleave(G // 32, 1)[None]).sum(-1)
        if bias is not None:
            want = want + bias.double()
        tol = dict(atol=2e-6 * K ** 0.5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(ref.double(), want, **tol)


def test_w8a8_group_rows_do_not_depend_on_the_batch_or_the_threads():
    N, K, G = 301, 576, 32
    q, s = (ops.HostTensor(dl(t)) for t in rand_w8(N, K, G, seed=9))
    b = rand(N, seed=11)
    assert_rows_independent(lambda x: w8a8_group(x, q, s, b, N, G), rand(70, K, seed=10), sizes=(1, 2, 3, 69),
                            rows=(33,))


def test_w8a8_group_error_is_within_the_activation_rounding_bound():
    N, K, G = 100, 576, 32
    q, s = rand_w8(N, K, G, seed=12)
    x = rand(4, K, seed=13)
    w = (q.double() * s.double().repeat_interleave(G, 1))
    y = w8a8_group(x, q, s, None, N, G).double()
    _, dx = quantize_q8(x)
    bound = (dx.double().repeat_interleave(32, dim=1) / 2) @ w.abs().T
    err = (y - x.double() @ w.T).abs()
    assert (err <= bound + 1e-5).all() and err.max() < 0.25 * bound.max()


def test_w8a8_group_bad_arguments_are_the_w8a16_errors():
    q, s = rand_w8(20, 64, 32)
    with pytest.raises(ValueError) as w8a16_error:
        ops.linear_w8a16(dl(rand(3, 32)), dl(q), dl(s), None, dl(torch.empty(3, 20)), 32)
    with pytest.raises(ValueError) as error:
        ops.linear_w8a8_group(dl(rand(3, 32)), dl(q), dl(s), None, dl(torch.empty(3, 20)), 32)
    assert str(error.value) == str(w8a16_error.value)
