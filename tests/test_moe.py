"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) on both engines vs HF transformers in
float32: teacher-forced logits through chunked prefill and decode, greedy tokens of prompts batched
together (tokens of different sequences routed to the same experts); TurboMind's rows independent of
the step's other rows, its converted layout, its errors for bad expert shapes; the PyTorch engine's
grouped-matmul kernel vs every expert on every token; the config's MoE fields.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from lmd.backend import autoget_backend, turbomind_refusal
from lmd.convert import convert
from lmd.engine import SamplingParams
from lmd.messages import PytorchEngineConfig, TurbomindEngineConfig
from lmd.model_config import ModelConfig, ModelConfigError
from lmd.model_loader import load_weights
from lmd.pytorch_backend import PytorchEngine
from lmd.pytorch_backend.kernels import torch_ops
from lmd.turbomind.engine import TurbomindEngine
from lmd.turbomind.model import TurbomindModel
from lmd.weights.schema import fuse_weights
from test_pytorch_engine import assert_no_leak, generate, hf_greedy, hf_logits, rand_prompt
from test_turbomind_engine import assert_all_blocks_back
from test_turbomind_model import Runner, tm_chunked
from tiny_models import saved_models, tiny_hf_model

TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-6)
FAMILIES = {
    'mixtral': ('MixtralConfig', 'MixtralForCausalLM',
                dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                     sliding_window=None)),
    # layer 1 dense (mlp_only_layers), layers 0 and 2 experts beside a shared expert; top-k not renormalised
    'qwen2_moe': ('Qwen2MoeConfig', 'Qwen2MoeForCausalLM',
                  dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                       norm_topk_prob=False)),
    'qwen3_moe': ('Qwen3MoeConfig', 'Qwen3MoeForCausalLM',
                  dict(num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=24)),
}


@pytest.fixture(scope='module')
def moe_models(tmp_path_factory):
    """family -> (HF model, saved dir); built once per module."""
    def make(family: str):
        cfg_name, model_name, extra = FAMILIES[family]
        return tiny_hf_model(cfg_name, model_name, **TINY, **extra)
    return saved_models(tmp_path_factory, make)


def moe_engine(path: str, **cfg) -> PytorchEngine:
    return PytorchEngine(path, PytorchEngineConfig(cache_block_seq_len=8, num_cache_blocks=128, **cfg))


@pytest.mark.parametrize('kernel_backend', [None, 'torch'])
@pytest.mark.parametrize('family', list(FAMILIES))
def test_teacher_forced_logits_match_hf(moe_models, family, kernel_backend):
    model, path = moe_models(family)
    rng = random.Random(1)
    prompt, forced = rand_prompt(rng, 61), rand_prompt(rng, 16)
    # chunks of 24: the prompt prefills in 3 chunks that end mid-block, then 16 decode steps
    with moe_engine(path, max_prefill_token_num=24, kernel_backend=kernel_backend) as engine:
        got = engine.teacher_forced_logits(prompt, forced)
        assert_no_leak(engine)
    want = hf_logits(model, prompt + forced)[len(prompt) - 1:]
    assert got.shape == want.shape == (17, 512)
    assert (got - want).abs().max().item() < 1e-3 * (want.max() - want.min()).item()


