"""The PyTorch engine on quantized checkpoints (AWQ W4A16, W8A8) and with a quantized KV cache
(quant_policy 8 / 4), against HF transformers on the weights a checkpoint stands for, against
the float cache, and against TurboMind on the same checkpoint and policy.

Checkpoints are built as tests/test_turbomind_formats.py builds them (``save_quantized``); the
KV-cache quantizer is TurboMind's (tests/test_kv_quant.py has the reference).
"""
from __future__ import annotations

import random

import pytest
import torch

import test_turbomind_formats as formats
from lmd.engine import EngineRequest, SamplingParams
from lmd.errors import ModelFormatError
from lmd.messages import PytorchEngineConfig
from lmd.pytorch_backend import PytorchEngine
from lmd.pytorch_backend.context import StepContext
from lmd.pytorch_backend.kernels import native, torch_ops
from lmd.turbomind.model import TurbomindModel
from test_kv_quant import LOGIT_BOUND, dequantize, pack, quantize_rows, random_block_tables, relative_error
from test_models import make_hf_model, random_tokens
from test_pytorch_engine import Collector, assert_no_leak, generate, rand_prompt
from test_turbomind_formats import ENGINE, W8A8_TOLERANCE, engine_greedy, hf_logits, save_quantized, tokens
from test_turbomind_model import BLOCK_SIZE, tm_chunked

QWEN3 = ('Qwen3Config', 'Qwen3ForCausalLM', dict(head_dim=32))  # q/k norm; head_dim given explicitly
# PyTorch engine vs TurboMind, both with the same quantized cache, on the tiny models: the two
# quantize the same rows by the same rule, so only float rounding differs (measured <= 3e-6
# relative to the largest |logit|). On SmolLM2 the two engines' float paths differ by ~1e-6,
# enough to move some code across a rounding boundary; those flips grow through the layers to
# ~2e-3 (int8, 20 tokens), as large as the int8 error itself: not a bound worth a test.
ENGINES_AGREE = 1e-4


@pytest.fixture
def with_qwen3(monkeypatch):
    monkeypatch.setitem(formats.ARCHS, 'qwen3', QWEN3)


def pt_engine(model_dir: str, **cfg) -> PytorchEngine:
    return PytorchEngine(model_dir, PytorchEngineConfig(**{**ENGINE, **cfg}))


def pt_logits(model_dir: str, toks: list[int], prompt_len: int = 11, **cfg) -> torch.Tensor:
    """Teacher-forced logits of the positions prompt_len - 1 ... through the real engine path."""
    with pt_engine(model_dir, **cfg) as engine:
        return engine.teacher_forced_logits(toks[:prompt_len], toks[prompt_len:])


def pt_greedy(model_dir: str, prompts: list[list[int]], n: int = 32, **cfg) -> list[list[int]]:
    with pt_engine(model_dir, **cfg) as engine:
        got, _ = generate(engine, prompts, SamplingParams(max_new_tokens=n))
        assert_no_leak(engine)
    return got


# ---- AWQ and W8A8 checkpoints ---------------------------------------------------------------------------

@pytest.mark.parametrize('arch, group_size', [('llama', 32), ('qwen2', 64), ('qwen3', 128)])
def test_awq_matches_hf_and_turbomind(tmp_path, with_qwen3, arch, group_size):
    ref = save_quantized(arch, str(tmp_path), 'awq', group_size)
    toks = tokens(11 + 16, seed=group_size)
    want = hf_logits(ref, toks)[10:]
    with pt_engine(str(tmp_path)) as engine:
        assert engine.model_format == 'awq'
        layer = engine.runner.model.layers[0]
        assert isinstance(layer.qkv_weight, tuple) and layer.qkv_weight[0].dtype == torch.uint8  # kept 4-bit
        got = engine.teacher_forced_logits(toks[:11], toks[11:])
    assert (got - want).abs().max().item() < 1e-3
    prompts = [tokens(n, seed=n) for n in (5, 23)]
    assert pt_greedy(str(tmp_path), prompts) == engine_greedy(str(tmp_path), prompts)


@pytest.mark.parametrize('arch, scale_2d', [('llama', False), ('qwen2', True), ('qwen3', False)])
def test_w8a8_matches_hf_and_turbomind(tmp_path, with_qwen3, arch, scale_2d):
    ref = save_quantized(arch, str(tmp_path), 'w8a8', scale_2d=scale_2d)
    toks = tokens(11 + 16, seed=5)
    float_ref = hf_logits(ref, toks)[10:]
    formats.quantize_activations_per_token(ref)
    with pt_engine(str(tmp_path)) as engine:
        assert engine.model_format == 'w8a8'
        assert engine.runner.model.layers[0].down_weight[0].dtype == torch.int8
        got = engine.teacher_forced_logits(toks[:11], toks[11:])
    # as for TurboMind (test_turbomind_formats): most positions within the tolerance, none without
    # the activation quantization
    diff = (got - hf_logits(ref, toks)[10:]).abs().amax(-1)
    assert (diff < W8A8_TOLERANCE).float().mean().item() >= 0.75, diff
    assert ((got - float_ref).abs().amax(-1) > 100 * W8A8_TOLERANCE).all()
    prompts = [tokens(n, seed=n) for n in (5, 23)]
    assert pt_greedy(str(tmp_path), prompts) == engine_greedy(str(tmp_path), prompts)


