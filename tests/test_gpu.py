"""The PyTorch engine on a CUDA device, against references on the CPU.

Its Triton kernels, compiled for the GPU, against the torch kernels (themselves checked against
plain references in tests/test_kernels.py) on the same inputs on the CPU; whole tiny models of
every architecture on the GPU against HF transformers float32 on the CPU; the engine end to end
(greedy tokens equal to HF's, a batch equal to each sequence alone, a prefix-cache hit equal to a
miss). ``tools/gpu_check.sh`` runs this file on a lent GPU; without a CUDA device it is skipped.
Run it in a pytest process of its own: tests/test_kernels.py sets TRITON_INTERPRET=1.
The last part does the same for kernel_backend='cuda' (lmd's own CUDA kernels, lmd.kernels.cuda),
skipped in a build without them.
"""
from __future__ import annotations

import random

import pytest
import torch

from cuda_utils import requires_cuda_kernels
from kernel_cases import ATTN_CASES, cos_sin, make_ctx
from lmd.engine import SamplingParams
from lmd.messages import PytorchEngineConfig
from lmd.pytorch_backend import PytorchEngine
from lmd.pytorch_backend.kernels import get_kernels, torch_ops
from lmd.pytorch_backend.models import build_model
from test_kv_quant import LOGIT_BOUND
from test_models import ARCHS as MODEL_ARCHS
from test_models import PagedRunner, hf_logits, make_hf_model, random_tokens, run_chunked
from test_pytorch_engine import (assert_no_leak, generate, hf_greedy, rand_prompt, tiny_engine,  # noqa: F401
                                 tiny_models)
from test_turbomind_formats import ENGINE as QUANT_ENGINE
from test_turbomind_formats import save_quantized
from test_turbomind_formats import tokens as quant_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA device')

CUDA = torch.device('cuda')
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(scope='module', autouse=True)
def exact_float32():
    # float32 matmuls in full precision (no TF32), so float32 logits can be held to 1e-3
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(scope='module')
def triton_kernels():
    from triton.runtime.interpreter import InterpretedFunction
    from lmd.pytorch_backend.kernels.triton import norm
    if isinstance(norm._rms_norm_kernel, InterpretedFunction):
        pytest.fail('TRITON_INTERPRET=1 is set in this process (tests/test_kernels.py sets it): '
                    'run tests/test_gpu.py in a pytest process of its own')
    return get_kernels(CUDA, 'triton')


def on_gpu(*ts):
    return [t.to(CUDA) for t in ts]


# ---- the Triton kernels on the GPU vs the torch kernels on the CPU -------------------------------------

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(1, 576), (7, 2048), (2, 4, 24)])
def test_rms_norm(triton_kernels, shape, dtype):
    x, w = torch.randn(shape).to(dtype), (1 + 0.3 * torch.randn(shape[-1])).to(dtype)
    got = triton_kernels.rms_norm(*on_gpu(x, w), 1e-6)
    torch.testing.assert_close(got.cpu(), torch_ops.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads,head_dim,rot_dim', [((4, 2), 16, 16), ((9, 3), 64, 64), ((32, 8), 128, 128),
                                                    ((3, 1), 24, 12)])
def test_apply_rotary(triton_kernels, heads, head_dim, rot_dim, dtype):
    positions = torch.tensor([0, 3, 17, 63, 1000])
    qkv = torch.randn(5, (heads[0] + 2 * heads[1]) * head_dim).to(dtype)
    cache = cos_sin(1024, rot_dim, dtype)
    split = heads[0] * head_dim, (heads[0] + heads[1]) * head_dim
    want_q, want_k = torch_ops.apply_rotary(qkv[:, :split[0]].reshape(5, heads[0], head_dim).clone(),
                                            qkv[:, split[0]:split[1]].reshape(5, heads[1], head_dim).clone(),
                                            positions, cache)
    # q and k as views of one fused qkv buffer on the GPU, rotated in place; v untouched
    g = qkv.to(CUDA)
    got_q, got_k = triton_kernels.apply_rotary(g[:, :split[0]].view(5, heads[0], head_dim),
                                               g[:, split[0]:split[1]].view(5, heads[1], head_dim),
                                               *on_gpu(positions, cache))
    torch.testing.assert_close(got_q.cpu(), want_q, **TOL[dtype])
    torch.testing.assert_close(got_k.cpu(), want_k, **TOL[dtype])
    assert torch.equal(g[:, split[1]:].cpu(), qkv[:, split[1]:])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows,inter', [(1, 1536), (33, 8192)])
