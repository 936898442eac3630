"""The kernel library's C++ CPU kernels (lmd.kernels.ops): each AVX2 kernel against its
scalar C++ reference (``reference=True``) and against the torch kernels of the PyTorch
backend, over a grid of shapes and dtypes; then the checks on bad arguments."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack as dl

from lmd.pytorch_backend.context import StepContext
from lmd.pytorch_backend.kernels import native, torch_ops
from lmd import kernels

ops = kernels.ops
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def test_dispatch_picks_the_best_instruction_set_and_can_be_capped():
    # every machine this project runs on has AVX2/FMA/F16C; elsewhere 'ref' is the fallback; AVX-512
    # (F, BW, VL, DQ) where the CPU has it, unless LMD_CPU_ISA caps it
    f = kernels.cpu_features()
    best = 'avx512' if all(f[k] for k in ('avx512f', 'avx512bw', 'avx512vl', 'avx512dq')) else \
        'avx2' if f['avx2'] and f['fma'] and f['f16c'] else 'ref'
    assert ops.supported_isas()[-1] == best
    import os
    if 'LMD_CPU_ISA' not in os.environ:
        assert ops.isa() == best
    old = ops.isa()
    try:
        ops.set_isa('ref')
        assert ops.isa() == 'ref' and not ops.avx512_vnni()
        ops.set_isa('')
        assert ops.isa() == best and ops.avx512_vnni() == (best == 'avx512' and f['avx512vnni'])
        with pytest.raises(ValueError, match="'avx1024' is not one of"):
            ops.set_isa('avx1024')
        assert ops.isa() == best
    finally:
        ops.set_isa(old)


def test_lmd_cpu_isa_caps_the_level_and_a_bad_value_is_named():
    import os
    import subprocess
    import sys

    def run(value):
        return subprocess.run([sys.executable, '-c', 'from lmd.kernels import ops; print(ops.isa())'],
                              capture_output=True, text=True, env={**os.environ, 'LMD_CPU_ISA': value}, check=True)
    best = ops.supported_isas()[-1]
    assert run('ref').stdout.strip() == 'ref'
    bad = run('avx9')
    assert bad.stdout.strip() == best and 'LMD_CPU_ISA=avx9 is not one of ref, avx2, avx512' in bad.stderr


# -- linear --------------------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('M', [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 70])
@pytest.mark.parametrize('N,K', [(1, 8), (7, 13), (96, 64), (250, 136), (1000, 576)])
def test_linear(M, N, K, dtype):
    x, w, b = rand(M, K, dtype=dtype, seed=1), rand(N, K, dtype=dtype, seed=2), rand(N, dtype=dtype, seed=3)
    want = F.linear(x.double(), w.double(), b.double())
    for bias in (None, b):
        got, ref = torch.empty(M, N, dtype=dtype), torch.empty(M, N, dtype=dtype)
        ops.linear(dl(x), dl(w), None if bias is None else dl(bias), dl(got))
        ops.linear(dl(x), dl(w), None if bias is None else dl(bias), dl(ref), reference=True)
        expect = want if bias is not None else F.linear(x.double(), w.double())
        tol = dict(atol=TOL[dtype]['atol'] * K ** 0.5, rtol=TOL[dtype]['rtol'])
        torch.testing.assert_close(got.double(), expect, **tol)
        torch.testing.assert_close(got.double(), ref.double(), **tol)


def test_linear_rows_do_not_depend_on_the_batch():
    """Row m's result is bitwise the same alone, inside a batch, and on one or two threads."""
    x, w = rand(16, 576, seed=4), rand(300, 576, seed=5)
    alone = torch.empty(1, 300)
    ops.linear(dl(x[5:6]), dl(w), None, dl(alone))
    batched = torch.empty(16, 300)
    ops.linear(dl(x), dl(w), None, dl(batched))
    assert torch.equal(alone[0], batched[5])
    for m in range(2, 10):  # the few-rows tiles (a drafted step's rows) and the GEMM's
        few = torch.empty(m, 300)
        ops.linear(dl(x[:m]), dl(w), None, dl(few))
        assert torch.equal(few, batched[:m]), m
    threads = ops.num_threads()
    try:
        ops.set_num_threads(1)
        single = torch.empty(16, 300)
        ops.linear(dl(x), dl(w), None, dl(single))
    finally:
        ops.set_num_threads(threads)
    assert torch.equal(single, batched)


