"""The PyTorch engine on a CUDA device, against references on the CPU.

Its Triton kernels, compiled for the GPU, against the torch kernels (themselves checked against
plain references in tests/test_kernels.py) on the same inputs on the CPU; whole tiny models of
every architecture on the GPU against HF transformers float32 on the CPU; the engine end to end
(greedy tokens equal to HF's, a batch equal to each sequence alone, a prefix-cache hit equal to a
miss). ``tools/gpu_check.sh`` runs this file on a lent GPU; without a CUDA device it is skipped.
Run it in a pytest process of its own: tests/test_kernels.py sets TRITON_INTERPRET=1.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernel_cases import ATTN_CASES, cos_sin, make_ctx
from lmd.engine import SamplingParams
from lmd.pytorch_backend.kernels import get_kernels, torch_ops
from lmd.pytorch_backend.models import build_model
from test_kv_quant import LOGIT_BOUND
from test_models import ARCHS as MODEL_ARCHS
from test_models import PagedRunner, hf_logits, make_hf_model, random_tokens, run_chunked
from test_pytorch_engine import (assert_no_leak, generate, hf_greedy, rand_prompt, tiny_engine,  # noqa: F401
                                 tiny_models)

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