def test_silu_and_mul(triton_kernels, rows, inter, dtype):
    x = torch.randn(rows, 2 * inter).to(dtype)
    torch.testing.assert_close(triton_kernels.silu_and_mul(x.to(CUDA)).cpu(), torch_ops.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
def test_fill_kv_cache(triton_kernels, dtype):
    kv = torch.randn(4, 2 * 3, 24).to(dtype)
    k, v = kv[:, :3], kv[:, 3:]
    slots = torch.tensor([13, 2, -1, 7])  # -1: a padding token, skipped
    keep = slots >= 0
    want_k, want_v = torch.zeros(6, 4, 3, 24, dtype=dtype), torch.zeros(6, 4, 3, 24, dtype=dtype)
    torch_ops.fill_kv_cache(k[keep], v[keep], want_k, want_v, slots[keep])
    g = kv.to(CUDA)
    got_k, got_v = torch.zeros_like(want_k, device=CUDA), torch.zeros_like(want_v, device=CUDA)
    triton_kernels.fill_kv_cache(g[:, :3], g[:, 3:], got_k, got_v, slots.to(CUDA))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def ctx_on_gpu(ctx):
    for name in ('slot_mapping', 'query_lens', 'cu_query_lens', 'context_lens', 'block_tables'):
        setattr(ctx, name, getattr(ctx, name).to(CUDA))
    ctx.kv_caches = [tuple(t.to(CUDA) for t in layer) for layer in ctx.kv_caches]
    return ctx


LONG_CASES = [([1] * 8, [1, 300, 4096, 17, 1023, 64, 2, 777], 16, 32, 8, 128),   # Llama-8B heads, long contexts
              ([1, 1], [129, 64], 64, 14, 2, 64)]                                 # block 64, GQA 7


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('case', ATTN_CASES + LONG_CASES)
def test_paged_attention(triton_kernels, case, dtype):
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim = case
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    want = torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale)
    ctx = ctx_on_gpu(ctx)
    got = triton_kernels.paged_attention(q.to(CUDA), *ctx.kv_caches[0], ctx, scale)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


# ---- whole models on the GPU vs HF float32 on the CPU -----------------------------------------------

@pytest.mark.parametrize('backend', ['triton', 'torch'])
@pytest.mark.parametrize('arch', list(MODEL_ARCHS))
def test_model_matches_hf(arch, backend):
    hf_model, config, weights = make_hf_model(arch)
    model = build_model(config, weights, torch.float32, device=CUDA, kernel_backend=backend)
    tokens = random_tokens(11 + 16, seed=3)
    ours = run_chunked(model, tokens, prefill_chunks=[7, 4])
    diff = (ours - hf_logits(hf_model, tokens)).abs().max().item()
    assert diff < 1e-3, f'{arch} on {backend}: max |logit diff| vs HF = {diff}'


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('arch', ['llama', 'qwen3'])
def test_half_precision_model_close_to_hf(arch, dtype):
    hf_model, config, weights = make_hf_model(arch)
    model = build_model(config, weights, dtype, device=CUDA, kernel_backend='triton')
    tokens = random_tokens(9 + 6, seed=5)
    ours, ref = run_chunked(model, tokens, prefill_chunks=[5, 4]), hf_logits(hf_model, tokens)
    assert torch.isfinite(ours).all()
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


