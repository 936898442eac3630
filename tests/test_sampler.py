"""The PyTorch backend's sampler: processing order, support restrictions, seeds, HF parity, logprobs."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lmd.engine import SamplingParams
from lmd.pytorch_backend.sampler import Sampler, SamplingState


def sampled(**kw) -> SamplingParams:
    return SamplingParams(greedy=False, **kw)


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    """n independent draws from one row: n seeded rows in one batch (deterministic test)."""
    states = [SamplingState(params_with_seed(params, seed), []) for seed in range(n)]
    out = Sampler().sample(logits_row[None, :].expand(n, -1), states)
    return torch.tensor(out.token_ids)


def params_with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, random_seed=seed)


def empirical(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).float() / ids.numel()


# --- greedy -----------------------------------------------------------------------------------

def test_greedy_is_argmax_and_does_not_touch_logits():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    before = logits.clone()
    out = Sampler().sample(logits, [SamplingState(SamplingParams(), [1, 2]) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16
    assert torch.equal(logits, before)


def test_greedy_ties_pick_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0]])
    assert Sampler().sample(logits, [SamplingState(SamplingParams(), [])]).token_ids == [1]


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    params = [SamplingParams(), sampled(top_k=5, random_seed=1), SamplingParams(),
              sampled(top_p=0.5), SamplingParams(top_k=1, greedy=False), sampled(temperature=0.0)]
    out = Sampler().sample(logits, [SamplingState(p, []) for p in params])
    for i in (0, 2, 4, 5):
        assert out.token_ids[i] == int(logits[i].argmax())


# --- support restrictions (statistical, small vocab) -----------------------------------------

LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def test_top_k_never_leaves_the_top_k():
    ids = draw_many(LOGITS8, sampled(top_k=2))
    assert set(ids.tolist()) == {0, 1}
    freq = empirical(ids, 8)
    expect = torch.softmax(LOGITS8[:2], -1)
    assert torch.allclose(freq[:2], expect, atol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS8, -1)  # ~[.35, .21, .13, .08, .05, ...]
    top_p = 0.6
    # keep token i while the mass of strictly better tokens is below top_p
    keep = (torch.cumsum(probs, 0) - probs) < top_p
    ids = draw_many(LOGITS8, sampled(top_p=top_p))
    assert set(ids.tolist()) == set(keep.nonzero().flatten().tolist())
    freq = empirical(ids, 8)
    expect = torch.where(keep, probs, torch.zeros_like(probs))
    assert torch.allclose(freq, expect / expect.sum(), atol=0.03)


def test_min_p_drops_tokens_below_the_threshold():
    probs = torch.softmax(LOGITS8, -1)
    min_p = 0.2
    keep = probs >= min_p * probs.max()
    ids = draw_many(LOGITS8, sampled(min_p=min_p))
    assert set(ids.tolist()) == set(keep.nonzero().flatten().tolist())


def test_temperature_sharpens_and_flattens():
    for temperature in (0.5, 2.0):
        ids = draw_many(LOGITS8, sampled(temperature=temperature), n=6000)
        expect = torch.softmax(LOGITS8 / temperature, -1)
        assert torch.allclose(empirical(ids, 8), expect, atol=0.03), temperature


def test_plain_sampling_matches_softmax():
    ids = draw_many(LOGITS8, sampled(), n=6000)
    assert torch.allclose(empirical(ids, 8), torch.softmax(LOGITS8, -1), atol=0.03)


def test_bad_ids_are_never_sampled():
    bad = (0, 2, 5)
    ids = draw_many(LOGITS8, sampled(bad_token_ids=bad), n=2000)
    assert not set(ids.tolist()) & set(bad)
    # greedy: the best token is banned, the next best is picked
    out = Sampler().sample(LOGITS8[None], [SamplingState(SamplingParams(bad_token_ids=(0, 99999)), [])])
    assert out.token_ids == [1]


def test_min_new_tokens_blocks_stop_ids_until_reached():
    logits = LOGITS8[None]  # id 0 is the best
    state = SamplingState(SamplingParams(min_new_tokens=3, stop_token_ids=(0, 7)), [4])
    sampler = Sampler()
    got = []
    for _ in range(5):
        t = sampler.sample(logits, [state]).token_ids[0]
        got.append(t)
        state.append(t)
    assert got == [1, 1, 1, 0, 0]
    # sampled rows too: stop ids never drawn before min_new_tokens
    ids = draw_many(LOGITS8, sampled(min_new_tokens=1, stop_token_ids=(0, 1)), n=2000)
    assert not {0, 1} & set(ids.tolist())


# --- seeds ------------------------------------------------------------------------------------

def run_steps(states: list[SamplingState], num_steps: int, vocab: int, row_logits) -> list[list[int]]:
    sampler = Sampler()
    seqs = [[] for _ in states]
    for step in range(num_steps):
        logits = torch.stack([row_logits(s, step) for s in states])
        out = sampler.sample(logits, states)
        for i, (s, t) in enumerate(zip(states, out.token_ids)):
            s.append(t)
            seqs[i].append(t)
    return seqs


def step_logits(tag: int, vocab: int = 1000):
    def fn(state, step):
        g = torch.Generator().manual_seed(1000 * tag + step)
        return torch.randn(vocab, generator=g) * 3
    return fn


@pytest.mark.parametrize('kw', [dict(), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05),
                                dict(top_k=50, top_p=0.8, min_p=0.02, temperature=0.7),
                                dict(repetition_penalty=1.3, frequency_penalty=0.5)])
def test_same_seed_same_tokens_whatever_the_batch(kw):
    target = sampled(random_seed=1234, **kw)

    def row_logits(state, step):
        return step_logits(0 if state.params is target else state.params.top_k + 7)(state, step)

    alone = run_steps([SamplingState(target, [3, 4])], 8, 1000, row_logits)[0]
    others = [sampled(top_k=10), SamplingParams(), sampled(top_p=0.5, random_seed=9), sampled(min_p=0.1),
              sampled(logprobs=3, top_k=30), SamplingParams(repetition_penalty=1.2)]
    for order in range(3):
        batch = [SamplingState(p, [1]) for p in others]
        pos = (2 * order + 1) % (len(batch) + 1)
        batch.insert(pos, SamplingState(target, [3, 4]))
        seqs = run_steps(batch, 8, 1000, row_logits)
        assert seqs[pos] == alone, (order, kw)


def test_different_seeds_differ_and_seeded_state_only_advances_when_it_samples():
    a = run_steps([SamplingState(sampled(random_seed=1), [])], 20, 2000, step_logits(0))[0]
    b = run_steps([SamplingState(sampled(random_seed=2), [])], 20, 2000, step_logits(0))[0]
    assert a != b
    # a state that skips steps (not scheduled, e.g. preempted) continues where it stopped
    sampler = Sampler()
    s = SamplingState(sampled(random_seed=1), [])
    got = []
    for step in range(20):
        if step % 3 == 1:
            sampler.sample(step_logits(5)(None, step)[None], [SamplingState(sampled(), [])])
        t = sampler.sample(step_logits(0)(s, step)[None], [s]).token_ids[0]
        s.append(t)
        got.append(t)
    assert got == a


def test_nucleus_prefixes_give_the_same_tokens_as_a_full_sort():
    torch.manual_seed(9)
    vocab = 6000
    # peaked rows end inside the 256 prefix, middling ones inside 4096, flat ones need the sort
    scales = torch.tensor([8.0, 3.0, 1.0, 0.3, 0.02]).repeat(3)
    logits = torch.randn(scales.numel(), vocab) * scales[:, None]
    cuts = [dict(top_p=0.9), dict(min_p=0.05), dict(top_p=0.5, min_p=0.01)]
    params = [sampled(random_seed=i, temperature=0.9, **cuts[i % 3]) for i in range(scales.numel())]
    prefixed = Sampler()
    sorting = Sampler()
    sorting.NUCLEUS_PREFIXES = ()
    for _ in range(3):
        a = prefixed.sample(logits, [SamplingState(p, []) for p in params]).token_ids
        b = sorting.sample(logits, [SamplingState(p, []) for p in params]).token_ids
        assert a == b
        logits = logits.roll(1, dims=0)
    # and each token is inside the row's HF support
    want = Sampler().warp(logits, [SamplingState(p, []) for p in params])
    got = prefixed.sample(logits, [SamplingState(p, []) for p in params]).token_ids
    assert all(torch.isfinite(want[i, t]) for i, t in enumerate(got))


# --- parity with transformers ----------------------------------------------------------------

def test_repetition_penalty_matches_hf():
    torch.manual_seed(3)
    vocab = 500
    logits = torch.randn(3, vocab) * 4
    prompts = [torch.randint(0, vocab, (30,)).tolist() for _ in range(3)]
    generated = [torch.randint(0, vocab, (10,)).tolist() for _ in range(3)]
    penalties = [1.3, 0.8, 1.0]
    states = []
    for p, g, pen in zip(prompts, generated, penalties):
        s = SamplingState(SamplingParams(repetition_penalty=pen), p)
        for t in g:
            s.append(t)
        states.append(s)
    before = logits.clone()
    got = Sampler().process_logits(logits, states)
    assert torch.equal(logits, before)
    for i in range(3):
        ids = torch.tensor([prompts[i] + generated[i]])
        want = RepetitionPenaltyLogitsProcessor(penalties[i])(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)


def test_ids_outside_the_vocab_never_touch_another_row():
    logits = torch.zeros(2, 10)
    states = [SamplingState(SamplingParams(repetition_penalty=2.0, bad_token_ids=(12,)), [3, 13, -1]),
              SamplingState(SamplingParams(), [])]
    logits[0, 3] = 4.0
    got = Sampler().process_logits(logits, states)
    assert got[0, 3] == 2.0
    assert torch.equal(got[1], logits[1])


def test_presence_and_frequency_penalties_follow_openai():
    torch.manual_seed(4)
    logits = torch.randn(1, 50)
    s = SamplingState(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [7, 7, 8])
    for t in (1, 1, 1, 2):
        s.append(t)
    got = Sampler().process_logits(logits, [s])
    want = logits.clone()
    want[0, 1] -= 3 * 0.25 + 0.5
    want[0, 2] -= 1 * 0.25 + 0.5
    torch.testing.assert_close(got, want)  # prompt ids 7, 8 untouched


@pytest.mark.parametrize('kw', [dict(temperature=0.7), dict(top_k=20), dict(top_p=0.8), dict(min_p=0.1),
                                dict(temperature=1.5, top_k=100, top_p=0.9, min_p=0.05),
                                dict(temperature=0.5, top_p=0.3), dict(top_k=3000)])
def test_warpers_match_hf(kw):
    torch.manual_seed(5)
    vocab = 2000
    logits = torch.randn(8, vocab) * 2.5
    params = sampled(**kw)
    got = Sampler().warp(logits, [SamplingState(params, []) for _ in range(8)])

    hf = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        hf.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        hf.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        hf.append(MinPLogitsWarper(params.min_p))
    want = logits.clone()
    for w in hf:
        want = w(None, want)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(torch.softmax(got, -1), torch.softmax(want, -1))


def test_sampled_tokens_stay_inside_hf_support():
    torch.manual_seed(6)
    vocab = 3000
    logits = torch.randn(vocab) * 2
    params = sampled(temperature=0.8, top_k=60, top_p=0.7, min_p=0.05)
    want = logits[None] / 0.8
    for w in (TopKLogitsWarper(60), TopPLogitsWarper(0.7), MinPLogitsWarper(0.05)):
        want = w(None, want)
    support = set(torch.isfinite(want[0]).nonzero().flatten().tolist())
    ids = draw_many(logits, params, n=1500)
    assert set(ids.tolist()) <= support
    assert len(set(ids.tolist())) > 1


# --- logprobs ---------------------------------------------------------------------------------

def test_logprobs_are_of_raw_logits_with_sorted_alternatives():
    torch.manual_seed(7)
    vocab = 400
    logits = torch.randn(4, vocab) * 3
    params = [sampled(logprobs=5, temperature=0.5, top_k=10, random_seed=3, repetition_penalty=1.5),
              SamplingParams(),
              SamplingParams(logprobs=0, bad_token_ids=tuple(range(0, vocab, 2))),
              sampled(logprobs=20, top_p=0.9, random_seed=4)]
    states = [SamplingState(p, list(range(50))) for p in params]
    out = Sampler().sample(logits, states)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        d = out.logprobs[i]
        chosen = out.token_ids[i]
        items = list(d.items())
        assert items[0][0] == chosen
        assert items[0][1] == pytest.approx(raw[i, chosen].item(), abs=1e-6)
        k = params[i].logprobs
        top_v, top_i = raw[i].topk(k)
        alts = [t for t, _ in items[1:]]
        expect_alts = [t for t in top_i.tolist() if t != chosen]
        assert alts == expect_alts
        assert len(d) == k + (chosen not in top_i.tolist())
        for t, v in d.items():
            assert v == pytest.approx(raw[i, t].item(), abs=1e-6)
        vals = [v for _, v in items[1:]]
        assert vals == sorted(vals, reverse=True)
    assert out.logprobs[2] == {out.token_ids[2]: pytest.approx(raw[2, out.token_ids[2]].item(), abs=1e-6)}


def test_non_float32_logits_are_accepted():
    torch.manual_seed(8)
    logits = torch.randn(3, 100).to(torch.bfloat16)
    out = Sampler().sample(logits, [SamplingState(SamplingParams(), [1]) for _ in range(3)])
    assert out.token_ids == logits.float().argmax(-1).tolist()


# --- structured output: a constraint's bitmask --------------------------------------------------

def bitmask_of(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """int32 [n, ceil(vocab / 32)], xgrammar's layout, built bit by bit in plain Python."""
    words = (vocab + 31) // 32
    rows = []
    for ids in allowed:
        row = []
        for w in range(words):
            v = sum(1 << b for b in range(32) if w * 32 + b in ids)
            row.append(v - (1 << 32) if v >= 1 << 31 else v)  # as a signed int32
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


