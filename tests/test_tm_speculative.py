"""TurboMind's speculative decoding (n-gram prompt lookup): the output is the output without it
(greedy token for token, logprobs too; seeded sampling draw for draw), sampled tokens keep the
model's distribution (HF float32 as the reference), and the KV blocks add up after every step,
rollbacks included (the engine checks its own accounting after each step: ``set_check_blocks``)."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from lmd.engine import EngineRequest, SamplingParams
from lmd.messages import SpeculativeConfig, TurbomindEngineConfig
from lmd.turbomind import _turbomind
from lmd.turbomind.engine import TurbomindEngine
from test_pytorch_engine import TINY, Collector, generate
from tiny_models import tiny_hf_model

ep = _turbomind.engine_parts
# the fixed length: these tests count drafts, and the adaptive length (test_adaptive_*) follows the step times
SPEC = SpeculativeConfig(num_speculative_tokens=4, adaptive_draft_length=False)
RUN = 487  # the tiny model's most self-repeating token (p(487 | 487 x 8) = 0.44): drafts of it are often right


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(HF model, dir): a tiny random Llama whose lm_head is scaled up, so that sampling at temperature 1
    is peaked enough for drafts to be accepted, and rejected, often."""
    model, _ = tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', **TINY, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    path = str(tmp_path_factory.mktemp('tiny_spec'))
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def tm(path, spec=SPEC, **cfg) -> TurbomindEngine:
    cfg.setdefault('cache_block_seq_len', 8)
    cfg.setdefault('num_cache_blocks', 256)
    cfg.setdefault('max_prefill_token_num', 48)
    engine = TurbomindEngine(path, TurbomindEngineConfig(speculative_config=spec, **cfg))
    engine.cpp.set_check_blocks(True)
    return engine


def finish_checks(engine):
    """The blocks added up after every step, and every block is back."""
    assert engine.cpp.blocks_error is None
    st = engine.stats()
    assert st.num_running == 0 and st.num_waiting == 0, st
    assert st.num_free_blocks + st.num_cached_blocks == st.num_total_blocks, st
    return st


def run_both(path, prompts, sampling, spec=SPEC, **cfg):
    """(outputs without speculation, outputs with ``spec``, the speculating engine's stats); outputs are
    (token lists, finish reasons, logprobs, prompt logprobs per request)."""
    runs = []
    for spec in (None, spec):
        with tm(path, spec, **cfg) as engine:
            col = Collector()
            for i, p in enumerate(prompts):
                engine.add_request(EngineRequest(i, tuple(p), sampling[i]), col.callback)
            col.wait(range(len(prompts)))
            lps = [[lp for o in col.outputs[i] for lp in (o.logprobs or ())] for i in range(len(prompts))]
            prompt_lps = [[o.prompt_logprobs for o in col.outputs[i] if o.prompt_logprobs] for i in range(len(prompts))]
            runs.append(([col.tokens(i) for i in range(len(prompts))],
                         [col.final(i).finish_reason for i in range(len(prompts))], lps, prompt_lps))
            st = finish_checks(engine)
    return runs[0], runs[1], st


def test_mixed_batch_equals_output_without_speculation(tiny):
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
    # a small token budget cuts drafts; session_len 112 stops the last request after 12 tokens
    base, spec, st = run_both(tiny[1], prompts, sampling, max_prefill_token_num=24, session_len=112)
    assert spec[0] == base[0]  # tokens
    assert spec[1] == base[1]  # finish reasons
    assert spec[2] == base[2]  # logprobs, exactly
    assert spec[3] == base[3] and len(base[3][8]) == 1  # prompt logprobs, once
    assert base[1][6] == 'stop' and base[1][7] == 'length' and len(base[0][7]) == 12
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens and st.spec_num_drafts > 0