def test_batch_matches_each_sequence_alone():
    _, config, weights = make_hf_model('qwen3')
    model = build_model(config, weights, torch.float32, device=CUDA, kernel_backend='triton')
    seqs = [random_tokens(n, seed=10 + n) for n in (5, 9, 14)]
    nxt = [random_tokens(3, seed=20 + i) for i in range(3)]
    runner = PagedRunner(model, seed=7)
    got = [[lg] for lg in runner.step([(i, s) for i, s in enumerate(seqs)])]
    for t in range(3):
        for i, lg in enumerate(runner.step([(i, nxt[i][t:t + 1]) for i in range(3)])):
            got[i].append(lg)
    for i in range(3):
        alone = run_chunked(model, seqs[i] + nxt[i], prefill_chunks=[len(seqs[i])], seed=100 + i)
        assert (torch.cat(got[i]) - alone).abs().max().item() < 1e-4, f'seq {i}: batched differs from alone'


# ---- the engine end to end on the GPU ---------------------------------------------------------------

def test_engine_greedy_matches_hf_and_batch_invariance(tiny_models):
    model, _ = tiny_models('llama')
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (3, 90, 17, 1, 40, 64, 8, 33)]
    sp = SamplingParams(max_new_tokens=24)
    with tiny_engine(tiny_models, device='cuda', max_batch_size=8, max_prefill_token_num=96) as engine:
        assert engine.runner.kv_caches[0][0].device.type == 'cuda'
        together, finals = generate(engine, prompts, sp)
        alone = [generate(engine, [p], sp, first_sid=100 + i)[0][0] for i, p in enumerate(prompts)]
        assert_no_leak(engine)
    assert together == alone
    for p, toks, final in zip(prompts[:4], together, finals):
        assert toks == hf_greedy(model, p, 24)
        assert final.finish_reason == 'length'


@pytest.mark.parametrize('arch', ['qwen2', 'qwen3'])
def test_engine_teacher_forced_logits_match_hf(tiny_models, arch):
    model, _ = tiny_models(arch)
    rng = random.Random(1)
    prompt, forced = rand_prompt(rng, 61), rand_prompt(rng, 16)
    with tiny_engine(tiny_models, arch, device='cuda', max_prefill_token_num=24) as engine:
        got = engine.teacher_forced_logits(prompt, forced).cpu()
    with torch.no_grad():
        want = model(torch.tensor([prompt + forced])).logits[0, len(prompt) - 1:].float()
    assert (got - want).abs().max().item() < 1e-3


def test_engine_prefix_cache_hit_equals_miss(tiny_models):
    rng = random.Random(4)
    prefix = rand_prompt(rng, 200)
    a, b = prefix + rand_prompt(rng, 11), prefix + rand_prompt(rng, 23)
    sp = SamplingParams(max_new_tokens=12)
    with tiny_engine(tiny_models, device='cuda', enable_prefix_caching=False) as engine:
        want = generate(engine, [a, b], sp)[0]
    with tiny_engine(tiny_models, device='cuda', cache_block_seq_len=16, enable_prefix_caching=True) as engine:
        got_a = generate(engine, [a], sp)[0][0]
        (got_b,), (final_b,) = generate(engine, [b], sp, first_sid=1)
        assert final_b.num_cached_tokens >= 192
        assert_no_leak(engine)
    assert [got_a, got_b] == want


@pytest.mark.parametrize('quant_policy', [0, 8])
def test_engine_get_logits_match_hf(tiny_models, quant_policy):
    """Engine.get_logits (perplexity's call, lite/eval_ppl.py) scores over a cache of its own on the GPU."""
    model, _ = tiny_models('qwen2')
    ids = rand_prompt(random.Random(5), 77)
    with tiny_engine(tiny_models, 'qwen2', device='cuda', quant_policy=quant_policy) as engine:
        got = engine.get_logits(ids)
        assert_no_leak(engine)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
    assert got.device.type == 'cpu' and got.shape == want.shape
    if quant_policy == 0:
        assert (got - want).abs().max().item() < 1e-3
    else:  # an int8 cache rounds K and V: held to tests/test_kv_quant.py's bound on the CPU
        assert ((got - want).abs().max() / want.abs().max()).item() < LOGIT_BOUND[8]


# ---- kernel_backend='cuda': lmd's CUDA kernels behind the table -------------------------------------
# Each op against the torch kernels on CPU copies of the same inputs, with the Triton tests'
# tolerances (float32: accumulation order; fp16 / bf16: the output dtype's rounding); then whole
# models against HF float32 and the engine end to end, as above.

