"""TurboMind's C++ sampler against the Python sampler and torch / HF references: greedy, kept
sets of top_k / top_p / min_p, frequencies of seeded draws, seeds independent of the batch,
penalties, masks, logprobs, and ValueError on bad parameters."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
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
from lmd.pytorch_backend.sampler import Sampler as PySampler
from lmd.pytorch_backend.sampler import SamplingState as PySamplingState
from lmd.turbomind._turbomind import engine_parts as ep


def sampled(**kw) -> SamplingParams:
    return SamplingParams(greedy=False, **kw)


def np32(t: torch.Tensor) -> np.ndarray:
    return t.float().contiguous().numpy()


def sample(logits: torch.Tensor, states, seed: int = 0):
    return ep.Sampler(seed).sample(np32(logits), states)


def draw_many(row: torch.Tensor, params: SamplingParams, n: int) -> np.ndarray:
    """n independent draws of one row: n rows seeded 0..n-1 in one batch (deterministic)."""
    states = [ep.SamplingState(replace(params, random_seed=seed)) for seed in range(n)]
    ids, _ = sample(row[None].expand(n, -1), states)
    return np.array(ids)


def chi_square(ids: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(ids, minlength=probs.size).astype(np.float64)
    expect = probs * ids.size
    assert counts[expect == 0].sum() == 0, 'a token outside the support was drawn'
    keep = expect > 0
    return float(((counts[keep] - expect[keep]) ** 2 / expect[keep]).sum())


# Chi-square bound for at most 7 degrees of freedom: P(X > 40) < 1e-5. The seeds are fixed, so a
# run either always passes or always fails; the bound only has to admit a correct sampler.
CHI2_BOUND = 40.0
LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


# --- greedy -----------------------------------------------------------------------------------

def test_greedy_is_argmax_and_does_not_touch_logits():
    torch.manual_seed(0)
    logits = np32(torch.randn(16, 1000))
    before = logits.copy()
    params = [SamplingParams(), sampled(temperature=0.0), sampled(top_k=1)] * 5 + [{}]  # {}: the defaults
    ids, lps = ep.Sampler(0).sample(logits, [ep.SamplingState(p, [1, 2]) for p in params])
    assert ids == logits.argmax(-1).tolist()
    assert lps == [None] * 16
    assert np.array_equal(logits, before)


def test_greedy_ties_pick_lowest_id_and_mixed_batches_keep_greedy_rows():
    ids, _ = sample(torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0]]), [ep.SamplingState(SamplingParams())])
    assert ids == [1]
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    params = [SamplingParams(), sampled(top_k=5, random_seed=1), SamplingParams(),
              sampled(top_p=0.5), SamplingParams(top_k=1, greedy=False), sampled(temperature=0.0)]
    ids, _ = sample(logits, [ep.SamplingState(p) for p in params])
    for i in (0, 2, 4, 5):
        assert ids[i] == int(logits[i].argmax())


# --- kept sets: the distribution each row draws from ------------------------------------------

WARP_PARAMS = [dict(temperature=0.7), dict(top_k=20), dict(top_p=0.8), dict(min_p=0.1),
               dict(temperature=1.5, top_k=100, top_p=0.9, min_p=0.05), dict(temperature=0.5, top_p=0.3),
               dict(top_k=3000), dict(top_k=20, min_p=0.2), dict(top_p=0.6, min_p=0.02), dict(top_k=1500, top_p=0.95)]


@pytest.mark.parametrize('kw', WARP_PARAMS)
def test_kept_sets_match_the_python_sampler_and_hf(kw):
    torch.manual_seed(5)
    vocab = 2000
    logits = torch.randn(8, vocab) * 2.5
    params = sampled(**kw)
    got = torch.from_numpy(ep.distribution(np32(logits), [ep.SamplingState(params) for _ in range(8)]))
    # the Python sampler's own reference of what a sampled row draws from
    want = torch.softmax(PySampler().warp(logits, [PySamplingState(params, []) for _ in range(8)]), -1)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)
    # and HF's warpers, applied in the same order
    hf = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        hf.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        hf.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        hf.append(MinPLogitsWarper(params.min_p))
    x = logits.clone()
    for w in hf:
        x = w(None, x)
    assert torch.equal(got > 0, torch.isfinite(x))


@pytest.mark.parametrize('kw', [dict(top_p=0.9), dict(top_p=0.5), dict(top_p=0.99, min_p=1e-4), dict(min_p=0.05)])
def test_nucleus_prefixes_give_the_kept_set_of_a_full_sort(kw):
    # peaked rows end inside the 256 prefix, middling ones inside 4096, flat ones need the full sort
    torch.manual_seed(9)
    vocab = 6000
    scales = torch.tensor([8.0, 3.0, 1.0, 0.3, 0.02])
    logits = torch.randn(scales.numel(), vocab) * scales[:, None]
    params = sampled(temperature=0.9, **kw)
    got = torch.from_numpy(ep.distribution(np32(logits), [ep.SamplingState(params) for _ in scales]))
    want = torch.softmax(PySampler().warp(logits, [PySamplingState(params, []) for _ in scales]), -1)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize('kw', [dict(top_p=0.3), dict(top_p=0.7), dict(top_p=0.95, min_p=0.1), dict(top_k=50, top_p=0.55)])
def test_kept_sets_with_ties_and_masked_tokens(kw):
    # integer logits: many ties, broken by the lower id as the Python sampler's stable sort does
    # (top_p stays off exact multiples of 1/50: there float32 and float64 sums disagree on the cut)
    torch.manual_seed(10)
    vocab = 3000
    logits = torch.randint(-4, 4, (4, vocab)).float()
    params = sampled(bad_token_ids=tuple(range(0, vocab, 3)), **kw)
    got = torch.from_numpy(ep.distribution(np32(logits), [ep.SamplingState(params) for _ in range(4)]))
    x = PySampler().process_logits(logits, [PySamplingState(params, []) for _ in range(4)])
    want = torch.softmax(PySampler().warp(x, [PySamplingState(params, []) for _ in range(4)]), -1)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)


def test_sampled_tokens_stay_inside_the_kept_set():
    torch.manual_seed(6)
    logits = torch.randn(3000) * 2
    params = sampled(temperature=0.8, top_k=60, top_p=0.7, min_p=0.05)
    support = ep.distribution(np32(logits[None]), [ep.SamplingState(params)])[0] > 0
    ids = draw_many(logits, params, n=1500)
    assert support[ids].all()
    assert len(set(ids.tolist())) > 1


# --- frequencies --------------------------------------------------------------------------------

@pytest.mark.parametrize('kw', [dict(), dict(temperature=0.5), dict(temperature=2.0), dict(top_k=3),
                                dict(top_p=0.6), dict(min_p=0.2), dict(top_k=6, top_p=0.9, temperature=0.8)])
def test_seeded_draw_frequencies_follow_the_distribution(kw):
    params = sampled(**kw)
    probs = ep.distribution(np32(LOGITS8[None]), [ep.SamplingState(params)])[0].astype(np.float64)
    if not kw:
        np.testing.assert_allclose(probs, torch.softmax(LOGITS8.double(), -1).numpy(), rtol=1e-5)
    ids = draw_many(LOGITS8, params, n=20000)
    assert chi_square(ids, probs) < CHI2_BOUND


def test_unseeded_draws_follow_the_distribution_and_the_stream_moves_on():
    params = sampled(temperature=1.3)
    probs = torch.softmax(LOGITS8.double() / 1.3, -1).numpy()
    sampler = ep.Sampler(42)
    states = [ep.SamplingState(params) for _ in range(500)]
    batch = np32(LOGITS8[None].expand(500, -1))
    ids = np.concatenate([np.array(sampler.sample(batch, states)[0]) for _ in range(40)])
    assert chi_square(ids, probs) < CHI2_BOUND
    # the same stream seed gives the same tokens, another one others
    a = ep.Sampler(7).sample(batch, states)[0]
    assert a == ep.Sampler(7).sample(batch, states)[0]
    assert a != ep.Sampler(8).sample(batch, states)[0]


# --- seeds -----------------------------------------------------------------------------------------

def step_logits(tag: int, step: int, vocab: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * tag + step)
    return torch.randn(vocab, generator=g) * 3


def run_steps(sampler, states, tags, num_steps: int) -> list[list[int]]:
    """Each step: row i gets the logits of tags[i] at that step; every row's token is appended."""
    out = [[] for _ in states]
    for step in range(num_steps):
        logits = torch.stack([step_logits(tag, step) for tag in tags])
        ids, _ = sampler.sample(np32(logits), states)
        for i, (s, t) in enumerate(zip(states, ids)):
            s.append(t)
            out[i].append(t)
    return out


