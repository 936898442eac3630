"""Paged attention on the GPU (lib/kernels/csrc/cuda/paged_attention.cu) against the CPU reference
ops.paged_decode_attention(..., reference=True) on CPU copies of the same inputs: the attention cases
the CPU tests use, SmolLM2 and Llama-8B heads over contexts on both sides of the 512-token partitions,
batches of sequences over shuffled blocks, float and int8/int4 caches, prefill rows with their causal
lengths (row_seqs), and the errors. Skipped without a CUDA device or a CUDA build."""
import pytest
import torch

from lmd.kernels import cuda, ops
from cuda_utils import cap, requires_cuda_kernels, stream
from kernel_cases import ATTN_CASES, make_ctx

pytestmark = requires_cuda_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# |gpu - cpu reference| <= atol + rtol |reference|. Both accumulate in float32 and differ only in
# summation order (lanes and warps, partitions merged by log-sum-exp) and in expf's rounding: ~1e-6
# relative to the terms summed. An output is an average of values up to ~8 here (the quantized
# cases), which can cancel to near 0, so float32 needs an absolute part of a few 1e-6 * 8: a float32
# emulation of the same partitioned sums in torch differed from the reference by at most 2.3e-5.
# The half types round the same float result once, so the two can differ by one unit in the last
# place where that result sits at a rounding boundary: 2^-10 |x| for float16, 2^-7 |x| for bfloat16.
TOL = {torch.float32: (5e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 8e-3)}
SMOL, LLAMA = (9, 3, 64), (32, 8, 128)  # (q heads, kv heads, head_dim)
LENGTHS = [1, 15, 16, 17, 511, 512, 513, 3000]


