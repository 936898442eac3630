"""TurboMind's speculative decoding with a draft model (``SpeculativeConfig(method='draft_target')``;
turbomind/csrc/engine/draft.h): the output is the output without speculation (greedy token for token,
logprobs too; seeded sampling draw for draw), a model drafting for itself has every greedy draft
accepted (its shadows' K/V and the target's have the same bits, so any slip in catching a shadow up
shows), and both caches' blocks add up after every step (``set_check_blocks`` checks the draft
model's cache too) and are all free at the end."""
from __future__ import annotations

import copy
import random

import pytest
import transformers

from lmd.engine import EngineRequest, SamplingParams
from lmd.messages import SpeculativeConfig, TurbomindEngineConfig
from lmd.turbomind.engine import TurbomindEngine
from test_pytorch_engine import TINY, Collector
from test_tm_speculative import RUN, finish_checks, tiny  # noqa: F401 (tiny: the fixture)
from tiny_models import tiny_hf_model


def draft(path: str, k: int = 4, adaptive: bool = False) -> SpeculativeConfig:  # fixed: the tests count drafts
    return SpeculativeConfig(method='draft_target', model=path, num_speculative_tokens=k,
                             adaptive_draft_length=adaptive)


@pytest.fixture(scope='module')
def shallow(tiny, tmp_path_factory):  # noqa: F811
    """A draft for ``tiny`` that agrees with it often but not always: its first layer of two, with the
    same embedding, final norm and head."""
    model, _ = tiny
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 1
    half = transformers.LlamaForCausalLM(cfg).eval()
    missing, _ = half.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    path = str(tmp_path_factory.mktemp('tiny_draft'))
    half.save_pretrained(path, safe_serialization=True)
    return path


def tm(path, spec, **cfg) -> TurbomindEngine:
    cfg.setdefault('cache_block_seq_len', 8)
    cfg.setdefault('num_cache_blocks', 256)
    cfg.setdefault('max_prefill_token_num', 48)
    engine = TurbomindEngine(path, TurbomindEngineConfig(speculative_config=spec, **cfg))
    engine.cpp.set_check_blocks(True)
    return engine


def all_checks(engine):
    """finish_checks, and the draft model's cache: every shadow gone, every block free."""
    st = finish_checks(engine)
    ds = engine.cpp.draft_stats()
    assert ds['num_shadows'] == 0 and ds['num_free_blocks'] == ds['num_total_blocks'], ds
    return st, ds


def run(path, spec, prompts, sampling, **cfg):
    """(tokens, finish reasons, logprobs, prompt logprobs) per request, the stats and the draft stats."""
    with tm(path, spec, **cfg) as engine:
        col = Collector()
        for i, p in enumerate(prompts):
            sp = sampling[i] if isinstance(sampling, list) else sampling
            engine.add_request(EngineRequest(i, tuple(p), sp), col.callback)
        col.wait(range(len(prompts)))
        ids = range(len(prompts))
        result = ([col.tokens(i) for i in ids], [col.final(i).finish_reason for i in ids],
                  [[lp for o in col.outputs[i] for lp in (o.logprobs or ())] for i in ids],
                  [[o.prompt_logprobs for o in col.outputs[i] if o.prompt_logprobs] for i in ids])
        st, ds = all_checks(engine)
    return result, st, ds


def test_shallow_draft_mixed_batch_equals_output_without_speculation(tiny, shallow):  # noqa: F811
    rng = random.Random(0)
    phrase = [rng.randrange(512) for _ in range(10)]
    prompts = [[RUN] * 10, phrase * 3, phrase * 2 + [RUN] * 6, [rng.randrange(512) for _ in range(40)],
               phrase * 4, [RUN] * 5, phrase * 3 + [RUN] * 3, [RUN] * 100, phrase * 2]
    sampling = [
        SamplingParams(max_new_tokens=40),                                        # plain greedy
        SamplingParams(max_new_tokens=40, logprobs=3),                            # greedy with logprobs
        SamplingParams(max_new_tokens=40, greedy=False, top_p=0.9, random_seed=5),  # seeded sampling
        SamplingParams(max_new_tokens=40, repetition_penalty=1.3, frequency_penalty=0.2),  # penalties
        SamplingParams(max_new_tokens=40, greedy=False, temperature=0.7, top_k=20, random_seed=9, logprobs=1),
        SamplingParams(max_new_tokens=2),                                         # never drafts (k <= 0)
        SamplingParams(max_new_tokens=40, min_new_tokens=10, stop_token_ids=(216,)),  # a stop held back, then hit
        SamplingParams(max_new_tokens=40),                                        # runs into session_len
        SamplingParams(max_new_tokens=20, prompt_logprobs=2),                     # prompt logprobs first
    ]
    cfg = dict(max_prefill_token_num=24, session_len=112)
    base, _, _ = run(tiny[1], None, prompts, sampling, **cfg)
    spec, st, ds = run(tiny[1], draft(shallow), prompts, sampling, **cfg)
    assert spec == base  # tokens, finish reasons, logprobs, prompt logprobs
    assert base[1][6] == 'stop' and base[1][7] == 'length' and len(base[0][7]) == 12
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens and st.spec_num_drafts > 0
    assert ds['num_total_blocks'] == 256 and ds['num_skipped'] == 0


