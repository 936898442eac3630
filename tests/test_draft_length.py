"""The adaptive draft length of speculative decoding (``lmd.kernels.ops.DraftLength``, cpu/draft_length.h),
against a plain Python version of its arithmetic: the weighted least-squares fit of step time over rows,
the acceptance estimate, and the draft length that gives a step the most expected tokens per second."""
import random

import pytest

from lmd.kernels import ops

STEP_DECAY, ACCEPT_DECAY, PRIOR_RATE, PRIOR_WEIGHT = 0.95, 0.8, 0.7, 2.0


def fit(steps):
    """(a, b) of t = a + b R by least squares, step i weighing STEP_DECAY^(n - 1 - i)."""
    n = len(steps)
    w = [STEP_DECAY ** (n - 1 - i) for i in range(n)]
    sw = sum(w)
    mr = sum(wi * r for wi, (r, _) in zip(w, steps)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, steps)) / sw
    var = sum(wi * r * r for wi, (r, _) in zip(w, steps)) / sw - mr * mr
    cov = sum(wi * r * t for wi, (r, t) in zip(w, steps)) / sw - mr * mt
    b = max(0.0, cov / var)
    return max(0.0, mt - b * mr), b


def length(alpha, a, b, num_decoding, k_max):
    """The draft length with the most expected tokens per second of the step, by trying each."""
    def rate(k):
        return (num_decoding - 1 + sum(alpha ** j for j in range(k + 1))) / (a + b * (num_decoding + k))
    return max(range(k_max + 1), key=lambda k: (rate(k), k))


def acceptance_at(alpha):
    """An ops.DraftAcceptance whose rate() is alpha (some rejections, the accepted tokens to match)."""
    acc, rejected = ops.DraftAcceptance(), 10.0
    acc.rejected = rejected
    acc.accepted = (alpha * (rejected + PRIOR_WEIGHT) - PRIOR_RATE * PRIOR_WEIGHT) / (1 - alpha)
    assert acc.accepted >= 0 and acc.rate() == pytest.approx(alpha)
    return acc


def test_no_steps_seen_every_draft_pays():
    d, acc = ops.DraftLength(5), ops.DraftAcceptance()
    assert acc.rate() == pytest.approx(PRIOR_RATE)
    assert d.row_seconds == 0 and d.length(acc, 1, 5) == 5 and d.length(acc, 1, 3) == 3 and d.length(acc, 8, 0) == 0


def test_fit_is_weighted_least_squares():
    rng = random.Random(0)
    d, steps = ops.DraftLength(4), []
    for _ in range(60):  # steps of 1 to 5 rows at 4 ms + 1.5 ms a row, with noise
        r = rng.randint(1, 5)
        steps.append((r, 0.004 + 0.0015 * r + rng.uniform(-3e-4, 3e-4)))
        d.observe_step(*steps[-1])
    a, b = fit(steps)
    assert d.step_seconds == pytest.approx(a, rel=1e-9) and d.row_seconds == pytest.approx(b, rel=1e-9)
    assert b == pytest.approx(0.0015, rel=0.15)
    for num_decoding in (1, 16):  # a first draft token pays iff alpha >= b B / (a + b B)
        bar = b * num_decoding / (a + b * num_decoding)
        assert d.length(acceptance_at(bar * 1.01), num_decoding, 1) == 1
        assert d.length(acceptance_at(bar * 0.99), num_decoding, 1) == 0


def test_one_size_of_step_leaves_rows_free():
    d = ops.DraftLength(4)
    for _ in range(10):
        d.observe_step(5, 0.01)
    assert d.row_seconds == 0 and d.step_seconds == pytest.approx(0.01)


@pytest.mark.parametrize('a, b', [(0.004, 0.0015), (0.016, 0.0003), (0.001, 0.004)])
def test_length_gives_the_step_the_most_tokens_per_second(a, b):
    d = ops.DraftLength(6)
    for r in [1, 5, 3, 2, 6, 1, 4] * 4:
        d.observe_step(r, a + b * r)
    fa, fb = d.step_seconds, d.row_seconds
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)
    rng = random.Random(1)
    for _ in range(200):
        acc = ops.DraftAcceptance()
        acc.accepted, acc.rejected = rng.uniform(0, 20), rng.uniform(0, 10)
        alpha = acc.rate()
        assert alpha == pytest.approx((acc.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (acc.accepted + acc.rejected + 2))
        for num_decoding in (1, 2, 16):
            for limit in (0, 2, 6, 9):
                want = length(alpha, fa, fb, num_decoding, min(6, limit))
                assert d.length(acc, num_decoding, limit) == want, (alpha, num_decoding, limit)


def test_acceptance_learns_and_forgets():
    acc = ops.DraftAcceptance()
    for _ in range(6):  # drafts of 4 rejected at their first token
        acc.decay()
        acc.observe(4, 0)
    low = acc.rate()
    assert low < 0.3
    for _ in range(20):  # steps without a draft: back towards the prior, so the sequence drafts again
        acc.decay()
    assert low < acc.rate() and acc.rate() == pytest.approx(PRIOR_RATE, abs=0.02)
    acc.observe(4, 4)  # a whole draft accepted: four tokens, no rejection
    assert acc.rejected == pytest.approx(sum(ACCEPT_DECAY ** i for i in range(6)) * ACCEPT_DECAY ** 20)
    assert acc.accepted == pytest.approx(4) and acc.rate() > PRIOR_RATE
    before = (acc.accepted, acc.rejected)
    acc.observe(0, 0)  # nothing drafted: nothing learnt
    assert (acc.accepted, acc.rejected) == before


def test_draft_length_needs_a_positive_maximum():
    with pytest.raises(ValueError, match='max_tokens must be >= 1, got 0'):
        ops.DraftLength(0)
