"""The kernel library's CUDA kernels (lib/kernels/csrc/cuda) against the CPU references they must
equal: the same random inputs on both devices, float32 to float rounding, float16/bfloat16 to one
or two units in the last place of the output dtype. Skipped without a CUDA device or a CUDA build."""
import pytest
import torch

from lmd.kernels import cuda, ops
from cuda_utils import cap, requires_cuda_kernels, stream

pytestmark = requires_cuda_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# |gpu - cpu reference| <= atol + rtol |reference|: float32 differs only by expf's rounding; the
# half types by one rounding of the output (both sides compute in float and round once)
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 8e-3)}


def close(gpu: torch.Tensor, ref: torch.Tensor, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(gpu.cpu().float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('T,I', [(1, 1536), (7, 576), (64, 8960), (3, 1)])
def test_silu_and_mul(T, I, dtype):
    g = torch.Generator().manual_seed(T * 1000 + I)
    x = (torch.randn(T, 2 * I, generator=g) * 3).to(dtype)
    ref = torch.empty(T, I, dtype=dtype)
    ops.silu_and_mul(cap(x), cap(ref), reference=True)
    xd = x.cuda()
    out = torch.full((T, I), float('nan'), dtype=dtype, device='cuda')
    cuda.silu_and_mul(cap(xd), cap(out), stream())
    close(out, ref, dtype)


def test_bad_input_is_named():
    x = torch.zeros(2, 6, device='cuda')
    with pytest.raises(ValueError, match='out'):
        cuda.silu_and_mul(cap(x), cap(torch.zeros(2, 4, device='cuda')), stream())
    with pytest.raises(ValueError, match='not on a CUDA device'):
        cuda.silu_and_mul(cap(x.cpu()), cap(torch.zeros(2, 3, device='cuda')), stream())


# rms_norm: the sum of squares is a tree on the GPU and a loop on the CPU, so float32 differs by its
# accumulation-order rounding (relative ~1e-6 over 4096 terms); in float16/bfloat16 that can move the
# normalised value, which both sides round to the dtype before the weight multiplies it, across a
# rounding boundary: one ulp there and one in the output, so two ulps (2^-9 float16, 2^-6 bfloat16).
NORM_TOL = {torch.float32: (1e-6, 2e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
NORM_SHAPES = [(1, 576), (7, 4096), (33, 1000), (5, 7), (2, 1)]


def rms_inputs(M, H, dtype, pad):
    g = torch.Generator().manual_seed(M * 7919 + H + pad)
    # pad: rows at a stride of H + pad (an unaligned row start when pad is odd: the scalar path)
    x = (torch.randn(M, H + pad, generator=g) * 2).to(dtype)[:, :H]
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    res = torch.randn(M, H + pad, generator=g).to(dtype)[:, :H]
    return x, w, res


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('M,H', NORM_SHAPES)
@pytest.mark.parametrize('pad', [0, 3])
@pytest.mark.parametrize('with_residual', [False, True])
def test_rms_norm(M, H, pad, with_residual, dtype):
    x, w, res = rms_inputs(M, H, dtype, pad)
    eps = 1e-5
    res_ref = res.clone()
    ref = torch.empty(M, H, dtype=dtype)
    ops.rms_norm(cap(x), cap(w), eps, cap(ref), cap(res_ref) if with_residual else None, reference=True)
    xd, wd, res_d = x.cuda(), w.cuda(), res.cuda()
    out = torch.full((M, H), float('nan'), dtype=dtype, device='cuda')
    cuda.rms_norm(cap(xd), cap(wd), eps, cap(out), cap(res_d) if with_residual else None, stream())
    atol, rtol = NORM_TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=rtol)
    # residual + x is one float add rounded once to the dtype on both sides: equal bit for bit
    torch.testing.assert_close(res_d.cpu(), res_ref if with_residual else res, atol=0, rtol=0)


def test_rms_norm_bad_input_is_named():
    x = torch.zeros(2, 8, device='cuda')
    out = torch.zeros(2, 8, device='cuda')
    with pytest.raises(ValueError, match='weight'):
        cuda.rms_norm(cap(x), cap(torch.ones(7, device='cuda')), 1e-5, cap(out), None, stream())
    with pytest.raises(ValueError, match='residual'):
        cuda.rms_norm(cap(x), cap(torch.ones(8, device='cuda')), 1e-5, cap(out),
                      cap(torch.zeros(2, 8, dtype=torch.float16, device='cuda')), stream())
    with pytest.raises(ValueError, match='not on a CUDA device'):
        cuda.rms_norm(cap(x.cpu()), cap(torch.ones(8, device='cuda')), 1e-5, cap(out), None, stream())


# argmax: exact. Ties go to the lowest index and the first NaN wins, as torch.argmax on the CPU and
# TurboMind's greedy sampler (strict >, so ties keep the lowest id) choose.
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('B,V', [(1, 49152), (4, 152064), (3, 1), (5, 1000), (2, 128256), (64, 32000)])
def test_argmax(B, V, dtype):
    g = torch.Generator().manual_seed(B * 131 + V)
    logits = (torch.randn(B, V, generator=g) * 4).to(dtype)
    if B >= 3 and V >= 8:
        logits[0] = torch.randint(0, 3, (V,), generator=g).to(dtype)  # many ties at the top
        logits[1] = float('-inf')
        logits[2, V // 2] = float('nan')
        logits[2, V - 1] = float('nan')
    ref = torch.argmax(logits, dim=-1).to(torch.int32)
    out = torch.full((B,), -7, dtype=torch.int32, device='cuda')
    cuda.argmax(cap(logits.cuda()), cap(out), stream())
    assert torch.equal(out.cpu(), ref), (out.cpu(), ref)


def test_argmax_strided_rows_and_bad_input():
    logits = torch.randn(3, 1000, device='cuda')[:, :999]  # a row stride of 1000, V = 999
    out = torch.full((3,), -7, dtype=torch.int32, device='cuda')
    cuda.argmax(cap(logits), cap(out), stream())
    assert torch.equal(out.cpu(), torch.argmax(logits.cpu(), dim=-1).to(torch.int32))
    with pytest.raises(ValueError, match='out'):
        cuda.argmax(cap(logits), cap(torch.zeros(3, dtype=torch.int64, device='cuda')), stream())
    with pytest.raises(ValueError, match='logits'):
        cuda.argmax(cap(torch.zeros(3, 0, device='cuda')), cap(out), stream())


# embedding: a copy, so exact.
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('id_dtype', [torch.int32, torch.int64])
@pytest.mark.parametrize('V,H,T,col', [(49152, 576, 9, 0), (1000, 4096, 3, 0), (17, 7, 5, 0), (300, 64, 6, 1)])
def test_embedding(V, H, T, col, id_dtype, dtype):
    g = torch.Generator().manual_seed(V + H * 3 + T)
    # col = 1: the table is a column slice, so its rows start unaligned (the scalar path)
    table = torch.randn(V, H + col, generator=g).to(dtype)[:, col:]
    ids = torch.randint(0, V, (T,), generator=g).to(id_dtype)
    ids[0] = V - 1
    out = torch.full((T, H), float('nan'), dtype=dtype, device='cuda')
    cuda.embedding(cap(ids.cuda()), cap(table.cuda()), cap(out), stream())
    assert torch.equal(out.cpu(), table[ids.long()])


@pytest.mark.parametrize('id_dtype', [torch.int32, torch.int64])
def test_embedding_out_of_range_id_gives_zeros(id_dtype):
    V, H = 100, 576
    table = torch.randn(V, H, dtype=torch.bfloat16)
    bad = [-1, V, 2**31 - 1] + ([2**40, -2**40] if id_dtype == torch.int64 else [])
    ids = torch.tensor([3] + bad + [V - 1], dtype=id_dtype)
    out = torch.full((len(ids), H), float('nan'), dtype=torch.bfloat16, device='cuda')
    cuda.embedding(cap(ids.cuda()), cap(table.cuda()), cap(out), stream())
    out = out.cpu()
    assert torch.equal(out[0], table[3]) and torch.equal(out[-1], table[V - 1])
    assert torch.equal(out[1:-1], torch.zeros(len(bad), H, dtype=torch.bfloat16))


def test_embedding_bad_input_is_named():
    table = torch.zeros(10, 8, device='cuda')
    out = torch.zeros(2, 8, device='cuda')
    with pytest.raises(ValueError, match='ids'):
        cuda.embedding(cap(torch.zeros(2, device='cuda')), cap(table), cap(out), stream())
    with pytest.raises(ValueError, match='out'):
        cuda.embedding(cap(torch.zeros(2, dtype=torch.int32, device='cuda')), cap(table),
                       cap(torch.zeros(2, 8, dtype=torch.float16, device='cuda')), stream())


# rope_fill_kv: the kernel does the reference's float operations one by one (no fused multiply-add),
# so the values agree to the output's rounding (TOL); a quantized code may move by one step where a
# float rounding apart lands (x - lo) * inv on the other side of a half, and scale / zero by float rounding.
ROPE_SHAPES = [  # T, Hq, Hk, D, rot, block_size, num_blocks
    (5, 9, 3, 64, 64, 16, 4),      # SmolLM2-135M
    (3, 32, 8, 128, 128, 16, 2),   # Llama-8B
    (33, 32, 8, 128, 64, 32, 3),   # partial rotary: the tail of each head passes through
    (7, 4, 1, 10, 6, 4, 3),        # odd sizes
]


def rope_inputs(T, Hq, Hk, D, rot, block_size, num_blocks, dtype, bits):
    g = torch.Generator().manual_seed(T * 31 + Hq * 7 + D + bits)
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, generator=g) * 2).to(dtype)
    max_pos = 4096
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype)
    positions = torch.randint(0, max_pos, (T,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]  # distinct: no two writes race
    if bits:
        width = D if bits == 8 else D // 2
        caches = [torch.full((num_blocks, block_size, Hk, width), 0xAB, dtype=torch.uint8) for _ in range(2)]
        params = [torch.full((num_blocks, block_size, Hk, 2), float('nan')) for _ in range(2)]
    else:
        caches = [torch.full((num_blocks, block_size, Hk, D), float('nan'), dtype=dtype) for _ in range(2)]
        params = [None, None]
    return qkv, positions, cos_sin, caches, slots, params


def rope_ref(qkv, positions, cos_sin, caches, slots, params, Hq, Hk):
    q = torch.full((qkv.shape[0], Hq, qkv.shape[1] // (Hq + 2 * Hk)), float('nan'), dtype=qkv.dtype)
    kc, vc = (c.clone() for c in caches)
    kp, vp = (None if p is None else p.clone() for p in params)
    ops.rope_fill_kv(cap(qkv), cap(positions), cap(cos_sin), cap(kc), cap(vc), cap(slots), cap(q), Hq, Hk,
                     reference=True, k_params=None if kp is None else cap(kp), v_params=None if vp is None else cap(vp))
    return q, kc, vc, kp, vp


def rope_gpu(qkv, positions, cos_sin, caches, slots, params, Hq, Hk):
    D = qkv.shape[1] // (Hq + 2 * Hk)
    q = torch.full((qkv.shape[0], Hq, D), float('nan'), dtype=qkv.dtype, device='cuda')
    kc, vc = (c.cuda() for c in caches)
    kp, vp = (None if p is None else p.cuda() for p in params)
    cuda.rope_fill_kv(cap(qkv.cuda()), cap(positions.cuda()), cap(cos_sin.cuda()), cap(kc), cap(vc),
                      cap(slots.cuda()), cap(q), Hq, Hk, None if kp is None else cap(kp),
                      None if vp is None else cap(vp), stream())
    return q.cpu(), kc.cpu(), vc.cpu(), None if kp is None else kp.cpu(), None if vp is None else vp.cpu()


def assert_codes_close(gpu, ref, bits):
    """Quantized rows: each code within one step of the reference's (nibbles compared one by one)."""
    if bits == 4:
        gpu = torch.stack([gpu & 0xF, gpu >> 4], dim=-1)
        ref = torch.stack([ref & 0xF, ref >> 4], dim=-1)
    diff = (gpu.int() - ref.int()).abs()
    assert diff.max() <= 1, f'{int((diff > 1).sum())} codes differ by more than one step'
    assert (diff > 0).float().mean() < 0.01, 'more than 1% of the codes differ'


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', ROPE_SHAPES)
@pytest.mark.parametrize('bits', [0, 8, 4])
def test_rope_fill_kv(shape, bits, dtype):
    T, Hq, Hk, D, rot, block_size, num_blocks = shape
    args = rope_inputs(*shape, dtype, bits)
    ref = rope_ref(*args, Hq, Hk)
    got = rope_gpu(*args, Hq, Hk)
    close(got[0], ref[0], dtype)
    if not bits:  # rows no token wrote stay NaN on both sides
        for g, r in zip(got[1:3], ref[1:3]):
            torch.testing.assert_close(g.float(), r.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1], equal_nan=True)
        return
    for g, r in zip(got[1:3], ref[1:3]):
        assert_codes_close(g, r, bits)
    for g, r in zip(got[3:5], ref[3:5]):  # scale, zero
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize('bits', [0, 8])
def test_rope_fill_kv_bad_position_or_slot_touches_nothing(bits):
    """positions and slots are device data the binding cannot check: a position outside the table gives
    q zeros and no k / v write, a slot outside the cache (-1: padding) no k / v write."""
    shape = (6, 9, 3, 64, 64, 16, 4)
    T, Hq, Hk = shape[:3]
    qkv, positions, cos_sin, caches, slots, params = rope_inputs(*shape, torch.float16, bits)
    positions[1] = cos_sin.shape[0]  # one past the table
    positions[2] = -5
    slots[3] = -1
    slots[4] = caches[0].shape[0] * caches[0].shape[1]  # one past the cache
    good = torch.tensor([0, 5])
    got = rope_gpu(qkv, positions, cos_sin, caches, slots, params, Hq, Hk)
    # q of every token with a valid position (slots of a scratch cache: q does not depend on them)
    q_ok = torch.tensor([0, 3, 4, 5])
    q_ref = rope_ref(qkv[q_ok], positions[q_ok], cos_sin, [c.clone() for c in caches],
                     torch.arange(len(q_ok)), [None if p is None else p.clone() for p in params], Hq, Hk)[0]
    close(got[0][q_ok], q_ref, torch.float16)
    assert torch.equal(got[0][1:3], torch.zeros(2, Hq, shape[3], dtype=torch.float16))
    # the caches: only the tokens with a valid position and slot wrote
    ref = rope_ref(qkv[good], positions[good], cos_sin, caches, slots[good], params, Hq, Hk)
    if bits:
        for g, r in zip(got[1:3], ref[1:3]):
            assert_codes_close(g, r, bits)
        for g, r in zip(got[3:5], ref[3:5]):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5, equal_nan=True)
    else:
        for g, r in zip(got[1:3], ref[1:3]):
            torch.testing.assert_close(g.float(), r.float(), atol=1e-3, rtol=1e-3, equal_nan=True)


def test_rope_fill_kv_bad_input_is_named():
    T, Hq, Hk, D = 2, 4, 2, 8
    dev = dict(device='cuda')
    qkv = torch.zeros(T, (Hq + 2 * Hk) * D, **dev)
    pos = torch.zeros(T, dtype=torch.int64, **dev)
    cs = torch.zeros(16, D, **dev)
    kc, vc = torch.zeros(2, 4, Hk, D, **dev), torch.zeros(2, 4, Hk, D, **dev)
    slots = torch.zeros(T, dtype=torch.int64, **dev)
    q = torch.zeros(T, Hq, D, **dev)

    def call(**kw):
        a = dict(qkv=qkv, pos=pos, cs=cs, kc=kc, vc=vc, slots=slots, q=q, kp=None, vp=None) | kw
        cuda.rope_fill_kv(cap(a['qkv']), cap(a['pos']), cap(a['cs']), cap(a['kc']), cap(a['vc']), cap(a['slots']),
                          cap(a['q']), Hq, Hk, None if a['kp'] is None else cap(a['kp']),
                          None if a['vp'] is None else cap(a['vp']), stream())

    call()  # the arguments as given are valid
    with pytest.raises(ValueError, match='q_out'):
        call(q=torch.zeros(T, Hq, D, dtype=torch.float16, **dev))
    with pytest.raises(ValueError, match='positions'):
        call(pos=torch.zeros(T, dtype=torch.int32, **dev))
    with pytest.raises(ValueError, match='cos_sin'):
        call(cs=torch.zeros(16, D + 2, **dev))
    with pytest.raises(ValueError, match='k_params and v_params'):
        call(kc=torch.zeros(2, 4, Hk, D, dtype=torch.uint8, **dev), kp=torch.zeros(2, 4, Hk, 2, **dev))
    with pytest.raises(ValueError, match='not on a CUDA device'):
        call(slots=slots.cpu())