@pytest.mark.parametrize('method', ['awq', 'w8a8'])
def test_torch_reference_kernels_agree_with_native(tmp_path, method):
    save_quantized('qwen2', str(tmp_path), method, 32)
    toks = tokens(11 + 8, seed=2)
    native_logits = pt_logits(str(tmp_path), toks, kernel_backend='native')
    torch_logits = pt_logits(str(tmp_path), toks, kernel_backend='torch')
    assert (native_logits - torch_logits).abs().max().item() < 1e-4


def test_quantized_checkpoint_errors(tmp_path):
    awq_dir, w8a8_dir = str(tmp_path / 'awq'), str(tmp_path / 'w8a8')
    save_quantized('llama', awq_dir, 'awq', 32)
    save_quantized('llama', w8a8_dir, 'w8a8')
    with pytest.raises(ModelFormatError, match="awq checkpoint .* model_format='w8a8'"):
        pt_engine(awq_dir, model_format='w8a8')
    with pytest.raises(ModelFormatError, match="w8a8 checkpoint .* model_format='hf'"):
        pt_engine(w8a8_dir, model_format='hf')
    from safetensors.torch import load_file, save_file
    weights = load_file(tmp_path / 'awq' / 'model.safetensors')
    del weights['model.layers.1.mlp.up_proj.qzeros']
    save_file(weights, tmp_path / 'awq' / 'model.safetensors')
    with pytest.raises(ModelFormatError, match="'model.layers.1.mlp.up_proj.qzeros' is missing"):
        pt_engine(awq_dir)
    weights = load_file(tmp_path / 'w8a8' / 'model.safetensors')
    del weights['model.layers.0.self_attn.k_proj.weight_scale']  # k_proj left as a bare int8 tensor
    save_file(weights, tmp_path / 'w8a8' / 'model.safetensors')
    with pytest.raises(ModelFormatError,
                       match=r"integer tensors .*'model.layers.0.self_attn.k_proj.weight' \(torch.int8\)"):
        pt_engine(w8a8_dir)


# ---- the quantized KV cache: kernels -------------------------------------------------------------------