@pytest.mark.parametrize('kw', [dict(), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05),
                                dict(top_k=50, top_p=0.8, min_p=0.02, temperature=0.7),
                                dict(repetition_penalty=1.3, frequency_penalty=0.5)])
def test_same_seed_same_tokens_whatever_the_batch(kw):
    target = sampled(random_seed=1234, **kw)
    alone = run_steps(ep.Sampler(0), [ep.SamplingState(target, [3, 4])], [0], 8)[0]
    others = [sampled(top_k=10), SamplingParams(), sampled(top_p=0.5, random_seed=9), sampled(min_p=0.1),
              sampled(logprobs=3, top_k=30), SamplingParams(repetition_penalty=1.2)]
    for order in range(3):
        states = [ep.SamplingState(p, [1]) for p in others]
        tags = [10 + j for j in range(len(others))]
        pos = (2 * order + 1) % (len(states) + 1)
        states.insert(pos, ep.SamplingState(target, [3, 4]))
        tags.insert(pos, 0)
        seqs = run_steps(ep.Sampler(order + 100), states, tags, 8)
        assert seqs[pos] == alone, (order, kw)
    other_seed = run_steps(ep.Sampler(0), [ep.SamplingState(replace(target, random_seed=1235), [3, 4])], [0], 8)[0]
    assert other_seed != alone


