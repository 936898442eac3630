"""Sliding-window attention in both engines vs HF transformers (float32 eager) on tiny random models
whose window (8 tokens) is far shorter than the sequences: Mistral (every layer), Qwen2 with
``use_sliding_window`` from ``max_window_layers`` on (full and sliding layers mixed), Phi-3.

Where every layer slides, a sequence's blocks wholly before its next query's window are given back
as it runs: a KV cache too small to hold one whole sequence still serves it, and the block
accounting holds after every request."""
from __future__ import annotations

import pytest

from lmd.engine import SamplingParams
from lmd.messages import PytorchEngineConfig, TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.pytorch_backend import PytorchEngine
from lmd.turbomind.engine import TurbomindEngine
from test_families import ENGINES, IDS, TINY, engine_logits, tokens
from test_models import hf_logits
from test_pytorch_engine import assert_no_leak, generate, hf_greedy
from test_turbomind_engine import assert_all_blocks_back
from tiny_models import saved_models, tiny_hf_model

WINDOW = 8
FAMILIES = {
    'mistral': ('MistralConfig', 'MistralForCausalLM', dict(IDS, sliding_window=WINDOW)),
    'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM', dict(IDS, sliding_window=WINDOW, use_sliding_window=True,
                                                      max_window_layers=1)),
    'phi3': ('Phi3Config', 'Phi3ForCausalLM', dict(IDS, sliding_window=WINDOW)),
}


def make(family: str):
    cfg_name, model_name, extra = FAMILIES[family]
    model, hf_config = tiny_hf_model(cfg_name, model_name, 0, **TINY, **extra)
    config = ModelConfig.from_dict(hf_config.to_dict())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, config, weights


def test_layer_windows_read_as_hf_applies_them():
    assert make('mistral')[1].layer_windows == (WINDOW,) * 3 and make('mistral')[1].kv_window == WINDOW
    qwen2 = make('qwen2')[1]  # layers from max_window_layers on slide; a full layer keeps every block
    assert qwen2.layer_windows == (0, WINDOW, WINDOW) and qwen2.kv_window == 0
    plain = ModelConfig.from_dict(dict(make('qwen2')[1].raw, use_sliding_window=False, layer_types=None))
    assert plain.layer_windows == (0, 0, 0)


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('family', list(FAMILIES))
def test_teacher_forced_logits_match_hf_past_the_window(engine, family):
    hf_model, config, weights = make(family)
    toks = tokens(40, seed=5)  # five windows long: chunks of 7 and 4, then decode steps
    ref = hf_logits(hf_model, toks)
    got = engine_logits(engine, config, weights, toks, None)
    assert (got - ref).abs().max().item() < 1e-3
    # the window matters here: the same weights with full attention give other logits
    cfg_name, model_name, extra = FAMILIES[family]
    full, _ = tiny_hf_model(cfg_name, model_name, 0, **TINY, **dict(extra, sliding_window=None, use_sliding_window=False))
    full.load_state_dict(hf_model.state_dict())
    assert (hf_logits(full, toks) - ref).abs().max().item() > 0.1


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    return saved_models(tmp_path_factory, make)


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('family, num_cache_blocks', [('mistral', 6), ('mistral', 64), ('qwen2', 64)])
def test_greedy_tokens_match_hf(saved, engine, family, num_cache_blocks):
    """Mistral in 6 blocks of 4 tokens: its sequences (up to 29 + 32 tokens) never fit whole, only their
    windows do; Qwen2's full layer needs every block, so it gets a cache that holds them. In 64
    blocks a prompt run again meets its blocks in the prefix cache (with a window on every layer,
    those before its first query's window are not taken)."""
    hf_model, path = saved(family)
    prompts = [tokens(n, seed=n) for n in (5, 29, 29)]  # the last again: through the prefix cache
    cls, cfg = (TurbomindEngine, TurbomindEngineConfig) if engine == 'turbomind' else (PytorchEngine,
                                                                                       PytorchEngineConfig)
    config = cfg(dtype='float32', cache_block_seq_len=4, num_cache_blocks=num_cache_blocks, max_prefill_token_num=8,
                 session_len=128, enable_prefix_caching=True, max_batch_size=1)
    with cls(path, config) as e:
        for p in prompts:  # one at a time: six blocks hold one window, not two
            got, _ = generate(e, [p], SamplingParams(max_new_tokens=32))
            assert got == [hf_greedy(hf_model, p, 32)]
            (assert_all_blocks_back if engine == 'turbomind' else assert_no_leak)(e)  # every block given back
        assert (e.stats().num_prefix_hit_tokens > 0) == (num_cache_blocks == 64)
