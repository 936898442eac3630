"""Multi-LoRA in the PyTorch engine against HF + PEFT: random PEFT adapters of several ranks, targets
and scalings (tests/lora_utils.py) on tiny random models, several in one batch; the adapter
loader's refusals; prefix caching keyed by adapter; loading and unloading while serving."""
from __future__ import annotations

import json
import os

import pytest
import torch

from lmd.engine import EngineRequest, SamplingParams
from lmd.lora import LoraError, load_lora_adapter, parse_adapters
from lmd.messages import PytorchEngineConfig
from lmd.model_config import ModelConfig
from lmd.pytorch_backend import PytorchEngine
from lora_utils import ADAPTERS, make_adapter, make_adapters, peft_greedy, peft_logits
from test_pytorch_engine import Collector, assert_no_leak, generate
from tiny_models import tiny_hf_model

FAMILIES = {
    'llama': ('LlamaConfig', 'LlamaForCausalLM', {}),
    'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM', {}),  # q/k/v biases
    'phi3': ('Phi3Config', 'Phi3ForCausalLM', {'pad_token_id': 0}),  # its checkpoint fuses qkv_proj, gate_up_proj
}
PHI3_ADAPTERS = {'fused': dict(r=8, lora_alpha=16, target_modules=['qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj'])}


def _make(family: str):
    config_class, model_class, extra = FAMILIES[family]
    return tiny_hf_model(config_class, model_class, vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, **extra)[0]


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """family -> (HF model, its folder, {adapter name: folder})."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = _make(family)
            out = str(tmp_path_factory.mktemp(f'lora-{family}'))
            model.save_pretrained(f'{out}/base', safe_serialization=True)
            if family == 'phi3':
                adapters = {n: make_adapter(model, f'{out}/{n}', seed=7, **kw) for n, kw in PHI3_ADAPTERS.items()}
            else:
                adapters = make_adapters(model, out)
            cache[family] = (model, f'{out}/base', adapters)
        return cache[family]
    return get


def engine_with(model_dir: str, adapters: dict[str, str], **kw) -> PytorchEngine:
    engine = PytorchEngine(model_dir, PytorchEngineConfig(num_cache_blocks=64, cache_block_seq_len=8,
                                                          dtype=kw.pop('dtype', 'float32'), **kw))
    mc = ModelConfig.from_dir(model_dir)
    for name, path in adapters.items():
        engine.load_adapter(load_lora_adapter(path, mc, name))
    return engine


PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 120, 33]


@pytest.mark.parametrize('family', list(FAMILIES))
def test_logits_equal_peft(tiny, family):
    model, base, adapters = tiny(family)
    with engine_with(base, adapters) as engine:
        assert engine.adapter_names() == list(adapters)
        for name in [None, *adapters]:
            got = engine.get_logits(PROMPT, adapter=name)
            want = peft_logits(model, adapters.get(name), PROMPT)
            assert (got - want).abs().max().item() < 1e-3, name
        base_logits = engine.get_logits(PROMPT)
        assert all((engine.get_logits(PROMPT, adapter=n) - base_logits).abs().max() > 0.1 for n in adapters)


def test_several_adapters_in_one_batch_decode_as_peft(tiny):
    """Eight requests, two per adapter and two on the base model, in one running batch (chunked
    prefill and decode steps mixed): each equals HF + PEFT's greedy tokens for its own adapter."""
    model, base, adapters = tiny('llama')
    names = [None, *adapters] * 2
    prompts = [PROMPT[i % 5:] + [i + 20] for i in range(len(names))]
    with engine_with(base, adapters, max_prefill_token_num=24) as engine:
        col = Collector()
        for sid, (name, p) in enumerate(zip(names, prompts)):
            engine.add_request(EngineRequest(sid, tuple(p), SamplingParams(max_new_tokens=12), adapter=name),
                               col.callback)
        col.wait(list(range(len(names))), 300)
        for sid, (name, p) in enumerate(zip(names, prompts)):
            assert col.tokens(sid) == peft_greedy(model, adapters.get(name), p, 12), (sid, name)
        assert_no_leak(engine)


