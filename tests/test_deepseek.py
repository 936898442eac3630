"""DeepSeek-V2 (multi-head latent attention, experts with shared experts and grouped routing) on both
engines vs HF transformers in float32: teacher-forced logits through chunked prefill and decode and
batched greedy tokens, with q from q_proj and from the low-rank q_a/q_b pair, routed greedily and
group-limited, under YaRN with its mscale; the latent attention kernel (AVX2 and scalar C++) vs its torch
reference and vs attention over keys and values expanded per head; the caches' bytes per block (one
latent row a token and layer) in both engines; the config's fields and refusals.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack as dl

from lmd import kernels
from lmd.backend import autoget_backend
from lmd.convert import convert
from lmd.engine import SamplingParams
from lmd.messages import PytorchEngineConfig, TurbomindEngineConfig
from lmd.model_config import ModelConfig, ModelConfigError
from lmd.model_loader import load_weights
from lmd.pytorch_backend import PytorchEngine
from lmd.pytorch_backend.kernels import torch_ops
from lmd.pytorch_backend.models import build_model
from lmd.turbomind.engine import TurbomindEngine
from lmd.turbomind.model import TurbomindModel
from lmd.weights.memory import kv_block_bytes
from kernel_cases import make_ctx
from test_pytorch_engine import assert_no_leak, generate, hf_greedy, hf_logits, rand_prompt
from test_turbomind_engine import assert_all_blocks_back
from test_turbomind_model import tm_chunked
from tiny_models import saved_models, tiny_hf_model

YARN = dict(rope_type='yarn', rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256, mscale=0.707,
            mscale_all_dim=0.707, beta_fast=32, beta_slow=1)
TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
            first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
            max_position_embeddings=1024, rms_norm_eps=1e-6, rope_parameters=YARN)
VARIANTS = {
    # q straight from q_proj, top-k over every expert
    'q_proj_greedy': dict(q_lora_rank=None, topk_method='greedy'),
    # q through the low-rank pair; top-2 within the best 2 of 4 groups, weights scaled
    'q_lora_grouped': dict(q_lora_rank=24, topk_method='group_limited_greedy', n_group=4, topk_group=2,
                           routed_scaling_factor=1.5),
}


@pytest.fixture(scope='module')
def deepseek_models(tmp_path_factory):
    """variant -> (HF model, saved dir); built once per module."""
    def make(variant: str):
        return tiny_hf_model('DeepseekV2Config', 'DeepseekV2ForCausalLM', **TINY, **VARIANTS[variant])
    return saved_models(tmp_path_factory, make)


def engine(path: str, **cfg) -> PytorchEngine:
    return PytorchEngine(path, PytorchEngineConfig(cache_block_seq_len=8, num_cache_blocks=128, **cfg))


def tm_engine(path: str, **cfg) -> TurbomindEngine:
    return TurbomindEngine(path, TurbomindEngineConfig(cache_block_seq_len=8, num_cache_blocks=128, **cfg))


@pytest.mark.parametrize('kernel_backend', [None, 'torch'])
@pytest.mark.parametrize('variant', list(VARIANTS))
def test_teacher_forced_logits_match_hf(deepseek_models, variant, kernel_backend):
    model, path = deepseek_models(variant)
    rng = random.Random(1)
    prompt, forced = rand_prompt(rng, 61), rand_prompt(rng, 16)
    # chunks of 24: the prompt prefills in 3 chunks that end mid-block, then 16 decode steps
    with engine(path, max_prefill_token_num=24, kernel_backend=kernel_backend) as e:
        got = e.teacher_forced_logits(prompt, forced)
        assert_no_leak(e)
    want = hf_logits(model, prompt + forced)[len(prompt) - 1:]
    assert got.shape == want.shape == (17, 512)
    assert (got - want).abs().max().item() < 1e-3 * (want.max() - want.min()).item()


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_turbomind_teacher_forced_logits_match_hf(deepseek_models, variant):
    model, path = deepseek_models(variant)
    rng = random.Random(1)
    tokens = rand_prompt(rng, 61) + rand_prompt(rng, 16)
    # the prompt in 3 chunks that end mid-block, then 16 decode steps
    tm = TurbomindModel(ModelConfig.from_dir(path), load_weights(path), torch.float32, 64, 4)
    got = tm_chunked(tm, tokens, [24, 24, 13])[60:]
    want = hf_logits(model, tokens)[60:]
    assert got.shape == want.shape == (17, 512)
    assert (got - want).abs().max().item() < 1e-3 * (want.max() - want.min()).item()


@pytest.mark.parametrize('engine_name', ['pytorch', 'turbomind'])
@pytest.mark.parametrize('variant', list(VARIANTS))
def test_batched_greedy_matches_hf(deepseek_models, variant, engine_name):
    """Submitted at once, the prompts share steps (prefill chunks beside decodes, in chunks of 24)."""
    model, path = deepseek_models(variant)
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (37, 5, 20, 12)]
    make, all_back = {'pytorch': (engine, assert_no_leak),
                      'turbomind': (tm_engine, assert_all_blocks_back)}[engine_name]
    with make(path, max_batch_size=4, max_prefill_token_num=24) as e:
        got = generate(e, prompts, SamplingParams(max_new_tokens=32))[0]
        all_back(e)
    assert got == [hf_greedy(model, p, 32) for p in prompts]


def test_turbomind_runs_deepseek_converted(deepseek_models, tmp_path):
    model, path = deepseek_models('q_lora_grouped')
    out = convert(path, str(tmp_path / 'tm'), backend='turbomind')
    prompt = rand_prompt(random.Random(4), 20)
    with tm_engine(out) as e:
        assert generate(e, [prompt], SamplingParams(max_new_tokens=8))[0] == [hf_greedy(model, prompt, 8)]


def test_cache_holds_one_latent_row_a_token(deepseek_models):
    _, path = deepseek_models('q_proj_greedy')
    config = ModelConfig.from_dir(path)
    row = TINY['kv_lora_rank'] + TINY['qk_rope_head_dim']
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        assert kv_block_bytes(config, 16, dtype) == TINY['num_hidden_layers'] * 16 * row * size
    model = build_model(config, load_weights(path), torch.float32)
    caches = model.allocate_kv_cache(5, 16)
    assert [tuple(c.shape) for layer in caches for c in layer] == [(5, 16, 1, row)] * TINY['num_hidden_layers']
    assert sum(c.numel() * c.element_size() for layer in caches for c in layer) == \
        5 * model.kv_cache_bytes_per_block(16)
    with pytest.raises(ValueError, match='latent KV cache .* not quantized'):
        kv_block_bytes(config, 16, torch.float32, quant_policy=8)
    with pytest.raises(ValueError, match='quant_policy=8'):
        engine(path, quant_policy=8)
    # TurboMind's C++ cache likewise: one latent row a token and layer, no V cache
    tm = TurbomindModel(config, load_weights(path), torch.float32, 5, 16)
    assert tm.cpp.kv_bytes == 5 * kv_block_bytes(config, 16, torch.float32)
    with pytest.raises(ValueError, match='latent KV cache .* not quantized'):
        TurbomindModel(config, load_weights(path), torch.float32, 5, 16, quant_policy=8)
    assert autoget_backend(path) == 'turbomind'


def _latent_case(query_lens, context_lens, block_size, D, dtype, seed):
    ctx, cache, _ = make_ctx(query_lens, context_lens, block_size, 1, D, dtype, seed=seed)
    q = torch.randn(sum(query_lens), 4, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return ctx, cache, q


def _expanded(q, cache, ctx, scale, v_dim):
    """Every head over keys and values copied out per head from the gathered rows, in float64."""
    out, start = [], 0
    for i, (q_len, ctx_len) in enumerate(zip(ctx.query_lens_list, ctx.context_lens_list)):
        rows = cache.double()[ctx.block_tables[i].long()].flatten(0, 1)[:ctx_len, 0]   # [L, D]
        qs = q[start:start + q_len].double()
        scores = torch.einsum('qhd,kd->hqk', qs, rows) * scale
        qpos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
        scores = scores.masked_fill(torch.arange(ctx_len)[None, :] > qpos, float('-inf'))
        out.append(torch.einsum('hqk,kd->qhd', scores.softmax(-1), rows[:, :v_dim]))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('query_lens,context_lens,block_size,D,v_dim', [
    ([1, 1, 1], [1, 17, 40], 8, 48, 32),          # decode rows
    ([9, 1, 24], [9, 30, 61], 8, 48, 32),          # a whole prompt, a decode, a chunk over a cached prefix
    ([5, 3], [21, 3], 16, 72, 64),                 # D not a multiple of 16, v_dim 8 short of it
    ([2, 1], [70, 33], 4, 576, 512),               # DeepSeek-V2's own row: 512 + 64
])
def test_latent_attention_kernel_matches_reference(query_lens, context_lens, block_size, D, v_dim, dtype):
    ctx, cache, q = _latent_case(query_lens, context_lens, block_size, D, dtype, seed=sum(context_lens))
    scale = D ** -0.5
    want = _expanded(q, cache, ctx, scale, v_dim)
    ref = torch_ops.paged_latent_attention(q, cache, ctx, scale, v_dim)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ref.double(), want, **tol)
    # the C++ kernel over rows: each a query over its visible prefix, its sequence's table by row_seqs
    seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), ctx.query_lens.long())
    visible = torch.cat([torch.arange(c - n + 1, c + 1) for n, c in zip(query_lens, context_lens)]).to(torch.int32)
    for reference in (False, True):
        got = torch.empty(q.shape[0], 4, v_dim, dtype=dtype)
        kernels.ops.paged_latent_attention(dl(q), dl(cache), dl(ctx.block_tables), dl(visible), scale, dl(got),
                                           row_seqs=dl(seq_of_row.to(torch.int32)), reference=reference)
        torch.testing.assert_close(got.double(), want, **tol)


def test_latent_attention_kernel_bad_arguments_are_clear_errors():
    ctx, cache, q = _latent_case([1], [10], 8, 48, torch.float32, seed=0)
    out = torch.empty(1, 4, 32)
    call = kernels.ops.paged_latent_attention
    with pytest.raises(ValueError, match='cache'):
        call(dl(q), dl(torch.zeros(4, 8, 2, 48)), dl(ctx.block_tables), dl(ctx.context_lens), 1.0, dl(out))
    with pytest.raises(ValueError, match='out'):
        call(dl(q), dl(cache), dl(ctx.block_tables), dl(ctx.context_lens), 1.0, dl(torch.empty(1, 4, 64)))
    with pytest.raises(ValueError, match='context_lens'):
        call(dl(q), dl(cache), dl(ctx.block_tables), dl(torch.tensor([99], dtype=torch.int32)), 1.0, dl(out))
    bad_table = ctx.block_tables.clone()
    bad_table[0, 1] = 1000
    with pytest.raises(ValueError, match='block_tables'):
        call(dl(q), dl(cache), dl(bad_table), dl(ctx.context_lens), 1.0, dl(out))


def _config(**fields) -> dict:
    cfg = dict(architectures=['DeepseekV2ForCausalLM'], vocab_size=32, hidden_size=16, intermediate_size=32,
               num_hidden_layers=4, num_attention_heads=2, moe_intermediate_size=8, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=8,
               q_lora_rank=None, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
    return {**cfg, **fields}


def test_config_reads_latent_attention_and_routing():
    config = ModelConfig.from_dict(_config(rope_scaling=dict(type='yarn', factor=40.0, mscale=1.0,
                                                              mscale_all_dim=1.0,
                                                              original_max_position_embeddings=4096)))
    mla, moe = config.mla, config.moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == \
        (None, 8, 4, 4, 6)
    assert config.head_dim == 4 and mla.cache_dim == 12  # the rope table's width; the cached row
    # YaRN's mscale(40, 1) squared on (nope + rope) ** -0.5, as transformers' yarn_apply_mscale
    assert config.attention_scale == pytest.approx(8 ** -0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    assert ModelConfig.from_dict(_config()).attention_scale == pytest.approx(8 ** -0.5)
    assert moe.sparse_layers == (False, True, True, True) and moe.shared_intermediate_size == 16
    assert not moe.shared_gate and moe.topk_method == 'greedy' and moe.routed_scaling_factor == 1.0
    grouped = ModelConfig.from_dict(_config(topk_method='group_limited_greedy', n_group=4, topk_group=2,
                                            routed_scaling_factor=16.0, moe_layer_freq=2, q_lora_rank=6)).moe
    assert (grouped.num_groups, grouped.topk_groups, grouped.routed_scaling_factor) == (4, 2, 16.0)
    assert grouped.sparse_layers == (False, False, True, False)  # from layer 1, every second (DeepSeek's code)
    for bad, words in ((dict(norm_topk_prob=True), 'norm_topk_prob'),
                       (dict(topk_method='noaux_tc'), 'topk_method'),
                       (dict(topk_method='group_limited_greedy', n_group=3, topk_group=1), 'n_group 3'),
                       (dict(attention_bias=True), 'attention_bias'),
                       (dict(qk_rope_head_dim=5), 'qk_rope_head_dim 5'),
                       (dict(quantization_config={'quant_method': 'awq'}), 'quantized deepseek_v2')):
        with pytest.raises(ModelConfigError, match=words):
            ModelConfig.from_dict(_config(**bad))


def test_route_grouped_keeps_to_the_best_groups():
    from lmd.pytorch_backend.models.deepseek import route_grouped
    moe = ModelConfig.from_dict(_config(topk_method='group_limited_greedy', n_group=4, topk_group=2,
                                        num_experts_per_tok=3, routed_scaling_factor=2.0)).moe
    # groups of 2 whose best are 0.9, 0.8, 0.3, 0.85: groups 0 and 3 win, so the top 3 are experts 0, 6
    # and 1 (0.1), not 2 (0.8: its group lost)
    logits = torch.tensor([[0.9, 0.1, 0.8, 0.75, 0.2, 0.3, 0.85, 0.0]]).log()
    weights, ids = route_grouped(logits, moe)
    probs = logits.softmax(-1)[0]
    assert sorted(ids[0].tolist()) == [0, 1, 6]
    torch.testing.assert_close(weights[0].sort().values, (probs[[1, 6, 0]] * 2.0))