@pytest.mark.parametrize('bits', [8, 4])
def test_fill_quantizes_as_turbomind(bits):
    """torch_ops' fill writes the codes and params of TurboMind's quantizer (the reference in
    test_kv_quant), bit for bit; its rope_fill_kv agrees with the native one to a code step (the
    two rotate with different float rounding)."""
    T, num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 6, 2, 32, 4, 5
    g = torch.Generator().manual_seed(bits)

    def empty():
        codes = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim * bits // 8, dtype=torch.uint8)
                 for _ in range(2)]
        return codes + [torch.zeros(num_blocks, block_size, num_kv_heads, 2) for _ in range(2)]

    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    k, v = torch.randn(2, T, num_kv_heads, head_dim, generator=g) * 2
    k[0, 0] = 0.5  # a constant row: scale 0
    kc, vc, kp, vp = empty()
    torch_ops.fill_kv_cache(k, v, kc, vc, slots, k_params=kp, v_params=vp)
    for x, cache, params in ((k, kc, kp), (v, vc, vp)):
        codes, want = quantize_rows(x, bits)
        assert torch.equal(cache.view(-1, num_kv_heads, cache.shape[-1])[slots], pack(codes, bits))
        assert torch.equal(params.view(-1, num_kv_heads, 2)[slots], want)

    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 2
    positions = torch.randint(0, 60, (T,), generator=g)
    cos_sin = torch.randn(64, head_dim, generator=g)
    out = {}
    for name, fill in (('native', native.rope_fill_kv), ('torch', torch_ops.rope_fill_kv)):
        kc, vc, kp, vp = empty()
        q = fill(qkv, positions, cos_sin, kc, vc, slots, num_heads, num_kv_heads, k_params=kp, v_params=vp)
        out[name] = q, dequantize(kc, kp, bits), dequantize(vc, vp, bits), kp
    torch.testing.assert_close(out['native'][0], out['torch'][0], rtol=1e-5, atol=1e-5)
    step = out['torch'][3][..., :1]
    for i in (1, 2):
        assert ((out['native'][i] - out['torch'][i]).abs() <= step * 1.001 + 1e-5).all()


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('query_lens, context_lens', [([1, 1, 1], [5, 37, 17]), ([7, 1, 12], [7, 30, 20])])
def test_attention_over_quantized_cache(bits, query_lens, context_lens):
    """torch_ops and native attention over a quantized paged cache equal attention over its
    dequantized float copy (decode steps and prefill rows)."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 8
    g = torch.Generator().manual_seed(sum(context_lens))
    tables, num_blocks = random_block_tables(context_lens, block_size, 2, g)
    cache, params = [], []
    for _ in range(2):
        codes, p = quantize_rows(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 2, bits)
        cache.append(pack(codes, bits).contiguous())
        params.append(p)
    ql = torch.tensor(query_lens, dtype=torch.int32)
    ctx = StepContext(kv_caches=[], block_size=block_size, slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),
                      query_lens=ql, cu_query_lens=torch.nn.functional.pad(ql.cumsum(0), (1, 0)).to(torch.int32),
                      context_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=tables,
                      is_decode=all(n == 1 for n in query_lens), query_lens_list=query_lens,
                      context_lens_list=context_lens, quant_policy=bits)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    want = torch_ops.paged_attention(q, dequantize(cache[0], params[0], bits), dequantize(cache[1], params[1], bits),
                                     ctx, scale)
    quant = dict(k_params=params[0], v_params=params[1])
    torch.testing.assert_close(torch_ops.paged_attention(q, *cache, ctx, scale, **quant), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native.paged_attention(q, *cache, ctx, scale, **quant), want, rtol=1e-4, atol=1e-4)


# ---- the quantized KV cache: models and engines --------------------------------------------------------

@pytest.fixture(scope='module')
def tiny_dirs(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            hf, config, weights = make_hf_model(arch)
            path = str(tmp_path_factory.mktemp(arch))
            hf.save_pretrained(path, safe_serialization=True)
            cache[arch] = (path, config, weights)
        return cache[arch]
    return get


KV_ENGINE = dict(cache_block_seq_len=BLOCK_SIZE, num_cache_blocks=64, max_prefill_token_num=8)


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('arch', ['llama', 'qwen2', 'qwen3'])
def test_kv_quant_close_to_float_and_equal_to_turbomind(tiny_dirs, arch, bits):
    path, config, weights = tiny_dirs(arch)
    toks = random_tokens(11 + 16, seed=3)
    # the 11-token prompt runs as prefill chunks of 8 and 3, then 16 decode steps
    float_cache = pt_logits(path, toks, **KV_ENGINE)
    got = pt_logits(path, toks, quant_policy=bits, **KV_ENGINE)
    assert relative_error(got, float_cache) < LOGIT_BOUND[bits]
    assert relative_error(got, float_cache) > 1e-5  # the cache is quantized indeed
    reference = pt_logits(path, toks, quant_policy=bits, kernel_backend='torch', **KV_ENGINE)
    assert relative_error(got, reference) < ENGINES_AGREE
    tm = TurbomindModel(config, weights, torch.float32, 64, BLOCK_SIZE, quant_policy=bits)
    assert relative_error(got, tm_chunked(tm, toks, [7, 4])[10:]) < ENGINES_AGREE


def test_kv_quant_block_accounting_and_batch_invariance(tiny_dirs):
    """Preemption, prefix hits and aborts with an int8 cache: every block comes back, and a
    request alone gives the tokens it gives in a crowded batch."""
    path, _, _ = tiny_dirs('llama')
    rng = random.Random(6)
    prefix = rand_prompt(rng, 40, vocab=128)
    prompts = [(prefix if i % 2 else []) + rand_prompt(rng, rng.randrange(1, 30), vocab=128) for i in range(10)]
    sp = SamplingParams(max_new_tokens=24)
    cfg = dict(quant_policy=8, cache_block_seq_len=8, max_prefill_token_num=48)
    with pt_engine(path, num_cache_blocks=256, **cfg) as engine:
        alone = [generate(engine, [p], sp, first_sid=i)[0][0] for i, p in enumerate(prompts)]
    with pt_engine(path, num_cache_blocks=24, session_len=192, enable_prefix_caching=True, max_batch_size=6,
                   **cfg) as engine:
        assert engine.runner.kv_caches[0][0].dtype == torch.uint8 and len(engine.runner.kv_caches[0]) == 4
        col = Collector()
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(i, tuple(p), sp), col.callback)
        engine.abort(9)
        col.wait(range(10))
        engine.check_invariants()
        assert engine.stats().num_preemptions > 0
        assert_no_leak(engine)
        assert [col.tokens(i) for i in range(9)] == alone[:9]


def test_kv_quant_cache_sizes(tiny_dirs):
    path, _, _ = tiny_dirs('qwen3')  # 2 layers, 2 KV heads, head_dim 24
    with pt_engine(path, quant_policy=4, cache_block_seq_len=4, num_cache_blocks=8) as engine:
        model = engine.runner.model
        k, v, kp, vp = engine.runner.kv_caches[1]
        assert k.shape == v.shape == (8, 4, 2, 12) and k.dtype == torch.uint8
        assert kp.shape == vp.shape == (8, 4, 2, 2) and kp.dtype == torch.float32
    assert model.kv_cache_bytes_per_block(4, 8) == 2 * 2 * 4 * 2 * (24 + 8)
    assert model.kv_cache_bytes_per_block(4, 4) == 2 * 2 * 4 * 2 * (12 + 8)
    assert model.kv_cache_bytes_per_block(4) == 2 * 2 * 4 * 2 * 24 * 4
    with pytest.raises(ValueError, match='quant_policy'):
        PytorchEngineConfig(quant_policy=2)