def test_prefix_cache_is_keyed_by_adapter(tiny):
    _, base, adapters = tiny('llama')
    prompt = list(range(10, 40))
    with engine_with(base, {'attn': adapters['attn'], 'mlp': adapters['mlp']}, enable_prefix_caching=True) as engine:
        def run(sid, adapter):
            col = Collector()
            engine.add_request(EngineRequest(sid, tuple(prompt), SamplingParams(max_new_tokens=2), adapter=adapter),
                               col.callback)
            col.wait([sid], 120)
            return col.final(sid).num_cached_tokens
        assert run(0, 'attn') == 0
        assert run(1, 'mlp') == 0      # the same tokens under another adapter: its own blocks
        assert run(2, None) == 0       # and the base model's
        assert run(3, 'attn') == 24    # the same adapter again: three full blocks of 8 hit
        assert run(4, None) == 24
        assert_no_leak(engine)


def test_load_unload_while_serving(tiny):
    model, base, adapters = tiny('llama')
    mc = ModelConfig.from_dir(base)
    with engine_with(base, {'attn': adapters['attn']}) as engine:
        with pytest.raises(ValueError, match="adapter 'nope' is not loaded"):
            engine.add_request(EngineRequest(0, (1, 2, 3), adapter='nope'), lambda out: None)
        with pytest.raises(ValueError, match='already loaded'):
            engine.load_adapter(load_lora_adapter(adapters['mlp'], mc, 'attn'))
        # a kept session holds its adapter: no unload until it is ended
        col = Collector()
        engine.add_request(EngineRequest(1, tuple(PROMPT), SamplingParams(max_new_tokens=3), sequence_end=False,
                                         adapter='attn'), col.callback)
        col.wait([1], 120)
        with pytest.raises(ValueError, match='in use'):
            engine.unload_adapter('attn')
        with pytest.raises(ValueError, match='cannot switch'):
            engine.add_request(EngineRequest(1, (4, 5), sequence_start=False, adapter=None), lambda out: None)
        engine.end(1)
        engine.unload_adapter('attn')
        assert engine.adapter_names() == []
        with pytest.raises(ValueError, match='not loaded'):
            engine.get_logits(PROMPT, adapter='attn')
        # reloaded under the same name with other weights: served with them
        engine.load_adapter(load_lora_adapter(adapters['mlp'], mc, 'attn'))
        got = engine.get_logits(PROMPT, adapter='attn')
        assert (got - peft_logits(model, adapters['mlp'], PROMPT)).abs().max() < 1e-3
        assert_no_leak(engine)


def test_bfloat16_follows_float32(tiny):
    _, base, adapters = tiny('llama')
    with engine_with(base, adapters) as f32, engine_with(base, adapters, dtype='bfloat16') as bf16:
        for name in adapters:
            a, b = f32.get_logits(PROMPT, adapter=name), bf16.get_logits(PROMPT, adapter=name)
            assert (a - b).abs().max().item() < 0.1 * (a.max() - a.min()).item(), name


def test_loader_refusals(tiny, tmp_path):
    model, base, adapters = tiny('llama')
    mc = ModelConfig.from_dir(base)
    with pytest.raises(LoraError, match='no adapter_config.json'):
        load_lora_adapter(str(tmp_path), mc)
    for key, value, match in [('use_dora', True, 'DoRA'), ('bias', 'all', "bias='all'"),
                              ('modules_to_save', ['lm_head'], 'modules_to_save'), ('peft_type', 'IA3', 'IA3')]:
        bad = tmp_path / key
        bad.mkdir()
        cfg = json.load(open(os.path.join(adapters['attn'], 'adapter_config.json')))
        cfg[key] = value
        json.dump(cfg, open(bad / 'adapter_config.json', 'w'))
        with pytest.raises(LoraError, match=match):
            load_lora_adapter(str(bad), mc)
    # embeddings are not a LoRA target lmd serves
    emb = make_adapter(model, str(tmp_path / 'emb'), seed=3, r=4, target_modules=['q_proj', 'embed_tokens'])
    with pytest.raises(LoraError, match='embed_tokens'):
        load_lora_adapter(emb, mc)
    # an adapter of another model's shapes
    other = _make('qwen2')
    other_dir = make_adapter(other, str(tmp_path / 'other'), seed=4, r=4, target_modules=['o_proj'])
    bigger = ModelConfig.from_dict({**json.load(open(os.path.join(base, 'config.json'))), 'hidden_size': 128})
    with pytest.raises(LoraError, match='do not fit'):
        load_lora_adapter(other_dir, bigger)


def test_parse_adapters():
    assert parse_adapters(['a=/x/y', '/p/q/sql-lora']) == {'a': '/x/y', 'sql-lora': '/p/q/sql-lora'}
    with pytest.raises(ValueError, match='twice'):
        parse_adapters(['a=/x', 'a=/y'])
    assert set(ADAPTERS) == {'attn', 'mlp', 'all-rs', 'patterns'}