def test_linear_strided_rows_and_weight_handle():
    x = rand(4, 100, seed=6)[:, 10:74]      # row stride 100, unit stride inside a row
    w = rand(40, 64, seed=7)
    handle = ops.HostTensor(dl(w))
    assert handle.shape == (40, 64) and handle.dtype == 'float32'
    out = torch.empty(4, 40)
    ops.linear(dl(x), handle, None, dl(out))
    torch.testing.assert_close(out, x @ w.T, **TOL[torch.float32])


def test_native_linear_matches_torch_linear_for_any_rows():
    w, b = rand(64, 48, seed=8), rand(64, seed=9)
    params = native.prepare_linear(w, b)
    for rows in (1, 7, 32, 33, 100):
        x = rand(rows, 48, seed=rows)
        torch.testing.assert_close(native.linear(x, params), F.linear(x, w, b), **TOL[torch.float32])


# -- decode attention ----------------------------------------------------------------------------

def make_decode_ctx(context_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    max_blocks = max((n + block_size - 1) // block_size for n in context_lens)
    num_blocks = len(context_lens) * max_blocks + 3
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, unordered blocks
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(context_lens):
        for j in range((n + block_size - 1) // block_size):
            tables[i, j] = perm.pop()
    k_cache = rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=seed + 1)
    v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=seed + 2)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    ctx = StepContext(kv_caches=[], block_size=block_size, slot_mapping=torch.zeros(len(context_lens), dtype=torch.int64),
                      query_lens=torch.ones(len(context_lens), dtype=torch.int32),
                      cu_query_lens=torch.arange(len(context_lens) + 1, dtype=torch.int32), context_lens=lens,
                      block_tables=tables, is_decode=True, query_lens_list=[1] * len(context_lens),
                      context_lens_list=list(context_lens))
    return ctx, k_cache, v_cache


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('context_lens,block_size', [([1], 4), ([37], 16), ([5, 64, 17], 16), ([300, 2, 129, 64, 9], 32)])
@pytest.mark.parametrize('num_heads,num_kv_heads,head_dim', [(4, 4, 8), (6, 2, 64), (9, 3, 64), (4, 2, 12), (2, 1, 128)])
def test_paged_decode_attention(context_lens, block_size, num_heads, num_kv_heads, head_dim, dtype):
    ctx, k_cache, v_cache = make_decode_ctx(context_lens, block_size, num_kv_heads, head_dim, dtype)
    q = rand(len(context_lens), num_heads, head_dim, dtype=dtype, seed=9, scale=2.0)
    scale = head_dim ** -0.5
    want = torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale)
    got = native.paged_attention(q, k_cache, v_cache, ctx, scale)
    ref = torch.empty_like(q)
    ops.paged_decode_attention(dl(q), dl(k_cache), dl(v_cache), dl(ctx.block_tables), dl(ctx.context_lens), scale,
                               dl(ref), reference=True)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(ref, want, **TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('Hq,Hk,D,block_size', [(9, 3, 64, 16), (8, 8, 128, 7), (12, 2, 72, 24), (4, 1, 8, 64)])
@pytest.mark.parametrize('softcap,sinks', [(0.0, False), (1.5, True)])
def test_prefill_rows_in_tiles_are_the_decode_kernel_bit_for_bit(Hq, Hk, D, block_size, softcap, sinks, dtype):
    """A prefill chunk's rows (one table, causal lengths) go to the kernel in tiles that read each run of keys
    and values once for several rows and query heads: every row's result is the per-row decode kernel's, bit for
    bit (that kernel still serves a window, here one longer than every row: the same attention)."""
    T, g = 77, torch.Generator().manual_seed(3)
    blocks = (T + block_size - 1) // block_size
    k_cache, v_cache = (rand(blocks + 3, block_size, Hk, D, dtype=dtype, seed=s) for s in (1, 2))
    table = torch.randperm(blocks + 3, generator=g)[:blocks].to(torch.int32)
    tables = torch.cat([table.repeat(T - 3, 1), torch.randperm(blocks + 3, generator=g)[:blocks].to(torch.int32)
                        .repeat(3, 1)]).contiguous()  # the last three rows another sequence's
    lens = torch.cat([torch.arange(1, T - 2), torch.tensor([5, 40, 41])]).to(torch.int32)
    q = rand(T, Hq, D, dtype=dtype, seed=4, scale=2.0)
    sink_logits = rand(Hq, seed=5) if sinks else None
    outs = []
    for window in (0, T + 1):  # the tiles; the per-row kernel
        out = torch.full_like(q, float('nan'))
        ops.paged_decode_attention(dl(q), dl(k_cache), dl(v_cache), dl(tables), dl(lens), D ** -0.5, dl(out),
                                   window=window, softcap=softcap,
                                   sinks=None if sink_logits is None else dl(sink_logits))
        outs.append(out)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(outs[0].view(bits), outs[1].view(bits))


def window_attention(q, k, v, tables, context_lens, block_size, scale, window, softcap=0.0, sinks=None):
    """float32 attention of each query over its last ``window`` cached tokens (k, v float caches), the
    scaled scores soft-capped where ``softcap`` > 0; ``sinks`` [Hq]: a score per head with a zero value,
    its probability dropped (gpt-oss)."""
    group = q.shape[1] // k.shape[2]
    out = torch.empty(q.shape)
    for b, n in enumerate(context_lens):
        first = max(0, n - window)
        slots = [int(tables[b, t // block_size]) * block_size + t % block_size for t in range(first, n)]
        kb, vb = (c.reshape(-1, *c.shape[2:])[slots].float().repeat_interleave(group, 1) for c in (k, v))
        s = torch.einsum('hd,thd->ht', q[b].float(), kb) * scale
        s = torch.tanh(s / softcap) * softcap if softcap else s
        if sinks is not None:
            s = torch.cat([s, sinks[:, None]], -1)
            vb = torch.cat([vb, torch.zeros_like(vb[:1])])
        p = torch.softmax(s, -1)
        out[b] = torch.einsum('ht,thd->hd', p, vb)
    return out


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('window', [1, 5, 16, 37, 1000])
@pytest.mark.parametrize('bits', [0, 8, 4])
def test_paged_decode_attention_over_a_sliding_window(window, bits, dtype):
    """A sliding-window layer's queries read their last ``window`` tokens only (the first one mid-block);
    the blocks wholly before that may already be freed: their table entries are -1, never read."""
    check_window_attention(window, bits, dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('window', [5, 1000])
@pytest.mark.parametrize('bits', [0, 8, 4])
def test_paged_decode_attention_softcapped(window, bits, dtype):
    """Gemma 2's soft-capped scores, tanh(s / cap) * cap, with and without a window."""
    check_window_attention(window, bits, dtype, softcap=1.5)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('window', [5, 37, 1000])
@pytest.mark.parametrize('bits', [0, 8, 4])
def test_paged_decode_attention_with_sinks(window, bits, dtype):
    """gpt-oss's attention sinks, a logit per head in the softmax's denominator (some larger than every
    score, some far below), with and without a window; the torch reference against the same."""
    check_window_attention(window, bits, dtype, sinks=torch.tensor([-20.0, 0.3, 4.0, -1.0, 1.5, 9.0]))


def test_torch_paged_attention_with_sinks_matches_the_reference():
    context_lens, block_size, window = [3, 64, 100, 41], 16, 37
    ctx, k_cache, v_cache = make_decode_ctx(context_lens, block_size, 2, 64, torch.float32, seed=3)
    q = rand(len(context_lens), 6, 64, seed=4, scale=2.0)
    sinks = torch.tensor([-20.0, 0.3, 4.0, -1.0, 1.5, 9.0])
    for w in (0, window):
        want = window_attention(q, k_cache, v_cache, ctx.block_tables, context_lens, block_size, 0.125, w or 1000,
                                sinks=sinks)
        got = torch_ops.paged_attention(q, k_cache, v_cache, ctx, 0.125, window=w, sinks=sinks)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        torch.testing.assert_close(native.paged_attention(q, k_cache, v_cache, ctx, 0.125, window=w, sinks=sinks),
                                   want, **TOL[torch.float32])
    with pytest.raises(ValueError, match='sinks.*float32 \\[Hq\\]'):
        native.paged_attention(q, k_cache, v_cache, ctx, 0.125, sinks=sinks[:4])


def check_window_attention(window: int, bits: int, dtype: torch.dtype, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> None:
    """The kernel (AVX2 and scalar) against ``window_attention`` on a float or ``bits``-quantized cache."""
    from test_kv_quant import dequantize, empty_cache, pack, quantize_rows
    context_lens, block_size, num_heads, num_kv_heads, head_dim = [3, 64, 100, 41], 16, 6, 2, 64
    ctx, k_cache, v_cache = make_decode_ctx(context_lens, block_size, num_kv_heads, head_dim, dtype, seed=window)
    tables = ctx.block_tables.clone()
    for b, n in enumerate(context_lens):
        tables[b, :max(0, n - window) // block_size] = -1
    q = rand(len(context_lens), num_heads, head_dim, dtype=dtype, seed=window + 1, scale=2.0)
    scale = head_dim ** -0.5
    lens = dl(ctx.context_lens)
    quant = {}
    if bits:
        (kc, vc), (kp, vp) = empty_cache(k_cache.shape[0], block_size, num_kv_heads, head_dim, bits)
        for x, cache, params in ((k_cache, kc, kp), (v_cache, vc, vp)):
            codes, p = quantize_rows(x.float(), bits)
            cache.copy_(pack(codes, bits))
            params.copy_(p)
        k_cache, v_cache = dequantize(kc, kp, bits), dequantize(vc, vp, bits)   # what the kernel reads
        quant = dict(k_params=dl(kp), v_params=dl(vp))
        caches = (kc, vc)
    else:
        caches = (k_cache, v_cache)
    want = window_attention(q, k_cache, v_cache, ctx.block_tables, context_lens, block_size, scale, window, softcap,
                            sinks)
    for reference in (False, True):
        got = torch.empty_like(q)
        ops.paged_decode_attention(dl(q), dl(caches[0]), dl(caches[1]), dl(tables), lens, scale, dl(got),
                                   reference=reference, window=window, softcap=softcap,
                                   sinks=None if sinks is None else dl(sinks), **{k: v for k, v in quant.items()})
        tol = TOL[torch.float32] if dtype == torch.float32 else TOL[dtype]
        torch.testing.assert_close(got.float(), want, **tol)


def test_a_negative_window_is_a_clear_error():
    ctx, k_cache, v_cache = make_decode_ctx([5], 4, 1, 8, torch.float32)
    q = rand(1, 1, 8)
    with pytest.raises(ValueError, match='window = -1 must be >= 0'):
        ops.paged_decode_attention(dl(q), dl(k_cache), dl(v_cache), dl(ctx.block_tables), dl(ctx.context_lens), 1.0,
                                   dl(torch.empty_like(q)), window=-1)


# -- norm, rotary, activation --------------------------------------------------------------------

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('M,H', [(1, 8), (3, 576), (40, 64), (2, 20)])
def test_rms_norm_and_residual_add(M, H, dtype):
    x, w = rand(M, H, dtype=dtype, seed=10, scale=3.0), rand(H, dtype=dtype, seed=11)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6), **TOL[dtype])
    ref = torch.empty_like(x)
    ops.rms_norm(dl(x), dl(w), 1e-6, dl(ref), reference=True)
    torch.testing.assert_close(ref, torch_ops.rms_norm(x, w, 1e-6), **TOL[dtype])
    delta = rand(M, H, dtype=dtype, seed=12)
    res_native, res_torch = x.clone(), x.clone()
    got = native.add_rms_norm(delta, res_native, w, 1e-6)
    want = torch_ops.add_rms_norm(delta, res_torch, w, 1e-6)
    torch.testing.assert_close(res_native, res_torch, **TOL[dtype])   # the residual is updated in place
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('num_heads,num_kv_heads,head_dim,rot', [(4, 2, 16, 16), (9, 3, 64, 64), (2, 2, 32, 16)])
def test_rope_fill_kv(num_heads, num_kv_heads, head_dim, rot, dtype):
    T, block_size, num_blocks = 7, 4, 6
    qkv = rand(T, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=13)
    positions = torch.tensor([0, 1, 2, 9, 30, 31, 5], dtype=torch.int64)
    slots = torch.tensor([3, 0, 22, 9, 12, 13, 1], dtype=torch.int64)
    freqs = torch.arange(64)[:, None] * (10000.0 ** (-torch.arange(rot // 2) / (rot // 2)))[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype)
    caches = {}
    for name, fn in (('native', native.rope_fill_kv), ('torch', torch_ops.rope_fill_kv)):
        k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q = fn(qkv, positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads)
        caches[name] = (q, k_cache, v_cache)
    for got, want in zip(caches['native'], caches['torch']):
        torch.testing.assert_close(got, want, **TOL[dtype])
    assert caches['native'][1].abs().sum() > 0


@pytest.mark.parametrize('bits', [0, 8, 4])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('Hq,Hk,D,rot', [(9, 3, 64, 64), (4, 2, 128, 64), (3, 1, 10, 6), (2, 2, 40, 40)])
def test_rope_fill_kv_vector_is_the_reference_bit_for_bit(Hq, Hk, D, rot, dtype, bits):
    """The AVX2 rows against the scalar reference: rotated q, the K and V cache rows (float, or int8 / int4
    codes and their scale and zero), every bit; half of rot a multiple of 8 or not, partial rotary."""
    if bits == 4 and D % 2:
        pytest.skip('int4 codes pack two a byte: an odd head_dim has no int4 cache')
    T, block_size, num_blocks = 11, 4, 6
    g = torch.Generator().manual_seed(Hq + D + bits)
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, generator=g) * 3).to(dtype)
    ang = torch.arange(512)[:, None] * (10000.0 ** (-torch.arange(rot // 2) / (rot // 2)))[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1).to(dtype)
    positions = torch.randint(0, 512, (T,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    width = {0: D, 8: D, 4: D // 2}[bits]
    outs = []
    for reference in (True, False):
        cache_dtype = dtype if not bits else torch.uint8
        kc, vc = (torch.zeros(num_blocks, block_size, Hk, width, dtype=cache_dtype) for _ in range(2))
        kept = [] if not bits else [torch.zeros(num_blocks, block_size, Hk, 2) for _ in range(2)]
        params = {} if not bits else dict(k_params=dl(kept[0]), v_params=dl(kept[1]))
        q = torch.full((T, Hq, D), float('nan'), dtype=dtype)
        kernels.ops.rope_fill_kv(dl(qkv), dl(positions), dl(cos_sin), dl(kc), dl(vc), dl(slots), dl(q), Hq, Hk,
                                 reference=reference, **params)
        outs.append([q, kc, vc, *kept])
    for want, got in zip(*outs):
        assert torch.equal(want.view(torch.uint8) if want.dtype != torch.uint8 else want,
                           got.view(torch.uint8) if got.dtype != torch.uint8 else got)
    assert outs[0][1].float().abs().sum() > 0


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('T,inter', [(1, 8), (5, 1536), (3, 13)])
def test_silu_and_mul(T, inter, dtype):
    x = rand(T, 2 * inter, dtype=dtype, seed=14, scale=6.0)
    x[0, 0], x[0, 1] = -100.0, 100.0   # exp over- and underflow stay finite
    torch.testing.assert_close(native.silu_and_mul(x), torch_ops.silu_and_mul(x), **TOL[dtype])


# -- bad arguments: a clear error naming the argument, never a wild read -------------------------

def test_bad_arguments_name_what_is_wrong():
    x, w, y = torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r'^w .*K must match'):
        ops.linear(dl(x), dl(torch.zeros(4, 9)), None, dl(y))
    with pytest.raises(ValueError, match=r'^y '):
        ops.linear(dl(x), dl(w), None, dl(torch.zeros(2, 5)))
    with pytest.raises(ValueError, match='DLPack capsule'):
        ops.linear(x, dl(w), None, dl(y))
    with pytest.raises(ValueError, match='unsupported dtype'):
        ops.linear(dl(x), dl(torch.zeros(4, 8, dtype=torch.float64)), None, dl(y))
    ctx, k_cache, v_cache = make_decode_ctx([5], 4, 1, 8, torch.float32)
    q, out = torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    bad_table = ctx.block_tables.clone()
    bad_table[0, 1] = 10_000
    with pytest.raises(ValueError, match=r'block_tables\[0, 1\] = 10000 is not a block'):
        ops.paged_decode_attention(dl(q), dl(k_cache), dl(v_cache), dl(bad_table), dl(ctx.context_lens), 1.0, dl(out))
    with pytest.raises(ValueError, match='context_lens'):
        ops.paged_decode_attention(dl(q), dl(k_cache), dl(v_cache), dl(ctx.block_tables),
                                   dl(torch.tensor([99], dtype=torch.int32)), 1.0, dl(out))
    qkv = torch.zeros(1, 3 * 8)
    k = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match=r'slots\[0\] = 8 is not a slot'):
        ops.rope_fill_kv(dl(qkv), dl(torch.zeros(1, dtype=torch.int64)), dl(torch.zeros(16, 8)), dl(k), dl(k.clone()),
                         dl(torch.tensor([8])), dl(torch.zeros(1, 1, 8)), 1, 1)


def test_mixed_step_attention_matches_torch():
    """Prefill chunks and decodes in one step: every row a query over its visible context."""
    query_lens, context_lens, block_size = [1, 5, 1, 9, 3], [20, 5, 64, 30, 3], 8
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    max_blocks = max((n + block_size - 1) // block_size for n in context_lens)
    num_blocks = len(context_lens) * max_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = torch.tensor([perm[i * max_blocks:(i + 1) * max_blocks] for i in range(len(context_lens))],
                          dtype=torch.int32)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    ctx = StepContext(kv_caches=[], block_size=block_size, slot_mapping=torch.zeros(cu[-1], dtype=torch.int64),
                      query_lens=torch.tensor(query_lens, dtype=torch.int32),
                      cu_query_lens=torch.tensor(cu, dtype=torch.int32),
                      context_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=tables,
                      is_decode=False, query_lens_list=query_lens, context_lens_list=context_lens)
    k_cache = rand(num_blocks, block_size, num_kv_heads, head_dim, seed=4)
    v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim, seed=5)
    q = rand(cu[-1], num_heads, head_dim, seed=6)
    want = torch_ops.paged_attention(q, k_cache, v_cache, ctx, 0.125)
    torch.testing.assert_close(native.paged_attention(q, k_cache, v_cache, ctx, 0.125), want, **TOL[torch.float32])
    # the per-step row data is derived once and reused by every layer
    assert 'native_row_tables' in ctx.derived and 'native_row_prefixes' in ctx.derived
    torch.testing.assert_close(native.paged_attention(q, k_cache, v_cache, ctx, 0.125), want, **TOL[torch.float32])
