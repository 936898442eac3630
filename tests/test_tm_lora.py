"""Multi-LoRA in TurboMind (the C++ engine) against HF + PEFT: random PEFT adapters of several ranks,
targets and scalings (tests/lora_utils.py) on tiny random models of three families, several adapters
in one batch; the prefix cache keyed by adapter (C++ block manager against its Python twin too);
loading and unloading while serving; bfloat16 against float32."""
from __future__ import annotations

import pytest
import torch

from lmd.engine import EngineRequest, SamplingParams
from lmd.lora import load_lora_adapter
from lmd.messages import SpeculativeConfig, TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.pytorch_backend.block_manager import BlockManager as PyBlockManager
from lmd.pytorch_backend.sequence import Sequence as PySequence
from lmd.turbomind import _turbomind
from lmd.turbomind.engine import TurbomindEngine
from lora_utils import make_adapter, make_adapters, peft_greedy, peft_logits, peft_model
from test_pytorch_engine import Collector
from tiny_models import tiny_hf_model

ep = _turbomind.engine_parts
FAMILIES = {
    'llama': ('LlamaConfig', 'LlamaForCausalLM', {}),
    'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM', {}),  # q/k/v biases; q/k/v adapters fused as parts
    'phi3': ('Phi3Config', 'Phi3ForCausalLM', {'pad_token_id': 0}),  # its checkpoint fuses qkv_proj, gate_up_proj
}
PHI3_ADAPTERS = {'fused': dict(r=8, lora_alpha=16, target_modules=['qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj'])}
PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 120, 33]


