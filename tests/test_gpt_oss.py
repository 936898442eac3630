"""gpt-oss (``GptOssForCausalLM``) on both engines vs HF transformers in float32, on tiny random models.

What sets it apart from the other MoE families: attention sinks (a learned logit per head in each
softmax's denominator), sliding and full layers alternating, biases on q/k/v/o, YaRN RoPE, and experts on
every layer stored stacked with gate and up interleaved, routed by a softmax over the router's top-k
logits (the router has a bias), with biases and a clamped SwiGLU. The tiny model clamps at 1.0 so the
clamp is hit, and its sinks are spread wide so they matter; prompts run past the sliding window.
The attention-sink kernels themselves are tested beside the window ones (test_native_kernels.py).
A tiny checkpoint written as OpenAI ships gpt-oss (experts in MXFP4) checks the dequantization at load
against transformers' own dequantizer.
"""
from __future__ import annotations

import random

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

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
from lmd.weights.moe import expert_biases, stack_experts
from lmd.weights.mxfp4 import FP4_VALUES
from lmd.weights.rope import compute_inv_freq
from test_pytorch_engine import assert_no_leak, generate, hf_greedy, hf_logits, rand_prompt
from test_turbomind_engine import assert_all_blocks_back
from test_turbomind_model import tm_chunked
from tiny_models import saved_models, tiny_hf_model

WINDOW = 16
YARN = {'rope_type': 'yarn', 'rope_theta': 150000.0, 'factor': 32.0, 'beta_fast': 32.0, 'beta_slow': 1.0,
        'truncate': False, 'original_max_position_embeddings': 64}
TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=3, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=WINDOW, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_parameters=YARN,
            swiglu_limit=1.0)


def make_gpt_oss(seed: int = 0):
    model, hf_config = tiny_hf_model('GptOssConfig', 'GptOssForCausalLM', seed, **TINY)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2.0)
    return model, hf_config


@pytest.fixture(scope='module')
def gpt_oss(tmp_path_factory):
    """(HF model, saved dir), built once per module."""
    return saved_models(tmp_path_factory, lambda _: make_gpt_oss())('gpt_oss')


def test_config_reads_experts_sinks_windows_and_yarn(gpt_oss):
    _, path = gpt_oss
    config = ModelConfig.from_dir(path)
    assert config.family == 'gpt_oss' and config.attention_sinks and config.attention_bias
    assert config.layer_windows == (WINDOW, 0, WINDOW)  # HF's default layer_types: sliding, then full
    moe = config.moe
    assert moe.sparse_layers == (True,) * 3 and moe.num_experts == 8 and moe.top_k == 2
    assert moe.topk_method == 'topk_softmax' and moe.router_bias and moe.expert_bias
    assert (moe.swiglu_limit, moe.swiglu_alpha) == (1.0, 1.702)
    assert config.rope_scaling['rope_type'] == 'yarn' and config.rope_theta == 150000.0
    raw = config.raw
    for bad, words in ((dict(num_experts_per_tok=9), 'num_experts_per_tok 9'),
                       (dict(swiglu_limit=0.0), 'swiglu_limit 0.0 must be > 0')):
        with pytest.raises(ModelConfigError, match=words):
            ModelConfig.from_dict({**raw, **bad})


def test_yarn_table_equals_hf(gpt_oss):
    model, path = gpt_oss
    inv_freq, scale = compute_inv_freq(ModelConfig.from_dir(path))
    rotary = model.model.rotary_emb
    torch.testing.assert_close(inv_freq, rotary.inv_freq, rtol=0, atol=0)
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12) and scale > 1.0


def test_experts_load_into_lmd_stacks_and_match_hf(gpt_oss):
    """The stacked, interleaved experts de-interleaved at load; the grouped kernel with biases and the
    clamped SwiGLU against HF's GptOssMLP on the same tokens, the clamp hit."""
    model, path = gpt_oss
    config, weights = ModelConfig.from_dir(path), load_weights(path)
    mlp = model.model.layers[1].mlp
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        want, _ = mlp(x[None])
        _, weights_k, ids = mlp.router(x)
    gate_up, down = stack_experts(config, weights, 1, torch.float32)
    gate_up_bias, down_bias = expert_biases(config, weights, 1, torch.float32)
    got = torch_ops.moe(x, gate_up, down, weights_k, ids, gate_up_bias, down_bias, swiglu_limit=1.0,
                        swiglu_alpha=1.702)
    gu = torch.stack([torch.nn.functional.linear(x, gate_up[e], gate_up_bias[e]) for e in range(8)])
    assert (gu[..., :32] > 1.0).any() and (gu[..., 32:].abs() > 1.0).any()  # both clamps bite
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


def pt_engine(path: str, **cfg) -> PytorchEngine:
    return PytorchEngine(path, PytorchEngineConfig(cache_block_seq_len=8, num_cache_blocks=128, **cfg))


def tm_engine(path: str, **cfg) -> TurbomindEngine:
    return TurbomindEngine(path, TurbomindEngineConfig(cache_block_seq_len=8, num_cache_blocks=128, **cfg))


