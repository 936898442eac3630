"""Gemma 2 and Gemma 3 (text) vs HF transformers (float32 eager) on tiny random models whose window
(8 tokens) is far shorter than the sequences (~40 tokens).

Gemma scales its embeddings by sqrt(H), norms by (1 + w), norms the attention's and the MLP's
outputs too, runs GeGLU and scales scores by query_pre_attn_scalar; Gemma 2 soft-caps attention
scores and final logits (caps small here, so that they bite) and alternates sliding and full layers;
Gemma 3 normalises q and k per head and rotates its sliding layers by their own RoPE base.
"""
from __future__ import annotations

import pytest

from lmd.engine import SamplingParams
from lmd.messages import PytorchEngineConfig, TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.pytorch_backend import PytorchEngine
from lmd.turbomind.engine import TurbomindEngine
from test_families import ENGINES, IDS, engine_logits, tokens
from test_models import hf_logits
from test_pytorch_engine import generate, hf_greedy
from tiny_models import tiny_hf_model

WINDOW = 8
GEMMA = dict(IDS, vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
             sliding_window=WINDOW, query_pre_attn_scalar=24)
FAMILIES = {
    'gemma2': ('Gemma2Config', 'Gemma2ForCausalLM',
               dict(GEMMA, num_hidden_layers=4, attn_logit_softcapping=4.0, final_logit_softcapping=6.0)),
    'gemma3': ('Gemma3TextConfig', 'Gemma3ForCausalLM',
               dict(GEMMA, num_hidden_layers=4, sliding_window_pattern=2, rope_theta=1e6,
                    rope_local_base_freq=100.0, rope_scaling={'rope_type': 'linear', 'factor': 4.0})),
}


def make(family: str):
    """(HF model, ModelConfig, HF-named weights) of a tiny random ``family`` model."""
    cfg_name, model_name, extra = FAMILIES[family]
    model, hf_config = tiny_hf_model(cfg_name, model_name, 0, **extra)
    config = ModelConfig.from_dict(hf_config.to_dict())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights.pop('lm_head.weight', None)  # tied
    return model, config, weights


def test_configs_read_gemma():
    _, g2, _ = make('gemma2')
    assert (g2.family, g2.tie_word_embeddings, g2.layer_windows) == ('gemma2', True, (WINDOW, 0, WINDOW, 0))
    assert (g2.attn_softcap, g2.logit_softcap, g2.attention_scale) == (4.0, 6.0, 24 ** -0.5)
    assert (g2.norm_offset, g2.mlp_activation, g2.embed_scale, g2.local_rope_layers) == (1.0, 'gelu_tanh', 8.0, ())
    _, g3, _ = make('gemma3')
    assert (g3.family, g3.qk_norm, g3.attn_softcap, g3.logit_softcap) == ('gemma3', True, 0.0, 0.0)
    assert g3.local_rope_layers == (True, False, True, False) and g3.rope_local_theta == 100.0
    assert (g3.rope_theta, g3.rope_scaling['rope_type']) == (1e6, 'linear')
    # an older config.json: no layer_types, the pattern and the local base as plain fields
    old = {k: v for k, v in g3.raw.items() if k not in ('layer_types', 'rope_parameters')}
    old = ModelConfig.from_dict(dict(old, rope_theta=1e6, rope_local_base_freq=100.0, sliding_window_pattern=2))
    assert old.layer_windows == g3.layer_windows and old.rope_local_theta == 100.0


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('family', list(FAMILIES))
def test_teacher_forced_logits_match_hf(engine, family):
    hf_model, config, weights = make(family)
    toks = tokens(40, seed=5)  # five windows long: chunks of 7 and 4, then decode steps
    ref = hf_logits(hf_model, toks)
    assert ref.abs().max() > 1.0
    diff = (engine_logits(engine, config, weights, toks, None) - ref).abs().max().item()
    assert diff < 1e-3, f'{engine} {family}: max |logit diff| vs HF = {diff}'


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('family', list(FAMILIES))
def test_greedy_matches_hf(tmp_path, engine, family):
    hf_model, _, _ = make(family)
    hf_model.save_pretrained(str(tmp_path), safe_serialization=True)
    prompts = [tokens(n, seed=n) for n in (5, 37)]
    cls, cfg = (TurbomindEngine, TurbomindEngineConfig) if engine == 'turbomind' else (PytorchEngine,
                                                                                       PytorchEngineConfig)
    config = cfg(dtype='float32', cache_block_seq_len=4, num_cache_blocks=64, max_prefill_token_num=16,
                 session_len=128)
    with cls(str(tmp_path), config) as e:
        got, _ = generate(e, prompts, SamplingParams(max_new_tokens=32))
    assert got == [hf_greedy(hf_model, p, 32) for p in prompts]


def test_native_gelu_tanh_and_mul_matches_torch():
    import torch
    from torch.utils.dlpack import to_dlpack

    from lmd.kernels import ops
    from lmd.pytorch_backend.kernels.torch_ops import gelu_tanh_and_mul
    x = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(0)) * 3
    out = torch.empty(5, 24)
    ops.gelu_tanh_and_mul(to_dlpack(x), to_dlpack(out))
    torch.testing.assert_close(out, gelu_tanh_and_mul(x), rtol=1e-5, atol=1e-6)


def test_gemma3_converted_to_turbomind_layout_gives_hf_greedy_tokens(tmp_path):
    """``lmd convert --backend turbomind``: both RoPE tables are rebuilt from the config on load."""
    from lmd.weights.turbomind_layout import export
    hf_model, _, _ = make('gemma3')
    src, out = tmp_path / 'hf', tmp_path / 'tm'
    hf_model.save_pretrained(str(src), safe_serialization=True)
    export(str(src), str(out))
    prompt = tokens(37, seed=37)
    config = TurbomindEngineConfig(dtype='float32', cache_block_seq_len=4, num_cache_blocks=64, session_len=128)
    with TurbomindEngine(str(out), config) as e:
        got, _ = generate(e, [prompt], SamplingParams(max_new_tokens=16))
    assert got == [hf_greedy(hf_model, prompt, 16)]