def test_adaptive_draft_length_equals_output_without_speculation(tiny):
    """The default adaptive length (cpu/draft_length.h) drafts what its timing fit says pays, whatever
    that is on this machine: outputs stay the ones without speculation, the blocks add up after every
    step, and no draft is longer than num_speculative_tokens."""
    rng = random.Random(11)
    phrase = [rng.randrange(512) for _ in range(6)]
    prompts = [phrase * 4, [RUN] * 16, phrase * 2 + [rng.randrange(512) for _ in range(12)], [RUN] * 9]
    sampling = [SamplingParams(max_new_tokens=48), SamplingParams(max_new_tokens=48, logprobs=2),
                SamplingParams(max_new_tokens=48, greedy=False, top_p=0.9, random_seed=7),
                SamplingParams(max_new_tokens=48, repetition_penalty=1.2)]
    base, spec, st = run_both(tiny[1], prompts, sampling, spec=SpeculativeConfig(num_speculative_tokens=4))
    assert spec == base
    assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens <= 4 * st.spec_num_drafts


def test_sliding_window_model_with_drafts(tmp_path):
    """A Mistral whose every layer has a 16-token window: blocks wholly before it are given back as
    the sequence grows, drafts' rollbacks included; the output is the one without speculation."""
    model, _ = tiny_hf_model('MistralConfig', 'MistralForCausalLM', **TINY, sliding_window=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    rng = random.Random(3)
    phrase = [rng.randrange(512) for _ in range(7)]
    prompts = [phrase * 5, [RUN] * 20, phrase * 2 + [rng.randrange(512) for _ in range(20)]]
    base, spec, st = run_both(str(tmp_path), prompts, [SamplingParams(max_new_tokens=40)] * 3,
                              max_prefill_token_num=16)
    assert spec[0] == base[0] and st.spec_num_accepted_tokens > 0


def test_preemption_and_prefix_cache_with_drafts(tiny):
    """A cache too small for the batch preempts (drafts are cut first); prefix caching on: a later
    request sharing a prefix that includes speculated tokens gets the cold engine's output."""
    rng = random.Random(1)
    phrase = [rng.randrange(512) for _ in range(6)]
    prompts = [phrase * 4 + [RUN] * 4, [RUN] * 30, phrase * 6, phrase * 2 + [rng.randrange(512) for _ in range(9)]]
    sp = SamplingParams(max_new_tokens=48)
    base, spec, st = run_both(tiny[1], prompts, [sp] * 4, num_cache_blocks=16, enable_prefix_caching=True)
    assert spec[0] == base[0] and st.num_preemptions > 0 and st.spec_num_accepted_tokens > 0

    follow_up = prompts[0] + base[0][0] + phrase  # the first answer (speculated) is now a cached prefix
    with tm(tiny[1], None) as cold:
        (want,), _ = generate(cold, [follow_up], sp)
    with tm(tiny[1], enable_prefix_caching=True) as engine:
        generate(engine, [prompts[0]], sp)
        (got,), (final,) = generate(engine, [follow_up], sp, first_sid=1)
        finish_checks(engine)
    assert got == want
    assert final.num_cached_tokens >= (len(prompts[0]) + len(base[0][0])) // 8 * 8 - 8


def test_kept_session_ending_mid_draft_keeps_what_it_computed(tiny):
    """An interactive turn that stops inside a drafted step commits its accepted drafts and gives back
    the rest's blocks (the per-step check); its next turn continues as without speculation."""
    rng = random.Random(2)
    phrase = [rng.randrange(512) for _ in range(5)]
    turn1, turn2 = phrase * 4, [rng.randrange(512) for _ in range(7)] + phrase
    sp = SamplingParams(max_new_tokens=48)
    with tm(tiny[1], None) as engine:
        (full,), _ = generate(engine, [turn1], sp)
    stop = next(t for i, t in enumerate(full) if i >= 10 and t not in full[:i])  # ends the turn after 10+ tokens
    sp1 = SamplingParams(max_new_tokens=48, stop_token_ids=(stop,))
    results = []
    for spec in (None, SPEC):
        with tm(tiny[1], spec) as engine:
            col = Collector()
            engine.add_request(EngineRequest(7, tuple(turn1), sp1, sequence_end=False), col.callback)
            col.wait([7])
            col2 = Collector()
            engine.add_request(EngineRequest(7, tuple(turn2), sp, sequence_start=False), col2.callback)
            col2.wait([7])
            results.append((col.tokens(7), col.final(7).finish_reason, col2.tokens(7), col2.final(7).num_cached_tokens))
            accepted = engine.stats().spec_num_accepted_tokens
            engine.end(7)
            engine.close()
            finish_checks(engine)
    assert results[1] == results[0] and results[0][1] == 'stop'
    assert results[0][0] == full[:full.index(stop)]
    assert accepted > 0


def exact_paths(model, prompt: list[int], n: int, min_prob: float) -> dict[tuple[int, ...], float]:
    """Every continuation of n tokens whose probability (HF float32, temperature 1) is >= min_prob."""
    paths = {(): 1.0}
    for _ in range(n):
        prefixes = list(paths)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        probs = torch.softmax(logits.double(), -1)
        paths = {p + (t,): float(paths[p] * probs[i, t]) for i, p in enumerate(prefixes)
                 for t in torch.nonzero(paths[p] * probs[i] >= min_prob).flatten().tolist()}
    return paths


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile z (3.09: p = 0.001), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_keep_the_models_distribution(tiny):
    """3000 seeded samples of 4 tokens at temperature 1 after a run of RUN: the first comes from the
    prefill, the next three from drafted steps (RUN drafted, accepted or rejected). Their joint
    distribution against HF's (chi-square, bins of expected count >= 5, p = 0.001); and each seed
    draws exactly what it draws without speculation."""
    model, path = tiny
    n, prompt = 3000, [RUN] * 12
    sampling = [SamplingParams(max_new_tokens=4, greedy=False, temperature=1.0, random_seed=s) for s in range(n)]
    samples = {}
    for spec in (None, SPEC):
        with tm(path, spec, num_cache_blocks=1024, max_prefill_token_num=256) as engine:
            toks, _ = generate(engine, [prompt] * n, sampling)
            st = finish_checks(engine)
        samples[spec is not None] = [tuple(t) for t in toks]
    assert samples[True] == samples[False]
    assert st.spec_num_drafts > n / 4 and 0.1 < st.spec_num_accepted_tokens / st.spec_num_draft_tokens < 0.9

    paths = exact_paths(model, prompt, 4, 5 / n)
    counts = Counter(samples[True])
    observed = [counts[p] for p in paths] + [n - sum(counts[p] for p in paths)]
    expected = [q * n for q in paths.values()] + [n * (1 - sum(paths.values()))]
    assert expected[-1] >= 5 and len(paths) >= 10
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert stat < chi2_critical(len(paths)), (stat, len(paths))


def check_hashes(seq, block_size):
    """A sequence's prefix-cache keys are the hash chain of its own tokens (never a draft's)."""
    parent, want = ep.ROOT_KEY, []
    for i in range(len(seq.block_hashes)):
        parent = ep.block_key(parent, seq.token_ids[i * block_size:(i + 1) * block_size])
        want.append(parent)
    assert list(seq.block_hashes) == want


@pytest.mark.parametrize('seed', range(4))
def test_scheduler_rollbacks_keep_the_block_accounting(seed):
    """The scheduler with random drafts, budgets too small for them, too few blocks, random acceptance,
    kept sessions and prefix caching: after every step each sequence holds exactly the blocks its
    computed tokens need, the block manager's invariants hold, and its keys cover its own tokens."""
    rng = random.Random(seed)
    bs = 4
    bm = ep.BlockManager(num_blocks=20, block_size=bs, enable_prefix_caching=True)
    sch = ep.Scheduler(bm, max_batch_size=4, max_num_batched_tokens=rng.choice([6, 12, 32]))
    shared = [rng.randrange(50) for _ in range(9)]
    limits, seqs = {}, []
    for sid in range(8):
        seq = ep.Sequence(sid, shared[:rng.randrange(10)] + [rng.randrange(50) for _ in range(rng.randrange(1, 14))])
        limits[sid] = rng.randrange(3, 30)
        sch.add(seq)
        seqs.append(seq)
    drafted = accepted = 0
    for _ in range(400):
        if not sch.has_work:
            break
        for seq in sch.running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                seq.draft_token_ids = [rng.randrange(50) for _ in range(rng.randrange(6))]
        out = sch.schedule()
        for seq, _why in out.failed:
            sch.finish(seq)
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            assert n == seq.num_tokens - seq.num_computed_tokens + len(seq.draft_token_ids) or not seq.draft_token_ids
        sch.update(out)
        for seq in out.seqs:
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk
            draft = list(seq.draft_token_ids)
            a = rng.randrange(len(draft) + 1)
            for t in draft[:a] + [rng.randrange(50)]:  # the accepted drafts, then the bonus token
                seq.append_token(t)
            drafted, accepted = drafted + len(draft), accepted + a
            if draft:
                sch.accept_draft(seq, a)
            if seq.num_generated_tokens >= limits[seq.session_id]:
                sch.finish(seq, keep=rng.random() < 0.3)
        sch.check_invariants()
        for seq in seqs:
            check_hashes(seq, bs)
    assert not sch.has_work and drafted > accepted > 0


def test_a_draft_is_cut_rather_than_evict_or_preempt():
    """No free block left, one cached: a draft keeps only the slots its sequence's blocks hold already."""
    bm = ep.BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    sch = ep.Scheduler(bm, max_batch_size=4, max_num_batched_tokens=64)
    a, b, c = ep.Sequence(0, [1, 2, 3, 4, 5, 6]), ep.Sequence(1, [7, 8, 9]), ep.Sequence(2, [10, 11, 12, 13])
    for seq in (a, b, c):
        sch.add(seq)
    sch.update(sch.schedule())
    sch.finish(c)  # its full block stays cached
    assert (bm.num_free_blocks, bm.num_cached_blocks) == (0, 1)
    a.append_token(20)
    b.append_token(21)
    a.draft_token_ids, b.draft_token_ids = [30, 31, 32], [33]
    out = sch.schedule()
    assert out.preempted == [] and list(out.num_scheduled_tokens) == [2, 1]
    assert a.draft_token_ids == [30] and b.draft_token_ids == [] and bm.num_cached_blocks == 1
    sch.update(out)
    a.append_token(30)
    a.append_token(40)
    sch.accept_draft(a, 1)
    sch.check_invariants()


# ---- SmolLM2: an input-grounded prompt ---------------------------------------------------------------

TEXT = ('The lighthouse stood at the end of the rocky point, its white tower streaked with salt. Every evening the '
        'keeper climbed the spiral stairs, trimmed the wick, and lit the great lamp, so that ships passing in the '
        'dark would know where the rocks lay.')


def test_smollm2_rewrite_equals_output_without_speculation():
    """A rewrite-this-text prompt on SmolLM2 through the pipeline, four ways in one batch (greedy, with
    logprobs, seeded sampling, a JSON schema): the same tokens and logprobs with speculation, most drafts
    accepted."""
    from lmd import GenerationConfig, pipeline
    messages = [{'role': 'user', 'content': 'Repeat the following text exactly, word for word:\n\n' + TEXT}]
    schema = {'type': 'object', 'properties': {'text': {'type': 'string'}}, 'required': ['text']}
    gens = [GenerationConfig(max_new_tokens=40),
            GenerationConfig(max_new_tokens=40, logprobs=2),
            GenerationConfig(max_new_tokens=40, do_sample=True, temperature=0.7, top_p=0.9, random_seed=7),
            GenerationConfig(max_new_tokens=40, response_format={'type': 'json_schema',
                                                                 'json_schema': {'name': 't', 'schema': schema}})]
    results = []
    for spec in (None, SPEC):
        pipe = pipeline('smollm2', backend_config=TurbomindEngineConfig(
            session_len=512, cache_block_seq_len=16, num_cache_blocks=64, speculative_config=spec))
        try:
            pipe.async_engine.engine.cpp.set_check_blocks(True)
            results.append([(r.text, r.token_ids, r.logprobs) for r in pipe([messages] * 4, gen_config=gens)])
            st = finish_checks(pipe.async_engine.engine)
        finally:
            pipe.close()
    assert results[1] == results[0]
    assert results[0][0][0].startswith(TEXT[:60]) and results[0][3][0].startswith('{"text": "' + TEXT[:40])
    assert st.spec_num_accepted_tokens > st.spec_num_draft_tokens / 2
