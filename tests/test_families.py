"""SmolLM3 and Phi-3 in both engines vs HF transformers (float32 eager) on tiny random models.

SmolLM3 leaves RoPE out of the layers its ``no_rope_layers`` marks 0; Phi-3 stores q/k/v and gate/up
fused, may rotate only part of each head, and scales RoPE by LongRoPE, whose factors HF picks by the
sequence length (long past ``original_max_position_embeddings``): lmd picks them by the session
length (``lmd.weights.rope``), so each check below runs sequences on the side of the original
context its session is on. Sliding windows: tests/test_sliding_window.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from lmd.engine import SamplingParams
from lmd.messages import PytorchEngineConfig, TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.pytorch_backend import PytorchEngine
from lmd.pytorch_backend.models import build_model
from lmd.turbomind.engine import TurbomindEngine
from lmd.turbomind.model import TurbomindModel
from lmd.weights.memory import default_session_len
from test_models import hf_logits, run_chunked
from test_pytorch_engine import generate, hf_greedy, rand_prompt
from test_turbomind_model import BLOCK_SIZE, tm_chunked
from tiny_models import saved_models, tiny_hf_model

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ORIGINAL_LEN = 16  # the LongRoPE model's original context
LONGROPE = {'rope_type': 'longrope', 'short_factor': [1.0 + 0.15 * i for i in range(8)],
            'long_factor': [1.0 + 1.5 * i for i in range(8)], 'original_max_position_embeddings': ORIGINAL_LEN}
IDS = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
FAMILIES = {
    'smollm3': ('SmolLM3Config', 'SmolLM3ForCausalLM', dict(IDS, no_rope_layers=[1, 0, 1], tie_word_embeddings=True)),
    'phi3': ('Phi3Config', 'Phi3ForCausalLM', dict(IDS, partial_rotary_factor=0.5, sliding_window=64)),
    'phi3_longrope': ('Phi3Config', 'Phi3ForCausalLM',
                      dict(IDS, rope_scaling=LONGROPE, original_max_position_embeddings=ORIGINAL_LEN)),
}
ENGINES = ('pytorch', 'turbomind')
TOLERANCE = 1e-3


def make_family(family: str, seed: int = 0):
    """(HF model, ModelConfig, HF-named weights) of a tiny random ``family`` model."""
    cfg_name, model_name, extra = FAMILIES[family]
    model, hf_config = tiny_hf_model(cfg_name, model_name, seed, **TINY, **extra)
    config = ModelConfig.from_dict(hf_config.to_dict())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop('lm_head.weight', None)
    return model, config, weights


def tokens(n: int, seed: int) -> list[int]:
    return rand_prompt(random.Random(seed), n, TINY['vocab_size'])


def engine_logits(engine: str, config: ModelConfig, weights, toks: list[int], session_len: int | None):
    """Teacher-forced float32 logits of ``toks``: a prefill in two chunks, then decode steps."""
    chunks = [7, 4]
    if engine == 'turbomind':
        model = TurbomindModel(config, weights, torch.float32, 64, BLOCK_SIZE, session_len=session_len)
        return tm_chunked(model, toks, chunks)
    model = build_model(config, weights, torch.float32)
    model.build_rope(session_len)
    return run_chunked(model, toks, chunks)


def test_configs_read_the_family_fields():
    _, smollm3, _ = make_family('smollm3')
    assert (smollm3.family, smollm3.rope_layers, smollm3.sliding_window) == ('smollm3', (True, False, True), None)
    assert [smollm3.uses_rope(i) for i in range(3)] == [True, False, True]
    _, phi3, weights = make_family('phi3')
    assert (phi3.family, phi3.sliding_window, phi3.rope_layers) == ('phi3', 64, ())
    assert 'model.layers.0.self_attn.qkv_proj.weight' in weights and 'model.layers.0.mlp.gate_up_proj.weight' in weights
    assert phi3.layer_windows == (64, 64, 64) and phi3.kv_window == 64
    # the attention keeps to the window: it caps no session
    assert default_session_len(phi3, None) == TINY['max_position_embeddings'] and default_session_len(phi3, 300) == 300
    _, longrope, _ = make_family('phi3_longrope')
    assert default_session_len(longrope, None) == ORIGINAL_LEN and default_session_len(longrope, 200) == 200


def test_smollm3_sliding_window_switch_and_interval():
    """use_sliding_window turns the window on; without no_rope_layers every
    no_rope_layer_interval-th layer goes without RoPE, as HF's config computes."""
    cfg = dict(architectures=['SmolLM3ForCausalLM'], vocab_size=8, hidden_size=8, intermediate_size=8,
               num_hidden_layers=8, num_attention_heads=2, sliding_window=32)
    config = ModelConfig.from_dict(cfg)
    assert config.sliding_window is None
    assert config.rope_layers == (True, True, True, False, True, True, True, False)
    assert ModelConfig.from_dict(dict(cfg, use_sliding_window=True)).sliding_window == 32


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('family, n, session_len', [
    ('smollm3', 27, None), ('phi3', 27, None),
    ('phi3_longrope', 27, None),           # past the original context: the long factors
    ('phi3_longrope', ORIGINAL_LEN, ORIGINAL_LEN),  # a session within it: the short ones
])
def test_teacher_forced_logits_match_hf(engine, family, n, session_len):
    hf_model, config, weights = make_family(family)
    toks = tokens(n, seed=3)
    ref = hf_logits(hf_model, toks)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    diff = (engine_logits(engine, config, weights, toks, session_len) - ref).abs().max().item()
    assert diff < TOLERANCE, f'{engine} {family}: max |logit diff| vs HF = {diff}'


@pytest.fixture(scope='module')
def family_dirs(tmp_path_factory):
    return saved_models(tmp_path_factory, make_family)


def engine_greedy(engine: str, path: str, prompts: list[list[int]], session_len: int | None) -> list[list[int]]:
    common = dict(dtype='float32', cache_block_seq_len=8, num_cache_blocks=64, max_prefill_token_num=16,
                  session_len=session_len)
    cls, cfg = (TurbomindEngine, TurbomindEngineConfig) if engine == 'turbomind' else (PytorchEngine,
                                                                                       PytorchEngineConfig)
    with cls(path, cfg(**common)) as e:
        got, _ = generate(e, prompts, SamplingParams(max_new_tokens=32))
    return got


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('family, lengths, session_len', [
    ('smollm3', (5, 23), None), ('phi3', (5, 23), None),
    ('phi3_longrope', (17, 23), 128),      # prompts past the original context: HF's long factors throughout
])
def test_greedy_matches_hf(family_dirs, engine, family, lengths, session_len):
    hf_model, path = family_dirs(family)
    prompts = [tokens(n, seed=n) for n in lengths]
    assert engine_greedy(engine, path, prompts, session_len) == [hf_greedy(hf_model, p, 32) for p in prompts]


@pytest.mark.parametrize('engine', ENGINES)
def test_longrope_short_session_greedy_matches_hf(family_dirs, engine):
    """A session within the original context: the short factors, as HF uses for every such sequence."""
    hf_model, path = family_dirs('phi3_longrope')
    prompts = [tokens(n, seed=n) for n in (3, 6)]
    want = [hf_greedy(hf_model, p, ORIGINAL_LEN - 1 - len(p)) for p in prompts]
    got = engine_greedy(engine, path, prompts, None)  # the default session: the original context
    assert [g[:len(w)] for g, w in zip(got, want)] == want