def test_seeded_row_continues_where_it_stopped():
    # a state skipping steps (not scheduled, or preempted) draws what it would have drawn next
    a = run_steps(ep.Sampler(0), [ep.SamplingState(sampled(random_seed=1))], [0], 12)[0]
    sampler = ep.Sampler(1)
    s = ep.SamplingState(sampled(random_seed=1))
    got = []
    for step in range(12):
        if step % 3 == 1:
            sampler.sample(np32(step_logits(5, step)[None]), [ep.SamplingState(sampled())])
        t = sampler.sample(np32(step_logits(0, step)[None]), [s])[0][0]
        s.append(t)
        got.append(t)
    assert got == a
    assert ep.seeded_uniform(1, 0) == ep.seeded_uniform(1, 0) != ep.seeded_uniform(1, 1)
    assert 0.0 <= ep.seeded_uniform(2**64 - 1, 5) < 1.0


# --- penalties and masks -----------------------------------------------------------------------

def with_history(params, prompt, generated, py=False):
    s = PySamplingState(params, prompt) if py else ep.SamplingState(params, prompt)
    for t in generated:
        s.append(t)
    return s


def test_penalties_match_the_python_sampler_and_hf():
    torch.manual_seed(3)
    vocab = 500
    logits = torch.randn(5, vocab) * 4
    prompts = [torch.randint(0, vocab, (30,)).tolist() for _ in range(5)]
    generated = [torch.randint(0, vocab, (12,)).tolist() for _ in range(5)]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.8),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=1.0,
                             bad_token_ids=(3, 4), min_new_tokens=50, stop_token_ids=(5,)),
              SamplingParams()]
    x = np32(logits)
    before = x.copy()
    got = torch.from_numpy(ep.process_logits(x, [with_history(p, a, b) for p, a, b in zip(params, prompts, generated)]))
    assert np.array_equal(x, before)
    want = PySampler().process_logits(logits, [with_history(p, a, b, py=True)
                                               for p, a, b in zip(params, prompts, generated)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for i in (0, 1):  # HF's processor over prompt + generated
        ids = torch.tensor([prompts[i] + generated[i]])
        hf = RepetitionPenaltyLogitsProcessor(params[i].repetition_penalty)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], hf)
    # OpenAI: logit -= count * frequency + presence, over generated ids only
    want2 = logits[2].clone()
    for t in set(generated[2]):
        want2[t] -= generated[2].count(t) * 0.25 + 0.5
    torch.testing.assert_close(got[2], want2)
    assert torch.equal(got[4], logits[4])