def _make(family: str, **kw):
    config_class, model_class, extra = FAMILIES[family]
    size = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    return tiny_hf_model(config_class, model_class, **{**size, **extra, **kw})[0]


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """family -> (HF model, its folder, {adapter name: folder})."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = _make(family)
            out = str(tmp_path_factory.mktemp(f'tm-lora-{family}'))
            model.save_pretrained(f'{out}/base', safe_serialization=True)
            if family == 'phi3':
                adapters = {n: make_adapter(model, f'{out}/{n}', seed=7, **kw) for n, kw in PHI3_ADAPTERS.items()}
            else:
                adapters = make_adapters(model, out)
            cache[family] = (model, f'{out}/base', adapters)
        return cache[family]
    return get


def engine_with(model_dir: str, adapters: dict[str, str], **kw) -> TurbomindEngine:
    kw.setdefault('num_cache_blocks', 64)
    kw.setdefault('cache_block_seq_len', 8)
    kw.setdefault('dtype', 'float32')
    engine = TurbomindEngine(model_dir, TurbomindEngineConfig(**kw))
    mc = ModelConfig.from_dir(model_dir)
    for name, path in adapters.items():
        engine.load_adapter(load_lora_adapter(path, mc, name))
    return engine


def assert_all_blocks_back(engine):
    st = engine.stats()
    assert st.num_running == 0 and st.num_waiting == 0, st
    assert st.num_free_blocks + st.num_cached_blocks == st.num_total_blocks, st


def run_one(engine, sid, prompt, adapter, n=2, **kw):
    col = Collector()
    engine.add_request(EngineRequest(sid, tuple(prompt), SamplingParams(max_new_tokens=n), adapter=adapter, **kw),
                       col.callback)
    col.wait([sid], 120)
    return col


@pytest.mark.parametrize('family', list(FAMILIES))
def test_logits_equal_peft(tiny, family):
    """(a) get_logits with each adapter, and without, equals HF + PEFT in float32; so do the hidden states."""
    model, base, adapters = tiny(family)
    with engine_with(base, adapters) as engine:
        assert engine.adapter_names() == list(adapters)
        base_logits = engine.get_logits(PROMPT)
        for name in [None, *adapters]:
            got = engine.get_logits(PROMPT, adapter=name)
            want = peft_logits(model, adapters.get(name), PROMPT)
            assert (got - want).abs().max().item() < 1e-3, name
            if name is not None:  # the adapter matters: the check above could not pass by ignoring it
                assert (got - base_logits).abs().max().item() > 0.1, name
        name = next(iter(adapters))
        with torch.no_grad():
            out = peft_model(model, adapters[name])(torch.tensor([PROMPT]), output_hidden_states=True)
        hidden = engine.get_hidden_states(PROMPT, adapter=name)
        assert (hidden - out.hidden_states[-1][0]).abs().max().item() < 1e-3


@pytest.mark.parametrize('speculative', [False, True])
def test_several_adapters_in_one_batch_decode_as_peft(tiny, speculative):
    """(b) Ten requests, two per adapter and two on the base model, in one running batch (chunked
    prefill and decode rows of different adapters in the same steps): each equals HF + PEFT's greedy
    tokens for its own adapter; with n-gram drafts too (their rows run the sequence's adapter)."""
    model, base, adapters = tiny('llama')
    names = [None, *adapters] * 2
    prompts = [PROMPT[i % 5:] + [i + 20] + PROMPT[:3] for i in range(len(names))]
    spec = None
    if speculative:
        spec = SpeculativeConfig(method='ngram', num_speculative_tokens=3, prompt_lookup_min=1,
                                 adaptive_draft_length=False)
    with engine_with(base, adapters, max_prefill_token_num=24, speculative_config=spec) as engine:
        col = Collector()
        for sid, (name, p) in enumerate(zip(names, prompts)):
            engine.add_request(EngineRequest(sid, tuple(p), SamplingParams(max_new_tokens=12), adapter=name),
                               col.callback)
        col.wait(list(range(len(names))), 300)
        for sid, (name, p) in enumerate(zip(names, prompts)):
            assert col.tokens(sid) == peft_greedy(model, adapters.get(name), p, 12), (sid, name)
        if speculative:
            assert engine.stats().spec_num_draft_tokens > 0
        assert_all_blocks_back(engine)


def test_qwen2_batch_decodes_as_peft(tiny):
    """(b) on a family with q/k/v biases: adapters of q/k/v parts fused beside the bias."""
    model, base, adapters = tiny('qwen2')
    names = [None, 'attn', 'all-rs', 'patterns']
    with engine_with(base, adapters, max_prefill_token_num=16) as engine:
        col = Collector()
        for sid, name in enumerate(names):
            engine.add_request(EngineRequest(sid, tuple(PROMPT[sid:]), SamplingParams(max_new_tokens=8), adapter=name),
                               col.callback)
        col.wait(list(range(len(names))), 300)
        for sid, name in enumerate(names):
            assert col.tokens(sid) == peft_greedy(model, adapters.get(name), PROMPT[sid:], 8), (sid, name)


def test_prefix_cache_is_keyed_by_adapter(tiny):
    """(c) The same prompt under another adapter, or none, finds no blocks; under the same one it hits."""
    model, base, adapters = tiny('llama')
    prompt = list(range(10, 40))
    with engine_with(base, {'attn': adapters['attn'], 'mlp': adapters['mlp']}, enable_prefix_caching=True) as engine:
        def cached(sid, adapter):
            return run_one(engine, sid, prompt, adapter).final(sid).num_cached_tokens
        assert cached(0, 'attn') == 0
        assert cached(1, 'mlp') == 0     # the same tokens under another adapter: its own blocks
        assert cached(2, None) == 0      # and the base model's
        assert cached(3, 'attn') == 24   # the same adapter again: three full blocks of 8 hit
        assert cached(4, None) == 24
        # a hit computes what a miss computes
        col = run_one(engine, 5, prompt, 'mlp', n=6)
        assert col.final(5).num_cached_tokens == 24
        assert col.tokens(5) == peft_greedy(model, adapters['mlp'], prompt, 6)
        # a reload under the same name is a new load: blocks of the old weights are not found
        engine.unload_adapter('attn')
        engine.load_adapter(load_lora_adapter(adapters['attn'], ModelConfig.from_dir(base), 'attn'))
        assert cached(6, 'attn') == 0
        assert_all_blocks_back(engine)


def test_cpp_block_manager_salted_chains_match_python():
    """The C++ block manager's salt (a sequence's adapter_uid) decides hits as the Python twin's does."""
    tm, py = ep.BlockManager(16, 4, True), PyBlockManager(16, 4, True)
    tokens = list(range(13))
    for salt in (0, 7, 9):
        t, p = ep.BlockSequence(tokens), PySequence(0, list(tokens), None, None, None)
        t.adapter_uid = p.adapter_uid = salt
        hit_t, hit_p = tm.match_prefix(tokens, salt), py.match_prefix(tokens, salt)
        assert hit_t[1] == hit_p[1] == 0
        assert tm.allocate(t, 13) and py.allocate(p, 13)
        t.num_computed_tokens = p.num_computed_tokens = 13
        tm.cache_full_blocks(t)
        py.cache_full_blocks(p)
        tm.free(t)
        py.free(p)
    for salt in (0, 7, 9, 8):
        assert tm.match_prefix(tokens, salt)[1] == py.match_prefix(tokens, salt)[1] == (0 if salt == 8 else 12)
    assert ep.root_key(0) == ep.ROOT_KEY and len({ep.root_key(s) for s in (0, 1, 2, 3)}) == 4
    tm.check_invariants()


def test_load_unload_while_serving(tiny, tmp_path):
    """(d) An unknown name is a ValueError naming it; a kept session holds its adapter; unload then
    reload under the same name serves the new weights; an adapter of other shapes is refused."""
    model, base, adapters = tiny('llama')
    mc = ModelConfig.from_dir(base)
    with engine_with(base, {'attn': adapters['attn']}) as engine:
        with pytest.raises(ValueError, match="adapter 'nope' is not loaded"):
            engine.add_request(EngineRequest(0, (1, 2, 3), adapter='nope'), lambda out: None)
        with pytest.raises(ValueError, match="'nope'"):
            engine.get_logits(PROMPT, adapter='nope')
        with pytest.raises(ValueError, match='already loaded'):
            engine.load_adapter(load_lora_adapter(adapters['mlp'], mc, 'attn'))
        col = run_one(engine, 1, PROMPT, 'attn', n=3, sequence_end=False)
        assert col.final(1).finish_reason == 'length'
        with pytest.raises(ValueError, match='in use'):
            engine.unload_adapter('attn')
        with pytest.raises(ValueError, match='cannot switch'):
            engine.add_request(EngineRequest(1, (4, 5), sequence_start=False, adapter=None), lambda out: None)
        # the kept session's next turn runs its adapter: as PEFT on the whole context
        first = col.tokens(1)
        col2 = run_one(engine, 1, [4, 5], 'attn', n=3, sequence_start=False, sequence_end=False)
        context = PROMPT + first + [4, 5]
        assert col2.tokens(1) == peft_greedy(model, adapters['attn'], context, 3)
        engine.end(1)
        engine.unload_adapter('attn')
        assert engine.adapter_names() == []
        with pytest.raises(ValueError, match='not loaded'):
            engine.get_logits(PROMPT, adapter='attn')
        # reloaded under the same name with other weights: served with them
        engine.load_adapter(load_lora_adapter(adapters['mlp'], mc, 'attn'))
        got = engine.get_logits(PROMPT, adapter='attn')
        assert (got - peft_logits(model, adapters['mlp'], PROMPT)).abs().max() < 1e-3
        assert run_one(engine, 2, PROMPT, 'attn', n=5).tokens(2) == peft_greedy(model, adapters['mlp'], PROMPT, 5)
        # an adapter of a model of other shapes (read as if for this one) does not fit
        wider = _make('llama', intermediate_size=128)
        other = make_adapter(wider, str(tmp_path / 'wider'), seed=5, r=4, target_modules=['down_proj'])
        with pytest.raises(ValueError, match='does not fit'):
            engine.load_adapter(load_lora_adapter(other, ModelConfig.from_dir(_saved(wider, tmp_path / 'w')), 'w'))
        assert engine.adapter_names() == ['attn']
        assert_all_blocks_back(engine)


def _saved(model, path) -> str:
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def test_bfloat16_follows_float32(tiny):
    """(e) bfloat16 weights and adapters agree with float32 loosely (a sanity bound)."""
    _, base, adapters = tiny('llama')
    with engine_with(base, adapters) as f32, engine_with(base, adapters, dtype='bfloat16') as bf16:
        for name in adapters:
            a, b = f32.get_logits(PROMPT, adapter=name), bf16.get_logits(PROMPT, adapter=name)
            assert (a - b).abs().max().item() < 0.1 * (a.max() - a.min()).item(), name
        col = run_one(bf16, 0, PROMPT, 'all-rs', n=4)
        assert len(col.tokens(0)) == 4