@pytest.fixture(scope='module')
def cuda_kernels():
    return get_kernels(CUDA, 'cuda')


@requires_cuda_kernels
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(1, 576), (7, 2048), (3, 4096), (2, 4, 24)])  # 3-D: Qwen3's per-head norm
def test_cuda_rms_norm(cuda_kernels, shape, dtype):
    x, w = torch.randn(shape).to(dtype), (1 + 0.3 * torch.randn(shape[-1])).to(dtype)
    got = cuda_kernels.rms_norm(*on_gpu(x, w), 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got.cpu(), torch_ops.rms_norm(x, w, 1e-6), **TOL[dtype])


@requires_cuda_kernels
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows,hidden', [(1, 576), (13, 4096), (2, 100)])
def test_cuda_add_rms_norm(cuda_kernels, rows, hidden, dtype):
    x, residual = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden)).to(dtype)
    want_residual = residual.clone()
    want = torch_ops.add_rms_norm(x, want_residual, w, 1e-6)
    got_residual = residual.to(CUDA)
    got = cuda_kernels.add_rms_norm(x.to(CUDA), got_residual, w.to(CUDA), 1e-6)
    torch.testing.assert_close(got_residual.cpu(), want_residual, **TOL[dtype])  # updated in place
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@requires_cuda_kernels
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows,inter', [(1, 1536), (33, 8192), (5, 7)])
def test_cuda_silu_and_mul(cuda_kernels, rows, inter, dtype):
    x = torch.randn(rows, 2 * inter).to(dtype)
    torch.testing.assert_close(cuda_kernels.silu_and_mul(x.to(CUDA)).cpu(), torch_ops.silu_and_mul(x), **TOL[dtype])


ROPE_CASES = [((4, 2), 16, 16), ((9, 3), 64, 64), ((32, 8), 128, 128), ((3, 1), 24, 12)]  # last: partial rotary
ROPE_POSITIONS, ROPE_SLOTS = torch.tensor([0, 3, 17, 63, 1000]), torch.tensor([13, 2, 7, 20, 0])


@requires_cuda_kernels
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads,head_dim,rot_dim', ROPE_CASES)
def test_cuda_rope_fill_kv(cuda_kernels, heads, head_dim, rot_dim, dtype):
    qkv = torch.randn(5, (heads[0] + 2 * heads[1]) * head_dim).to(dtype)
    cache = cos_sin(1024, rot_dim, dtype)
    want_k, want_v = (torch.zeros(6, 4, heads[1], head_dim, dtype=dtype) for _ in range(2))
    want_q = torch_ops.rope_fill_kv(qkv, ROPE_POSITIONS, cache, want_k, want_v, ROPE_SLOTS, *heads)
    got_k, got_v = torch.zeros_like(want_k, device=CUDA), torch.zeros_like(want_v, device=CUDA)
    got_q = cuda_kernels.rope_fill_kv(*on_gpu(qkv, ROPE_POSITIONS, cache), got_k, got_v, ROPE_SLOTS.to(CUDA), *heads)
    torch.testing.assert_close(got_q.cpu(), want_q, **TOL[dtype])
    torch.testing.assert_close(got_k.cpu(), want_k, **TOL[dtype])
    assert torch.equal(got_v.cpu(), want_v)  # v is copied