def test_ids_outside_the_vocab_touch_nothing():
    logits = torch.zeros(2, 10)
    logits[0, 3] = 4.0
    states = [ep.SamplingState(SamplingParams(repetition_penalty=2.0, bad_token_ids=(12, -3)), [3, 13, -1]),
              ep.SamplingState(SamplingParams())]
    got = ep.process_logits(np32(logits), states)
    assert got[0, 3] == 2.0 and (got[0, :3] == 0).all() and (got[0, 4:] == 0).all()
    assert np.array_equal(got[1], np32(logits[1]))


def test_bad_ids_are_never_sampled():
    bad = (0, 2, 5)
    ids = draw_many(LOGITS8, sampled(bad_token_ids=bad, temperature=2.0), n=3000)
    assert not set(ids.tolist()) & set(bad)
    assert set(ids.tolist()) == {1, 3, 4, 6, 7}
    ids, _ = sample(LOGITS8[None], [ep.SamplingState(SamplingParams(bad_token_ids=(0, 99999)))])
    assert ids == [1]


def test_min_new_tokens_masks_stop_ids_until_reached():
    state = ep.SamplingState(SamplingParams(min_new_tokens=3, stop_token_ids=(0, 7)), [4])
    sampler = ep.Sampler(0)
    got = []
    for _ in range(5):
        t = sampler.sample(np32(LOGITS8[None]), [state])[0][0]
        got.append(t)
        state.append(t)
    assert got == [1, 1, 1, 0, 0] and state.num_generated == 5
    ids = draw_many(LOGITS8, sampled(min_new_tokens=1, stop_token_ids=(0, 1)), n=2000)
    assert not {0, 1} & set(ids.tolist())


def test_every_token_masked_falls_back_to_the_first():
    ids, _ = sample(torch.zeros(2, 4), [ep.SamplingState(sampled(bad_token_ids=(0, 1, 2, 3)), []),
                                        ep.SamplingState(SamplingParams(bad_token_ids=(0, 1, 2, 3)), [])])
    assert ids == [0, 0]


# --- logprobs ------------------------------------------------------------------------------------

def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(7)
    vocab = 400
    logits = torch.randn(4, vocab) * 3
    params = [sampled(logprobs=5, temperature=0.5, top_k=10, random_seed=3, repetition_penalty=1.5),
              SamplingParams(),
              SamplingParams(logprobs=0, bad_token_ids=tuple(range(0, vocab, 2))),
              sampled(logprobs=20, top_p=0.9, random_seed=4)]
    ids, lps = sample(logits, [ep.SamplingState(p, list(range(50))) for p in params])
    raw = torch.log_softmax(logits.double(), -1)
    assert lps[1] is None
    for i in (0, 2, 3):
        items = lps[i]
        chosen = ids[i]
        assert items[0][0] == chosen
        k = params[i].logprobs
        top_i = raw[i].topk(k).indices.tolist() if k else []
        assert [t for t, _ in items[1:]] == [t for t in top_i if t != chosen]
        assert len(items) == k + (chosen not in top_i)
        for t, v in items:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)
    assert ids[2] % 2 == 1  # the masked even ids are not chosen, yet logprobs are of the raw logits
    # the Python sampler reports the same values for greedy rows
    py = PySampler().sample(logits, [PySamplingState(SamplingParams(logprobs=3), [])] * 4)
    tm = sample(logits, [ep.SamplingState(SamplingParams(logprobs=3))] * 4)
    assert tm[0] == py.token_ids
    for d, row in zip(py.logprobs, tm[1]):
        assert [t for t, _ in row] == list(d) and np.allclose([v for _, v in row], list(d.values()), atol=1e-5)


# --- bad arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize('field,value', [('top_p', 0.0), ('top_p', 1.5), ('top_p', float('nan')),
                                         ('temperature', -0.1), ('temperature', 101.0), ('top_k', -1),
                                         ('top_k', 2.5), ('min_p', 1.5), ('repetition_penalty', 0.0),
                                         ('presence_penalty', 3.0), ('frequency_penalty', -2.5),
                                         ('logprobs', 21), ('logprobs', -1), ('random_seed', -1),
                                         ('random_seed', 2**64), ('min_new_tokens', -1), ('greedy', 1),
                                         ('bad_token_ids', ('a',))])
