"""OLMo 2, GLM and GLM-4 in both engines vs HF transformers (float32 eager) on tiny random models.

OLMo 2 has no pre-norms: it RMS-normalises the attention's and the MLP's outputs before each residual
add, and q and k over all their heads at once (one norm [Hq * D], not per head) before RoPE. GLM
stores gate/up fused, biases q/k/v and rotates interleaved pairs (GPT-J style) of half of each head,
which lmd runs as half-split by permuting q's and k's rows at load (lmd.weights.interleaved_rope);
GLM-4 adds norms on the attention's and the MLP's outputs (a sandwich without Gemma's 1 + w).
"""
from __future__ import annotations

import pytest
import torch

from lmd.backend import autoget_backend
from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig
from lmd.weights.interleaved_rope import half_split_order, to_half_split
from lmd.weights.rope import rotary_dim
from lmd.weights.schema import expected_weight_shapes, layer_matmuls, layer_norms
from test_families import ENGINES, IDS, engine_greedy, engine_logits, tokens
from test_models import hf_logits
from test_pytorch_engine import hf_greedy
from tiny_models import saved_models, tiny_hf_model

TINY = dict(IDS, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
GLM = dict(TINY, head_dim=16, partial_rotary_factor=0.5, attention_bias=True)
FAMILIES = {
    'olmo2': ('Olmo2Config', 'Olmo2ForCausalLM', dict(TINY, rope_theta=500.0)),
    'olmo2_bias': ('Olmo2Config', 'Olmo2ForCausalLM', dict(TINY, attention_bias=True)),
    'glm4': ('Glm4Config', 'Glm4ForCausalLM', GLM),
    'glm': ('GlmConfig', 'GlmForCausalLM', GLM),
}


def make(family: str, seed: int = 0):
    """(HF model, ModelConfig, HF-named weights) of a tiny random ``family`` model."""
    cfg_name, model_name, extra = FAMILIES[family]
    model, hf_config = tiny_hf_model(cfg_name, model_name, seed, **extra)
    config = ModelConfig.from_dict(hf_config.to_dict())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, config, weights


def test_configs_read_olmo2():
    _, config, weights = make('olmo2')
    assert (config.family, config.pre_norms, config.sandwich_norms, config.qk_norm, config.qk_norm_all_heads) == (
        'olmo2', False, True, True, True)
    assert (config.tie_word_embeddings, config.rope_theta, config.rope_interleaved) == (False, 500.0, False)
    assert layer_norms(config) == {'attn_out_norm': 'post_attention_layernorm',
                                   'mlp_out_norm': 'post_feedforward_layernorm'}
    shapes, optional = expected_weight_shapes(config)
    assert shapes['model.layers.0.self_attn.q_norm.weight'] == (64,)  # all 4 heads of 16
    assert shapes['model.layers.0.self_attn.k_norm.weight'] == (32,)
    assert 'model.layers.0.input_layernorm.weight' not in shapes and 'lm_head.weight' not in optional
    assert set(shapes) == set(weights)
    _, biased, weights = make('olmo2_bias')
    assert biased.attention_bias and 'model.layers.0.self_attn.o_proj.bias' in weights
    assert set(expected_weight_shapes(biased)[0]) == set(weights)


def test_configs_read_glm():
    _, glm4, weights = make('glm4')
    assert (glm4.family, glm4.rope_interleaved, glm4.sandwich_norms, glm4.pre_norms, glm4.qk_norm) == (
        'glm4', True, True, True, False)
    assert glm4.attention_bias and rotary_dim(glm4) == 8 and glm4.head_dim == 16
    assert layer_matmuls(glm4)['gate_up'] == ('mlp.gate_up_proj',)
    assert layer_matmuls(glm4)['qkv'] == ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj')
    assert layer_norms(glm4) == {'input_norm': 'input_layernorm', 'attn_out_norm': 'post_self_attn_layernorm',
                                 'post_norm': 'post_attention_layernorm', 'mlp_out_norm': 'post_mlp_layernorm'}
    assert set(expected_weight_shapes(glm4)[0]) == set(weights)  # q/k/v biased, o not
    _, glm, weights = make('glm')
    assert (glm.family, glm.rope_interleaved, glm.sandwich_norms) == ('glm', True, False)
    assert set(expected_weight_shapes(glm)[0]) == set(weights)
    # an older config.json: the factor at the top level, or none at all (HF's GLM default: half)
    raw = {k: v for k, v in glm4.raw.items() if k != 'rope_parameters'}
    assert rotary_dim(ModelConfig.from_dict(dict(raw, partial_rotary_factor=0.25))) == 4
    assert rotary_dim(ModelConfig.from_dict(raw)) == 8


def test_half_split_order_turns_interleaved_rope_into_half_split():
    """NeoX rotation of the reordered dims == GLM's pairwise rotation of the original, reordered."""
    D, rot = 16, 8
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0))
    angles = torch.arange(5.0)[:, None] * torch.tensor([1.0, 0.3, 0.1, 0.02])  # [T, rot / 2]
    cos, sin = angles.cos(), angles.sin()
    gptj = x.clone()
    gptj[:, 0:rot:2] = x[:, 0:rot:2] * cos - x[:, 1:rot:2] * sin
    gptj[:, 1:rot:2] = x[:, 1:rot:2] * cos + x[:, 0:rot:2] * sin
    order = half_split_order(rot, D)
    y = x[:, order]
    neox = y.clone()
    neox[:, :rot // 2] = y[:, :rot // 2] * cos - y[:, rot // 2:rot] * sin
    neox[:, rot // 2:rot] = y[:, rot // 2:rot] * cos + y[:, :rot // 2] * sin
    torch.testing.assert_close(neox, gptj[:, order])


def test_half_split_leaves_the_callers_weights_and_refuses_quantized_q():
    _, config, weights = make('glm4')
    q = 'model.layers.0.self_attn.q_proj.weight'
    before = weights[q].clone()
    out = to_half_split(config, weights)
    assert torch.equal(weights[q], before) and not torch.equal(out[q], before)
    assert torch.equal(out['model.layers.0.self_attn.v_proj.weight'], weights['model.layers.0.self_attn.v_proj.weight'])
    with pytest.raises(ModelFormatError, match='q_proj / k_proj'):
        to_half_split(config, weights, {q: (torch.zeros(64, 32, dtype=torch.uint8),) * 3})


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('family', list(FAMILIES))
def test_teacher_forced_logits_match_hf(engine, family):
    hf_model, config, weights = make(family)
    toks = tokens(27, seed=3)  # chunks of 7 and 4, then decode steps
    ref = hf_logits(hf_model, toks)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    diff = (engine_logits(engine, config, weights, toks, None) - ref).abs().max().item()
    assert diff < 1e-3, f'{engine} {family}: max |logit diff| vs HF = {diff}'


@pytest.fixture(scope='module')
def family_dirs(tmp_path_factory):
    return saved_models(tmp_path_factory, make)


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('family', ['olmo2', 'glm4', 'glm'])
def test_greedy_matches_hf(family_dirs, engine, family):
    hf_model, path = family_dirs(family)
    assert autoget_backend(path) == 'turbomind'  # pipeline() picks TurboMind for them
    prompts = [tokens(n, seed=n) for n in (5, 23)]
    assert engine_greedy(engine, path, prompts, None) == [hf_greedy(hf_model, p, 32) for p in prompts]


@pytest.mark.parametrize('family', ['olmo2', 'glm4'])
def test_converted_to_turbomind_layout_gives_hf_greedy_tokens(tmp_path, family):
    """``lmd convert --backend turbomind`` stores GLM's q/k rows permuted once; loading them permutes no more."""
    from lmd.weights.turbomind_layout import export
    hf_model, _, _ = make(family)
    src, out = tmp_path / 'hf', tmp_path / 'tm'
    hf_model.save_pretrained(str(src), safe_serialization=True)
    export(str(src), str(out))
    prompt = tokens(23, seed=23)
    assert engine_greedy('turbomind', str(out), [prompt], None) == [hf_greedy(hf_model, prompt, 32)]