@requires_cuda_kernels
@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('heads,head_dim,rot_dim', ROPE_CASES)
def test_cuda_rope_fill_kv_quantized(cuda_kernels, heads, head_dim, rot_dim, bits):
    qkv, cache = torch.randn(5, (heads[0] + 2 * heads[1]) * head_dim), cos_sin(1024, rot_dim, torch.float32)
    codes = (6, 4, heads[1], head_dim * bits // 8)
    want = [torch.zeros(codes, dtype=torch.uint8) for _ in range(2)]
    want += [torch.zeros(6, 4, heads[1], 2) for _ in range(2)]
    want_q = torch_ops.rope_fill_kv(qkv, ROPE_POSITIONS, cache, want[0], want[1], ROPE_SLOTS, *heads,
                                    k_params=want[2], v_params=want[3])
    got = [torch.zeros_like(t, device=CUDA) for t in want]
    got_q = cuda_kernels.rope_fill_kv(*on_gpu(qkv, ROPE_POSITIONS, cache), got[0], got[1], ROPE_SLOTS.to(CUDA),
                                      *heads, k_params=got[2], v_params=got[3])
    torch.testing.assert_close(got_q.cpu(), want_q, **TOL[torch.float32])
    got = [t.cpu() for t in got]
    for codes_got, codes_want, p_got, p_want in ((got[0], want[0], got[2], want[2]),
                                                 (got[1], want[1], got[3], want[3])):
        # a K value computed with other float rounding may sit across a rounding boundary: one code step
        torch.testing.assert_close(p_got, p_want, atol=1e-5, rtol=1e-5)
        diff = (torch_ops.dequantize_kv(codes_got, p_got, bits, torch.float32)
                - torch_ops.dequantize_kv(codes_want, p_want, bits, torch.float32)).abs()
        assert (diff <= 1.01 * p_want[..., :1] + 1e-5).all()


@requires_cuda_kernels
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('case', ATTN_CASES + LONG_CASES)
def test_cuda_paged_attention(cuda_kernels, case, dtype):
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim = case
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    want = torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale)
    ctx = ctx_on_gpu(ctx)
    got = cuda_kernels.paged_attention(q.to(CUDA), *ctx.kv_caches[0], ctx, scale)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@requires_cuda_kernels
@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('case', ATTN_CASES + LONG_CASES[1:])
def test_cuda_paged_attention_quantized(cuda_kernels, case, bits):
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim = case
    ctx, k_float, v_float = make_ctx(query_lens, context_lens, block_size, num_kv_heads, head_dim, torch.float32)
    k_cache, k_params = torch_ops.quantize_kv(k_float, bits)
    v_cache, v_params = torch_ops.quantize_kv(v_float, bits)
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    scale = head_dim ** -0.5
    want = torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale, k_params=k_params, v_params=v_params)
    ctx = ctx_on_gpu(ctx)
    got = cuda_kernels.paged_attention(*on_gpu(q, k_cache, v_cache), ctx, scale,
                                       k_params=k_params.to(CUDA), v_params=v_params.to(CUDA))
    # both dequantize code * scale + zero in float32; the kernel may fuse it into one multiply-add
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