def test_bad_parameters_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ep.SamplingState({'greedy': False, field: value})
    if field not in ('greedy', 'bad_token_ids'):
        with pytest.raises(ValueError, match=field):
            ep.SamplingState(sampled(**{field: value}))


def test_bad_shapes_raise_value_error():
    s = ep.SamplingState(SamplingParams())
    with pytest.raises(ValueError, match='rows'):
        ep.Sampler(0).sample(np.zeros((2, 5), np.float32), [s])
    with pytest.raises(ValueError, match='batch, vocab'):
        ep.Sampler(0).sample(np.zeros(5, np.float32), [s])
    # other dtypes are converted
    assert ep.Sampler(0).sample(np.arange(5, dtype=np.float64)[None], [s])[0] == [4]


# --- structured output: a constraint's bitmask --------------------------------------------------

def random_bitmask(batch: int, vocab: int, seed: int) -> np.ndarray:
    """int32 [batch, ceil(vocab / 32)] with random bits (sign bits included); row 0 keeps token 0."""
    rng = np.random.default_rng(seed)
    words = rng.integers(-2**31, 2**31, size=(batch, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    words[0, 0] |= 1
    return words


@pytest.mark.parametrize('vocab', [1, 31, 32, 33, 1000])
def test_apply_token_bitmask_matches_the_torch_version_and_a_loop(vocab):
    from lmd.pytorch_backend.sampler import apply_token_bitmask_

    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab))
    bitmask = random_bitmask(3, vocab, vocab)
    got = ep.apply_token_bitmask(np32(logits), bitmask)
    loop = np32(logits).copy()
    for r in range(3):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                loop[r, t] = -np.inf
    np.testing.assert_array_equal(got, loop)
    np.testing.assert_array_equal(got, apply_token_bitmask_(logits.clone(), torch.from_numpy(bitmask)).numpy())
    with pytest.raises(ValueError, match=r'bitmask must be int32 \[3, '):
        ep.apply_token_bitmask(np32(logits), bitmask[:2])


def test_sampling_under_a_bitmask_is_sampling_the_masked_logits():
    vocab = 200
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5))
    bitmask = random_bitmask(6, vocab, 1)
    masked = ep.apply_token_bitmask(np32(logits), bitmask)
    params = [SamplingParams(), sampled(random_seed=1), sampled(random_seed=2, top_k=20),
              sampled(random_seed=3, top_p=0.8), sampled(random_seed=4, min_p=0.1, repetition_penalty=1.3),
              SamplingParams(logprobs=2)]
    states = [ep.SamplingState(p, [1, 2, 3]) for p in params]
    ids, lps = ep.Sampler(0).sample(np32(logits), states, bitmask)
    expect_ids, _ = ep.Sampler(0).sample(masked, [ep.SamplingState(p, [1, 2, 3]) for p in params])
    assert ids == expect_ids
    allowed = [(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for r, t in enumerate(ids)]
    assert all(allowed)
    # the logprobs are the raw logits' (the model's view, not the grammar's)
    raw = torch.log_softmax(logits[5], -1)
    assert lps[5][0] == (ids[5], pytest.approx(raw[ids[5]].item(), abs=1e-5))
    # and the same as the PyTorch sampler's picks for the greedy rows
    from lmd.pytorch_backend.sampler import apply_token_bitmask_
    py = apply_token_bitmask_(logits.clone(), torch.from_numpy(bitmask))
    assert ids[0] == int(py[0].argmax()) and ids[5] == int(py[5].argmax())
    with pytest.raises(ValueError, match='bitmask'):
        ep.Sampler(0).sample(np32(logits), states, bitmask[:, :3])


def test_a_constrained_state_lets_stop_ids_through_before_min_new_tokens():
    logits = np32(LOGITS8[None])  # id 0 is the best
    state = ep.SamplingState(SamplingParams(min_new_tokens=3, stop_token_ids=(0,)))
    assert ep.Sampler(0).sample(logits, [state])[0] == [1]
    state.constrained = True  # a grammar, not min_new_tokens, decides where the text ends
    assert not state.needs_processing()
    assert ep.Sampler(0).sample(logits, [state])[0] == [0]