def quantize(cache: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [..., D] -> (uint8 codes [..., D * bits / 8], params float32 [..., 2] = scale, zero): the
    quantizer of cpu/kernels.h (tests/test_kv_quant.py checks the kernels against this one)."""
    x = cache.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    qmax = (1 << bits) - 1
    scale = (hi - lo) / qmax
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round((x - lo) * inv).clamp(0, qmax).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes.contiguous(), torch.cat([scale, lo], -1).contiguous()


def run_both(q, k_cache, v_cache, tables, lens, scale, row_seqs=None, k_params=None, v_params=None,
             workspace=None, window=0, sinks=None):
    """(gpu out, cpu reference out) for the same inputs; the GPU output starts as NaN, so a row it
    never writes fails the comparison."""
    ref = torch.empty_like(q)
    ref_tables = tables if row_seqs is None else tables[row_seqs.long()].contiguous()
    quant = {} if k_params is None else dict(k_params=cap(k_params), v_params=cap(v_params))
    ops.paged_decode_attention(cap(q), cap(k_cache), cap(v_cache), cap(ref_tables), cap(lens), scale, cap(ref),
                               reference=True, window=window, sinks=None if sinks is None else cap(sinks), **quant)
    dev = [t.cuda() for t in (q, k_cache, v_cache, tables, lens)]
    out = torch.full(q.shape, float('nan'), dtype=q.dtype, device='cuda')
    kw = {} if k_params is None else dict(k_params=cap(k_params.cuda()), v_params=cap(v_params.cuda()))
    if row_seqs is not None:
        kw['row_seqs'] = cap(row_seqs.cuda())
    if workspace is not None:
        kw['workspace'] = cap(workspace)
    if sinks is not None:
        kw['sinks'] = cap(sinks.cuda())
    cuda.paged_decode_attention(*(cap(t) for t in dev[:5]), scale, cap(out), stream(), window=window, **kw)
    return out.cpu(), ref


def close(got, ref, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


def prefill_rows(query_lens, context_lens):
    """row_seqs and the causal length of each query row: a sequence's last q_len tokens, in order."""
    seqs, lens = [], []
    for s, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        for j in range(q_len):
            seqs.append(s)
            lens.append(ctx_len - q_len + j + 1)
    return torch.tensor(seqs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('case', ATTN_CASES)
def test_attn_cases(case, dtype):
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim = case
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, block_size, num_kv_heads, head_dim, dtype)
    row_seqs, lens = prefill_rows(query_lens, context_lens)
    q = torch.randn(len(row_seqs), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = head_dim ** -0.5
    close(*run_both(q, k_cache, v_cache, ctx.block_tables, lens, scale, row_seqs=row_seqs), dtype)
    if all(n == 1 for n in query_lens):  # decode: one row per table, no row_seqs
        close(*run_both(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale), dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('length', LENGTHS)
@pytest.mark.parametrize('heads', [SMOL, LLAMA], ids=['smollm2', 'llama8b'])
def test_decode_lengths(heads, length, dtype):
    num_heads, num_kv_heads, head_dim = heads
    ctx, k_cache, v_cache = make_ctx([1], [length], 16, num_kv_heads, head_dim, dtype, seed=length)
    q = (torch.randn(1, num_heads, head_dim, generator=torch.Generator().manual_seed(length)) * 2).to(dtype)
    close(*run_both(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, head_dim ** -0.5), dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads', [SMOL, LLAMA], ids=['smollm2', 'llama8b'])
def test_decode_batch_over_shuffled_blocks(heads, dtype):
    num_heads, num_kv_heads, head_dim = heads
    lens = [3000, 1, 513, 17, 512, 16, 15, 511]
    ctx, k_cache, v_cache = make_ctx([1] * len(lens), lens, 16, num_kv_heads, head_dim, dtype, seed=5)
    # q and out as views with gaps between rows and heads (a fused qkv's layout)
    big = torch.randn(len(lens), num_heads + 4, head_dim + 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    q = big[:, 2:2 + num_heads, :head_dim]
    scale = head_dim ** -0.5
    ref = torch.empty(q.shape, dtype=dtype)
    ops.paged_decode_attention(cap(q), cap(k_cache), cap(v_cache), cap(ctx.block_tables), cap(ctx.context_lens),
                               scale, cap(ref), reference=True)
    out_big = torch.full((len(lens), num_heads + 1, head_dim * 2), float('nan'), dtype=dtype, device='cuda')
    out = out_big[:, 1:, :head_dim]
    cuda.paged_decode_attention(cap(big.cuda()[:, 2:2 + num_heads, :head_dim]), cap(k_cache.cuda()),
                                cap(v_cache.cuda()), cap(ctx.block_tables.cuda()), cap(ctx.context_lens.cuda()),
                                scale, cap(out), stream())
    close(out.cpu(), ref, dtype)
    assert out_big[:, 0].isnan().all() and out_big[:, :, head_dim:].isnan().all()  # nothing written outside out


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads', [SMOL, LLAMA, (4, 2, 24)], ids=['smollm2', 'llama8b', 'd24'])
def test_quantized_cache(heads, dtype, bits):
    num_heads, num_kv_heads, head_dim = heads
    lens = [1, 17, 513, 1200, 512]
    ctx, k_f, v_f = make_ctx([1] * len(lens), lens, 16, num_kv_heads, head_dim, torch.float32, seed=bits)
    (kc, kp), (vc, vp) = quantize(k_f * 2 + 0.3, bits), quantize(v_f * 2 - 0.1, bits)
    kp[0, 0, 0] = torch.tensor([0.0, 0.5])  # a constant row: scale 0
    q = (torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    got, ref = run_both(q, kc, vc, ctx.block_tables, ctx.context_lens, head_dim ** -0.5, k_params=kp, v_params=vp)
    close(got, ref, dtype)


@pytest.mark.parametrize('bits', [0, 8, 4])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_prefill_chunk_across_partitions(dtype, bits):
    # SmolLM2 heads: a 40-token chunk ending at 1100 (rows on both sides of 512 and 1024), a fresh
    # 9-token prefill and a decode row, over one call
    num_heads, num_kv_heads, head_dim = SMOL
    query_lens, context_lens = [40, 9, 1], [1100, 9, 700]
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, 16, num_kv_heads, head_dim,
                                     dtype if bits == 0 else torch.float32, seed=11)
    quant = {}
    if bits:
        (k_cache, kp), (v_cache, vp) = quantize(k_cache, bits), quantize(v_cache, bits)
        quant = dict(k_params=kp, v_params=vp)
    row_seqs, lens = prefill_rows(query_lens, context_lens)
    q = torch.randn(len(row_seqs), num_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    close(*run_both(q, k_cache, v_cache, ctx.block_tables, lens, head_dim ** -0.5, row_seqs=row_seqs, **quant),
          dtype)


@pytest.mark.parametrize('window', [1, 100, 512, 513, 4096])
@pytest.mark.parametrize('bits', [0, 8])
def test_sliding_window_prefill_and_decode_rows(bits, window):
    # rows whose windows start mid-block, mid-partition, or cover the whole context; the blocks wholly
    # before every window of a sequence are freed (-1): neither kernel may read them
    num_heads, num_kv_heads, head_dim = SMOL
    query_lens, context_lens = [40, 9, 1], [1100, 9, 700]
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, 16, num_kv_heads, head_dim, torch.float32, seed=12)
    quant = {}
    if bits:
        (k_cache, kp), (v_cache, vp) = quantize(k_cache, bits), quantize(v_cache, bits)
        quant = dict(k_params=kp, v_params=vp)
    row_seqs, lens = prefill_rows(query_lens, context_lens)
    tables = ctx.block_tables.clone()
    for s, (q_len, n) in enumerate(zip(query_lens, context_lens)):
        tables[s, :max(0, n - q_len + 1 - window) // 16] = -1
    q = torch.randn(len(row_seqs), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    close(*run_both(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, row_seqs=row_seqs, window=window,
                    **quant), torch.float32)


def test_workspace():
    assert cuda.paged_attention_workspace_size(4, 9, 64, 512) == 0  # one partition: none needed
    assert cuda.paged_attention_workspace_size(4, 9, 64, 513) == 4 * 9 * 2 * 66
    num_heads, num_kv_heads, head_dim = LLAMA
    lens = [3000, 7, 600]
    ctx, k_cache, v_cache = make_ctx([1] * 3, lens, 16, num_kv_heads, head_dim, torch.float32, seed=8)
    q = torch.randn(3, num_heads, head_dim, generator=torch.Generator().manual_seed(8))
    n = cuda.paged_attention_workspace_size(3, num_heads, head_dim, ctx.block_tables.shape[1] * 16)
    ws = torch.full((n,), float('nan'), device='cuda')
    close(*run_both(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, head_dim ** -0.5, workspace=ws),
          torch.float32)
    with pytest.raises(ValueError, match='workspace'):
        run_both(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, 1.0, workspace=ws[:n - 1])


def test_bad_rows_get_nan_and_the_others_are_right():
    # lengths and tables live on the device: the kernel, not the binding, meets a bad entry
    num_heads, num_kv_heads, head_dim = SMOL
    lens = [20, 700, 20, 600, 5]
    ctx, k_cache, v_cache = make_ctx([1] * 5, lens, 16, num_kv_heads, head_dim, torch.float32, seed=9)
    q = torch.randn(5, num_heads, head_dim, generator=torch.Generator().manual_seed(9))
    tables, bad_lens = ctx.block_tables.clone(), ctx.context_lens.clone()
    tables[0, 1] = k_cache.shape[0]     # a block past the cache
    tables[1, 40] = -1                  # in the second partition
    bad_lens[2] = 0                     # no context
    bad_lens[3] = tables.shape[1] * 16 + 1  # past the table
    out = torch.full(q.shape, float('nan'), device='cuda')
    cuda.paged_decode_attention(cap(q.cuda()), cap(k_cache.cuda()), cap(v_cache.cuda()), cap(tables.cuda()),
                                cap(bad_lens.cuda()), 0.125, cap(out), stream())
    out = out.cpu()
    assert out[:4].isnan().all()
    ref = torch.empty_like(q)
    ops.paged_decode_attention(cap(q), cap(k_cache), cap(v_cache), cap(ctx.block_tables), cap(ctx.context_lens),
                               0.125, cap(ref), reference=True)
    close(out[4], ref[4], torch.float32)


def test_bad_input_is_named():
    ctx, k_cache, v_cache = make_ctx([1], [5], 4, 2, 64, torch.float32)
    kc, vc, tables, lens = k_cache.cuda(), v_cache.cuda(), ctx.block_tables.cuda(), ctx.context_lens.cuda()
    q, out = torch.zeros(1, 4, 64, device='cuda'), torch.zeros(1, 4, 64, device='cuda')

    def call(q=q, kc=kc, vc=vc, tables=tables, lens=lens, out=out, **kw):
        kw = {k: cap(v) for k, v in kw.items()}
        cuda.paged_decode_attention(cap(q), cap(kc), cap(vc), cap(tables), cap(lens), 1.0, cap(out), stream(), **kw)

    call()
    with pytest.raises(ValueError, match='not on a CUDA device'):
        call(q=q.cpu())
    with pytest.raises(ValueError, match='head_dim 300 is not supported'):
        call(q=torch.zeros(1, 4, 300, device='cuda'))
    with pytest.raises(ValueError, match='heads must be a multiple'):
        call(q=torch.zeros(1, 3, 64, device='cuda'), out=torch.zeros(1, 3, 64, device='cuda'))
    with pytest.raises(ValueError, match='k_cache'):
        call(kc=kc.half(), vc=vc.half())
    with pytest.raises(ValueError, match='out'):
        call(out=torch.zeros(1, 4, 64, device='cuda', dtype=torch.float16))
    with pytest.raises(ValueError, match='block_tables'):
        call(tables=tables.long())
    with pytest.raises(ValueError, match='row_seqs'):
        call(row_seqs=torch.zeros(2, dtype=torch.int32, device='cuda'))
    codes = torch.zeros(*kc.shape[:3], 32, dtype=torch.uint8, device='cuda')
    params = torch.zeros(*kc.shape[:3], 2, device='cuda')
    with pytest.raises(ValueError, match='give both'):
        call(kc=codes, vc=codes, k_params=params)
    with pytest.raises(ValueError, match='v_params'):
        call(kc=codes, vc=codes, k_params=params, v_params=params[..., :1])
    call(kc=codes, vc=codes, k_params=params, v_params=params)  # 4 bits: D / 2 bytes a row


@pytest.mark.parametrize('window', [0, 100])
@pytest.mark.parametrize('bits', [0, 8])
def test_attention_sinks_prefill_and_decode_rows(bits, window):
    """gpt-oss's sink logit per head, in rows of one partition (the block adds it) and of several (the
    combine kernel adds it once), some sinks above every score, some far below."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    query_lens, context_lens = [40, 9, 1], [1100, 9, 700]
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, 16, num_kv_heads, head_dim, torch.float32, seed=13)
    quant = {}
    if bits:
        (k_cache, kp), (v_cache, vp) = quantize(k_cache, bits), quantize(v_cache, bits)
        quant = dict(k_params=kp, v_params=vp)
    row_seqs, lens = prefill_rows(query_lens, context_lens)
    q = torch.randn(len(row_seqs), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    sinks = torch.tensor([-30.0, 0.0, 1.5, 3.0, 6.0, -2.0, 0.7, 12.0])
    close(*run_both(q, k_cache, v_cache, ctx.block_tables, lens, head_dim ** -0.5, row_seqs=row_seqs, window=window,
                    sinks=sinks, **quant), torch.float32)