class FixedConstraint:
    """A constraint allowing a fixed set every step (the engine's contract, without a grammar)."""

    def __init__(self, allowed: set[int], vocab: int):
        self.allowed, self.vocab_size = allowed, vocab
        self.num_words = (vocab + 31) // 32
        self.stop_token_ids = frozenset()
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = bitmask_of([self.allowed], self.vocab_size)[0]

    def accept(self, token_id):
        self.accepted.append(token_id)
        return token_id in self.allowed


@pytest.mark.parametrize('vocab', [1, 31, 32, 33, 100, 257])
def test_apply_token_bitmask_matches_a_python_reference(vocab):
    from lmd.pytorch_backend.sampler import apply_token_bitmask_, unpack_bitmask

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    # every 32nd bit and the sign bit of each word included; one row allows nothing, one all
    allowed = [set(torch.randperm(vocab, generator=g)[:vocab // 2].tolist()) | {t for t in range(vocab) if t % 32 == 31},
               set(range(vocab)), set(), {vocab - 1}]
    bitmask = bitmask_of(allowed, vocab)

    def reference(row: torch.Tensor, ids: set[int]) -> torch.Tensor:
        return torch.tensor([v if t in ids else float('-inf') for t, v in enumerate(row.tolist())])

    assert unpack_bitmask(bitmask, vocab).tolist() == [[t in ids for t in range(vocab)] for ids in allowed]
    expect = torch.stack([reference(logits[r], ids) for r, ids in enumerate(allowed)])
    assert torch.equal(apply_token_bitmask_(logits.clone(), bitmask), expect)
    # a subset of rows: bitmask row j masks logits row rows[j]
    got = apply_token_bitmask_(logits.clone(), bitmask[[0, 3]], rows=[2, 0])
    assert torch.equal(got[2], reference(logits[2], allowed[0])) and torch.equal(got[0], reference(logits[0], allowed[3]))
    assert torch.equal(got[[1, 3]], logits[[1, 3]])
    with pytest.raises(ValueError, match='covers'):
        unpack_bitmask(bitmask[:, :0], vocab)


def test_constrained_rows_pick_allowed_tokens_and_leave_others_alone():
    vocab = 300
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g)
    allowed = {5, 77, 250}
    con = FixedConstraint(allowed, vocab)
    states = [SamplingState(SamplingParams(logprobs=2), []), SamplingState(SamplingParams(), [], con),
              SamplingState(sampled(random_seed=1), [])]
    before = logits.clone()
    out = Sampler().sample(logits, states)
    assert torch.equal(logits, before)
    assert out.token_ids[1] == max(allowed, key=lambda t: logits[1, t].item())
    # the unconstrained rows: exactly what they get alone
    assert out.token_ids[0] == Sampler().sample(logits[:1], [SamplingState(SamplingParams(logprobs=2), [])]).token_ids[0]
    assert out.token_ids[2] == Sampler().sample(logits[2:], [SamplingState(sampled(random_seed=1), [])]).token_ids[0]
    # logprobs stay those of the raw logits under a constraint
    con_lp = SamplingState(SamplingParams(logprobs=0), [], FixedConstraint(allowed, vocab))
    lp = Sampler().sample(logits[1:2], [con_lp]).logprobs[0]
    (chosen, value), = lp.items()
    assert chosen in allowed and value == pytest.approx(torch.log_softmax(logits[1], -1)[chosen].item(), abs=1e-6)


def test_sampled_constrained_rows_draw_from_the_masked_distribution():
    vocab = 64
    logits = torch.linspace(2.0, -2.0, vocab)
    allowed = {3, 10, 40, 63}
    n = 3000
    states = [SamplingState(sampled(random_seed=s), [], FixedConstraint(allowed, vocab)) for s in range(n)]
    ids = torch.tensor(Sampler().sample(logits[None].expand(n, -1), states).token_ids)
    assert set(ids.tolist()) <= allowed
    masked = torch.full((vocab,), float('-inf'))
    masked[list(allowed)] = logits[list(allowed)]
    assert torch.allclose(empirical(ids, vocab), masked.softmax(-1), atol=0.03)


def test_a_constraint_lets_stop_ids_through_before_min_new_tokens():
    logits = LOGITS8[None]  # id 0 is the best
    params = SamplingParams(min_new_tokens=3, stop_token_ids=(0,))
    state = SamplingState(params, [], FixedConstraint({0, 1}, 8))
    assert Sampler().sample(logits, [state]).token_ids == [0]  # the grammar, not min_new_tokens, decides
    assert Sampler().sample(logits, [SamplingState(params, [])]).token_ids == [1]