@pytest.mark.parametrize('engine', ['pytorch', 'turbomind'])
@pytest.mark.parametrize('family', list(FAMILIES))
def test_batched_greedy_matches_hf(moe_models, family, engine):
    """Submitted at once, the prompts run in the same steps: tokens of different sequences share experts
    (TurboMind in chunks of 24 tokens, so prefill chunks and decodes share steps too)."""
    model, path = moe_models(family)
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (37, 5, 20, 12)]
    make, chunk, all_back = {'pytorch': (moe_engine, 128, assert_no_leak),
                             'turbomind': (tm_moe_engine, 24, assert_all_blocks_back)}[engine]
    with make(path, max_batch_size=4, max_prefill_token_num=chunk) as e:
        got = generate(e, prompts, SamplingParams(max_new_tokens=32))[0]
        all_back(e)
    assert got == [hf_greedy(model, p, 32) for p in prompts]


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_every_expert_on_every_token(dtype):
    gen = torch.Generator().manual_seed(0)
    T, H, I, E, k = 40, 16, 8, 6, 3
    x = torch.randn(T, H, generator=gen).to(dtype)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen).to(dtype), torch.randn(E, H, I, generator=gen).to(dtype)
    # expert 2 every token uses, expert 5 none; the others in random slots
    others = torch.tensor([0, 1, 3, 4])
    ids = torch.stack([torch.cat([torch.tensor([2]), others[torch.randperm(4, generator=gen)[:k - 1]]])
                       for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    # every expert on every token, the unrouted ones weighted 0
    dense = torch.stack([F.linear(torch_ops.silu_and_mul(F.linear(x, gate_up[e])), down[e]) for e in range(E)], 1)
    full = torch.zeros(T, E).scatter_add_(1, ids, weights)
    want = (dense.float() * full[:, :, None]).sum(1)
    got = torch_ops.moe(x, gate_up, down, weights, ids)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def _qwen2_moe_config(**fields) -> dict:
    cfg = dict(architectures=['Qwen2MoeForCausalLM'], vocab_size=32, hidden_size=16, intermediate_size=32,
               num_hidden_layers=6, num_attention_heads=2, moe_intermediate_size=8, num_experts=4,
               num_experts_per_tok=2)
    return {**cfg, **fields}


def test_config_reads_sparse_layers_and_refuses_unsupported_settings():
    moe = ModelConfig.from_dict(_qwen2_moe_config(decoder_sparse_step=2, mlp_only_layers=[3])).moe
    assert moe.sparse_layers == (False, True, False, False, False, True)
    assert moe.shared_intermediate_size == 5632 and not moe.norm_topk_prob  # HF's defaults
    qwen3 = ModelConfig.from_dict(_qwen2_moe_config(architectures=['Qwen3MoeForCausalLM'], num_experts=None,
                                                    num_local_experts=4, norm_topk_prob=True))
    assert qwen3.qk_norm and qwen3.moe.num_experts == 4 and qwen3.moe.shared_intermediate_size == 0
    assert ModelConfig.from_dict(_qwen2_moe_config()).attention_bias  # Qwen2-MoE's q/k/v carry biases
    for bad, words in ((dict(num_experts_per_tok=5), 'num_experts_per_tok 5'),
                       (dict(hidden_act='gelu'), 'hidden_act')):
        with pytest.raises(ModelConfigError, match=words):
            ModelConfig.from_dict(_qwen2_moe_config(**bad))


def tm_moe_engine(path: str, **cfg) -> TurbomindEngine:
    return TurbomindEngine(path, TurbomindEngineConfig(cache_block_seq_len=8, num_cache_blocks=128, **cfg))


@pytest.mark.parametrize('family', list(FAMILIES))
def test_turbomind_teacher_forced_logits_match_hf(moe_models, family):
    model, path = moe_models(family)
    config, weights = ModelConfig.from_dir(path), load_weights(path)
    rng = random.Random(1)
    tokens = rand_prompt(rng, 61) + rand_prompt(rng, 16)
    # the prompt in 3 chunks that end mid-block, then 16 decode steps
    got = tm_chunked(TurbomindModel(config, weights, torch.float32, 64, 4), tokens, [24, 24, 13])[60:]
    want = hf_logits(model, tokens)[60:]
    assert got.shape == want.shape == (17, 512)
    assert (got - want).abs().max().item() < 1e-3 * (want.max() - want.min()).item()


def test_turbomind_rows_equal_each_sequence_alone(moe_models):
    """A step mixing sequences gives each bitwise what it gets alone: a token's experts and their
    sum never depend on which other tokens the step routes to them."""
    _, path = moe_models('qwen2_moe')
    model = TurbomindModel(ModelConfig.from_dir(path), load_weights(path), torch.float32, 64, 4)
    seqs = [rand_prompt(random.Random(10 + n), n) for n in (5, 9, 14)]
    runner = Runner(model, 64, seed=7)
    got = runner.step([(i, s) for i, s in enumerate(seqs)])
    for i, seq in enumerate(seqs):
        assert torch.equal(got[i], tm_chunked(model, seq, [len(seq)], seed=100 + i)), f'seq {i}'


def test_turbomind_runs_moe_converted_and_auto_picks_it(moe_models, tmp_path):
    model, path = moe_models('qwen2_moe')
    assert turbomind_refusal(path) is None and autoget_backend(path) == 'turbomind'
    out = convert(path, str(tmp_path / 'tm'), backend='turbomind')
    prompt = rand_prompt(random.Random(4), 20)
    with tm_moe_engine(out) as engine:
        assert generate(engine, [prompt], SamplingParams(max_new_tokens=8))[0] == [hf_greedy(model, prompt, 8)]


def test_turbomind_bad_expert_shapes_are_clear_errors(moe_models):
    _, path = moe_models('qwen3_moe')
    config, weights = ModelConfig.from_dir(path), load_weights(path)
    tensors = fuse_weights(config, weights, torch.float32)
    tensors['layers.1.experts.down'] = tensors['layers.1.experts.down'][:, :, :16].contiguous()
    with pytest.raises(ValueError, match=r'layers\.1\.experts\.down.*\[8, 4, 32, 16\]'):
        TurbomindModel.from_fused(config, tensors, torch.float32, 16, 4)