def rand_w4a16(n: int, k: int, group_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = 0.01 + 0.02 * torch.rand(n, k // group_size, generator=g)
    mins = -8 * scales * (0.5 + torch.rand(n, k // group_size, generator=g))
    return qweight, scales, mins, torch.randn(n, generator=g)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# relative to the largest |y|: float32, accumulation order (TF32 off) over K up to 4096, and the
# kernel's scale * dot(q, x) + min * sum(x) cancels part of its terms; fp16 / bf16, the weights
# and outputs rounded to the dtype in the reference (dequantized weights, cuBLAS), not in the kernel
LINEAR_BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@requires_cuda_kernels
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('M', [1, 5, 8, 9, 33])  # split-K up to 8 rows, tensor cores (fp16 / bf16) from 9
@pytest.mark.parametrize('N,K,G', [(80, 576, 64), (512, 4096, 128), (96, 256, 32)])
def test_cuda_linear_w4a16(cuda_kernels, M, N, K, G, dtype):
    parts = rand_w4a16(N, K, G, seed=M)
    x = torch.randn(M, K).to(dtype).to(CUDA)
    got = cuda_kernels.linear(x, cuda_kernels.prepare_linear(tuple(t.to(CUDA) for t in parts[:3]), parts[3].to(CUDA)))
    want = torch_ops.linear(x, torch_ops.prepare_linear(tuple(t.to(CUDA) for t in parts[:3]), parts[3].to(CUDA)))
    assert got.dtype == dtype and got.shape == (M, N)
    assert rel_err(got, want) < LINEAR_BOUND[dtype]


@requires_cuda_kernels
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('M', [1, 7, 33])
def test_cuda_linear_w8a8(cuda_kernels, M, dtype):
    g = torch.Generator().manual_seed(M)
    N, K = 96, 576
    qweight = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scales, bias = 0.01 * torch.rand(N, generator=g), torch.randn(N, generator=g)
    x = torch.randn(M, K, generator=g).to(dtype).to(CUDA)
    weights = (qweight.to(CUDA), scales.to(CUDA))
    got = cuda_kernels.linear(x, cuda_kernels.prepare_linear(weights, bias.to(CUDA)))
    want = torch_ops.linear(x, torch_ops.prepare_linear(weights, bias.to(CUDA)))
    assert rel_err(got, want) < LINEAR_BOUND[dtype]


@requires_cuda_kernels
@pytest.mark.parametrize('arch', list(MODEL_ARCHS))
def test_cuda_backend_model_matches_hf(arch):
    hf_model, config, weights = make_hf_model(arch)
    model = build_model(config, weights, torch.float32, device=CUDA, kernel_backend='cuda')
    assert model.kernels.name == 'cuda'
    tokens = random_tokens(11 + 16, seed=3)
    ours = run_chunked(model, tokens, prefill_chunks=[7, 4])
    diff = (ours - hf_logits(hf_model, tokens)).abs().max().item()
    assert diff < 1e-3, f'{arch} on cuda: max |logit diff| vs HF = {diff}'


@requires_cuda_kernels
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('arch', ['llama', 'qwen3'])
def test_cuda_backend_half_precision_model_close_to_hf(arch, dtype):
    hf_model, config, weights = make_hf_model(arch)
    model = build_model(config, weights, dtype, device=CUDA, kernel_backend='cuda')
    tokens = random_tokens(9 + 6, seed=5)
    ours, ref = run_chunked(model, tokens, prefill_chunks=[5, 4]), hf_logits(hf_model, tokens)
    assert torch.isfinite(ours).all()
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


@requires_cuda_kernels
def test_cuda_backend_engine_greedy_matches_hf_and_batch_invariance(tiny_models):
    model, _ = tiny_models('llama')
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (3, 90, 17, 1, 40, 64, 8, 33)]
    sp = SamplingParams(max_new_tokens=24)
    with tiny_engine(tiny_models, device='cuda', kernel_backend='cuda', max_batch_size=8,
                     max_prefill_token_num=96) as engine:
        assert engine.runner.model.kernels.name == 'cuda'
        together, finals = generate(engine, prompts, sp)
        alone = [generate(engine, [p], sp, first_sid=100 + i)[0][0] for i, p in enumerate(prompts)]
        assert_no_leak(engine)
    assert together == alone
    for p, toks, final in zip(prompts[:4], together, finals):
        assert toks == hf_greedy(model, p, 24)
        assert final.finish_reason == 'length'


@requires_cuda_kernels
@pytest.mark.parametrize('method,dtype', [('awq', 'float32'), ('awq', 'bfloat16'), ('w8a8', 'float32')])
def test_cuda_backend_quantized_model_matches_torch_backend(tmp_path, method, dtype):
    """A quantized checkpoint through lmd's quantized matmuls (bfloat16 AWQ: a prefill of 11 rows on
    tensor cores) against the torch reference (dequantized weights / emulated W8A8) on the same GPU."""
    save_quantized('llama', str(tmp_path), method, 32)
    toks = quant_tokens(11 + 16, seed=4)

    def logits(backend: str) -> torch.Tensor:
        cfg = PytorchEngineConfig(**{**QUANT_ENGINE, 'dtype': dtype, 'device': 'cuda', 'kernel_backend': backend})
        with PytorchEngine(str(tmp_path), cfg) as engine:
            assert engine.model_format == method and engine.runner.model.kernels.name == backend
            return engine.teacher_forced_logits(toks[:11], toks[11:]).float().cpu()

    got, want = logits('cuda'), logits('torch')
    assert torch.isfinite(got).all()
    if dtype == 'float32':  # the bound of the float32 models against HF above
        assert (got - want).abs().max().item() < 1e-3
    else:  # the half-precision bound above
        assert ((got - want).abs().max() / want.abs().max()).item() < 0.05
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8