@pytest.mark.parametrize('budget, prefix_caching', [(64, False), (8, True)])
def test_self_draft_accepts_every_greedy_draft(tiny, budget, prefix_caching):  # noqa: F811
    """The model drafting for itself: every draft is accepted. A budget of 8 tokens a pass cuts the
    shadows' catch-up of 30-70 token contexts into several passes; with prefix caching the target
    serves later prompts from earlier ones' blocks while the draft computes them in full."""
    rng = random.Random(1)
    shared = [rng.randrange(512) for _ in range(24)]
    prompts = [shared + [rng.randrange(512) for _ in range(rng.randrange(6, 40))] for _ in range(6)]
    sp = SamplingParams(max_new_tokens=30)
    cfg = dict(max_prefill_token_num=budget, enable_prefix_caching=prefix_caching)
    base, _, _ = run(tiny[1], None, prompts, sp, **cfg)
    spec, st, _ = run(tiny[1], draft(tiny[1], k=5), prompts, sp, **cfg)  # drafts of 5 each step
    assert spec[0] == base[0]
    assert st.spec_num_draft_tokens > 0 and st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    if budget >= 6 * len(prompts):  # every drafted step whole: the first token from the prefill, then 1 + 5 a step
        assert st.spec_num_drafts == len(prompts) * -(-29 // 6)


def test_seeded_sampling_draws_what_it_draws_without_speculation(tiny, shallow):  # noqa: F811
    prompts = [[RUN] * 12] * 24
    sampling = [SamplingParams(max_new_tokens=12, greedy=False, temperature=1.0, random_seed=s) for s in range(24)]
    base, _, _ = run(tiny[1], None, prompts, sampling)
    spec, st, _ = run(tiny[1], draft(shallow), prompts, sampling)
    assert spec[0] == base[0] and st.spec_num_accepted_tokens > 0


def test_small_cache_preempts_and_skips_drafts(tiny, shallow):  # noqa: F811
    """16 blocks for four requests (the draft's cache as many): the target preempts, the draft skips
    the drafts it has no free blocks for; neither changes the output, and both caches end free."""
    rng = random.Random(1)
    phrase = [rng.randrange(512) for _ in range(6)]
    prompts = [phrase * 4 + [RUN] * 4, [RUN] * 30, phrase * 6, phrase * 2 + [rng.randrange(512) for _ in range(9)]]
    sp = SamplingParams(max_new_tokens=48)
    cfg = dict(num_cache_blocks=16, enable_prefix_caching=True)
    base, _, _ = run(tiny[1], None, prompts, sp, **cfg)
    spec, st, ds = run(tiny[1], draft(shallow), prompts, sp, **cfg)
    assert spec[0] == base[0]
    assert st.num_preemptions > 0 and ds['num_skipped'] > 0 and st.spec_num_accepted_tokens > 0


def test_kept_session_turns(tiny, shallow):  # noqa: F811
    """An interactive session's second turn continues as without speculation; its shadow goes with the
    turn and is rebuilt for the next."""
    rng = random.Random(2)
    turn1, turn2 = [rng.randrange(512) for _ in range(20)], [rng.randrange(512) for _ in range(7)]
    sp = SamplingParams(max_new_tokens=24)
    results = []
    for spec in (None, draft(shallow)):
        with tm(tiny[1], spec) as engine:
            col = Collector()
            engine.add_request(EngineRequest(7, tuple(turn1), sp, sequence_end=False), col.callback)
            col.wait([7])
            assert engine.cpp.draft_stats()['num_shadows'] == 0
            col2 = Collector()
            engine.add_request(EngineRequest(7, tuple(turn2), sp, sequence_start=False), col2.callback)
            col2.wait([7])
            results.append((col.tokens(7), col2.tokens(7), col2.final(7).num_cached_tokens))
            engine.end(7)
            engine.close()
            all_checks(engine)
    assert results[1] == results[0] and results[0][2] > 0


def test_draft_model_of_another_vocabulary_is_refused(tiny, tmp_path):  # noqa: F811
    other, _ = tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', **{**TINY, 'vocab_size': 256})
    other.save_pretrained(str(tmp_path), safe_serialization=True)
    with pytest.raises(ValueError, match=r"SpeculativeConfig.model=.* vocabulary has 256 tokens, the model's 512"):
        TurbomindEngine(tiny[1], TurbomindEngineConfig(speculative_config=draft(str(tmp_path))))


# ---- SmolLM2: its Q4_1 GGUF drafting for itself, and for the float model --------------------------------

TEXT = ('The lighthouse stood at the end of the rocky point, its white tower streaked with salt. Every evening the '
        'keeper climbed the spiral stairs, trimmed the wick, and lit the great lamp.')


@pytest.mark.parametrize('target_format', ['gguf', 'hf'])
def test_smollm2_gguf_draft_equals_output_without_speculation(target_format):
    """SmolLM2's Q4_1 GGUF drafts for itself (every draft accepted) and for the same model in float32
    (model_format 'hf'): two greedy answers in one batch are those without speculation. (ignore_eos: a
    draft running on past a stop token is not accepted, which would blur "every draft" here.)"""
    from lmd import GenerationConfig, pipeline
    from lmd.model_path import default_model_file
    prompts = [[{'role': 'user', 'content': 'Repeat the following text exactly, word for word:\n\n' + TEXT}],
               [{'role': 'user', 'content': 'What is the capital of France?'}]]
    gen = GenerationConfig(max_new_tokens=32, ignore_eos=True)  # no stop cuts a draft short
    results = []
    for spec in (None, draft(default_model_file())):
        pipe = pipeline('smollm2', backend_config=TurbomindEngineConfig(
            model_format=target_format, session_len=512, cache_block_seq_len=16, num_cache_blocks=64,
            speculative_config=spec))
        try:
            pipe.async_engine.engine.cpp.set_check_blocks(True)
            results.append([r.token_ids for r in pipe(prompts, gen_config=gen)])
            st, _ = all_checks(pipe.async_engine.engine)
        finally:
            pipe.close()
    assert results[1] == results[0]
    assert st.spec_num_draft_tokens > 0
    if target_format == 'gguf':
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    else:
        assert st.spec_num_accepted_tokens > st.spec_num_draft_tokens / 2