def assert_close_logits(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape == (17, 512)
    diff = (got - want).abs().max().item()
    assert diff < 1e-3 * (want.max() - want.min()).item(), diff
    return diff


@pytest.mark.parametrize('kernel_backend', [None, 'torch'])
def test_pytorch_teacher_forced_logits_match_hf(gpt_oss, kernel_backend):
    """61 prompt tokens (past the window of 16) in chunks of 24 that end mid-block, then 16 decode steps."""
    model, path = gpt_oss
    rng = random.Random(1)
    prompt, forced = rand_prompt(rng, 61), rand_prompt(rng, 16)
    with pt_engine(path, max_prefill_token_num=24, kernel_backend=kernel_backend) as engine:
        got = engine.teacher_forced_logits(prompt, forced)
        assert_no_leak(engine)
    assert_close_logits(got, hf_logits(model, prompt + forced)[len(prompt) - 1:])


def test_turbomind_teacher_forced_logits_match_hf(gpt_oss):
    model, path = gpt_oss
    config, weights = ModelConfig.from_dir(path), load_weights(path)
    rng = random.Random(1)
    tokens = rand_prompt(rng, 61) + rand_prompt(rng, 16)
    got = tm_chunked(TurbomindModel(config, weights, torch.float32, 64, 4), tokens, [24, 24, 13])[60:]
    assert_close_logits(got, hf_logits(model, tokens)[60:])


@pytest.mark.parametrize('engine', ['pytorch', 'turbomind'])
def test_batched_greedy_matches_hf(gpt_oss, engine):
    """32 greedy tokens of prompts submitted at once (two longer than the window), on the real engines."""
    model, path = gpt_oss
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (37, 5, 20, 12)]
    make, chunk, all_back = {'pytorch': (pt_engine, 128, assert_no_leak),
                             'turbomind': (tm_engine, 24, assert_all_blocks_back)}[engine]
    with make(path, max_batch_size=4, max_prefill_token_num=chunk) as e:
        got = generate(e, prompts, SamplingParams(max_new_tokens=32))[0]
        all_back(e)
    assert got == [hf_greedy(model, p, 32) for p in prompts]


def test_turbomind_runs_gpt_oss_converted_and_auto_picks_it(gpt_oss, tmp_path):
    """TurboMind's own layout keeps the sinks, the router's and the experts' biases."""
    model, path = gpt_oss
    assert turbomind_refusal(path) is None and autoget_backend(path) == 'turbomind'
    out = convert(path, str(tmp_path / 'tm'), backend='turbomind')
    prompt = rand_prompt(random.Random(4), 30)
    with tm_engine(out) as engine:
        assert generate(engine, [prompt], SamplingParams(max_new_tokens=8))[0] == [hf_greedy(model, prompt, 8)]


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (blocks uint8 [E, N, K / 32, 16], scales uint8 [E, N, K / 32]): each group of 32 scaled
    by the power of two that brings its largest value within FP4's 6, each value to its nearest code."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6)).clamp(-100, 100)
    codes = (groups / 2.0 ** exp[..., None])[..., None].sub(torch.tensor(FP4_VALUES)).abs().argmin(-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


@pytest.fixture(scope='module')
def gpt_oss_mxfp4(tmp_path_factory):
    """(HF model with the experts transformers dequantizes from the MXFP4 file, the file's dir)."""
    model, _ = make_gpt_oss(seed=1)
    path = str(tmp_path_factory.mktemp('gpt_oss_mxfp4'))
    model.save_pretrained(path, safe_serialization=True)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for name in [n for n in tensors if n.endswith(('experts.gate_up_proj', 'experts.down_proj'))]:
        blocks, scales = to_mxfp4(tensors.pop(name).transpose(1, 2))  # stored [E, N, K]
        tensors[name + '_blocks'], tensors[name + '_scales'] = blocks, scales
        with torch.no_grad():  # the reference: what transformers reads out of the file
            model.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
    with open(os.path.join(path, 'config.json')) as f:
        cfg = json.load(f)
    cfg['quantization_config'] = {'quant_method': 'mxfp4', 'modules_to_not_convert': ['model.layers.*.self_attn',
                                                                                       'model.layers.*.mlp.router']}
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    return model, path


def test_mxfp4_experts_dequantized_at_load_on_both_engines(gpt_oss_mxfp4):
    model, path = gpt_oss_mxfp4
    config = ModelConfig.from_dir(path)
    assert config.model_format == 'mxfp4' and config.moe.swiglu_limit == 1.0
    rng = random.Random(3)
    prompt, forced = rand_prompt(rng, 45), rand_prompt(rng, 16)
    want = hf_logits(model, prompt + forced)[len(prompt) - 1:]
    with pt_engine(path, max_prefill_token_num=24) as engine:
        assert engine.model_format == 'mxfp4'
        assert_close_logits(engine.teacher_forced_logits(prompt, forced), want)
    with tm_engine(path, max_prefill_token_num=24) as engine:
        assert generate(engine, [prompt], SamplingParams(max_new_tokens=16))[0] == [hf_greedy(model, prompt, 16)]
