"""TurboMind's C++ Scheduler against the PyTorch engine's Python one as the oracle, step by step:
one random scenario (requests of random lengths arriving over time, shared prompt heads that hit
the prefix cache, interactive sessions kept between turns and ended, aborts, block budgets tight
enough to preempt, prompts too long for the cache) runs through both, each over its own block
manager, and every step they must make the same decisions: which sequences run and how many
tokens each, which are preempted, which fail and why; and hold the same state after it: the
queues in order, each sequence's computed tokens, cached tokens and block ids, the block
managers' counters, free and cached lists.

They agree everywhere but one place, where they may: the prefix-cache keys. Python hashes a
block as hash((parent, tokens)), C++ with block_key (a fixed splitmix chain): both chains key
the same blocks, so only their lengths are compared (the keys' values are pinned in
test_tm_block_manager.py). Preemptions are compared as the set a step preempted (the Python
SchedulerOutput does not list them; each sequence's num_preemptions does). No other difference
showed: the C++ scheduler is the Python one's rule, queue for queue."""
import random

import pytest

from lmd.engine import SamplingParams
from lmd.pytorch_backend.block_manager import BlockManager as PyBlockManager
from lmd.pytorch_backend.scheduler import Scheduler as PyScheduler
from lmd.pytorch_backend.sequence import Sequence as PySequence
from lmd.turbomind._turbomind import engine_parts as ep


class Twin:
    """One request (or interactive session) in both schedulers."""

    def __init__(self, sid, tokens, sequence_end, max_new_tokens):
        self.py = PySequence(sid, list(tokens), SamplingParams(), None, None, sequence_end)
        self.tm = ep.Sequence(sid, list(tokens))
        self.sid = sid
        self.sequence_end = sequence_end
        self.max_new_tokens = max_new_tokens

    def append(self, token):
        self.py.token_ids.append(token)
        self.tm.append_token(token)

    def start_turn(self, tokens, sequence_end, max_new_tokens):
        self.py.start_turn(list(tokens), SamplingParams(), None, None, sequence_end)
        self.tm.start_turn(list(tokens))
        self.sequence_end = sequence_end
        self.max_new_tokens = max_new_tokens


class Both:
    """Runs each scheduler operation on the Python and the C++ scheduler and checks they agree."""

    def __init__(self, num_blocks, block_size, max_batch_size, max_num_batched_tokens, prefix=True):
        self.py_bm = PyBlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        self.tm_bm = ep.BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        self.py = PyScheduler(self.py_bm, max_batch_size, max_num_batched_tokens)
        self.tm = ep.Scheduler(self.tm_bm, max_batch_size, max_num_batched_tokens)
        self.twins: dict[int, Twin] = {}  # every sequence either scheduler holds
        self.num_released = 0  # kept blocks an idle or waiting session gave up

    def add(self, twin):
        self.twins[twin.sid] = twin
        self.py.add(twin.py)
        self.tm.add(twin.tm)

    def resume(self, twin):
        self.py.resume(twin.py)
        self.tm.resume(twin.tm)

    def finish(self, twin, keep):
        self.py.finish(twin.py, keep=keep)
        self.tm.finish(twin.tm, keep=keep)
        if not keep:
            del self.twins[twin.sid]

    def schedule(self):
        """Both schedules; returns [(twin, n)] of the step and the failed twins."""
        held = {t.sid for t in self.twins.values() if t.py.block_ids}
        before = {t.sid: t.py.num_preemptions for t in self.twins.values()}
        out_py = self.py.schedule()
        out_tm = self.tm.schedule()
        assert [s.session_id for s in out_tm.seqs] == [s.session_id for s in out_py.seqs]
        assert list(out_tm.num_scheduled_tokens) == list(out_py.num_scheduled_tokens)
        assert [(s.session_id, why) for s, why in out_tm.failed] == [(s.session_id, why) for s, why in out_py.failed]
        preempted = {sid for sid, n in before.items() if self.twins[sid].py.num_preemptions == n + 1}
        assert all(self.twins[sid].py.num_preemptions <= n + 1 for sid, n in before.items())
        assert sorted(s.session_id for s in out_tm.preempted) == sorted(preempted)
        assert len(out_tm.preempted) == len(preempted)
        self.num_released += sum(1 for sid in held - preempted if not self.twins[sid].py.block_ids)
        return out_py, out_tm

    def update(self, out_py, out_tm):
        self.py.update(out_py)
        self.tm.update(out_tm)

    def check(self):
        py, tm = self.py, self.tm
        assert [s.session_id for s in tm.waiting] == [s.session_id for s in py.waiting]
        assert [s.session_id for s in tm.running] == [s.session_id for s in py.running]
        assert [s.session_id for s in tm.idle] == list(py.idle)
        assert tm.num_preemptions == py.num_preemptions
        assert tm.has_work == py.has_work
        for t in self.twins.values():
            p, c = t.py, t.tm
            assert c.status == p.status.value, t.sid
            assert c.token_ids == p.token_ids
            assert (c.num_prompt_tokens, c.num_computed_tokens, c.num_cached_tokens, c.is_admitted,
                    c.num_preemptions) == (p.num_prompt_tokens, p.num_computed_tokens, p.num_cached_tokens,
                                           p.is_admitted, p.num_preemptions), t.sid
            assert c.block_ids == p.block_ids, t.sid
            assert len(c.block_hashes) == len(p.block_hashes), t.sid
        self.py_bm.check_invariants([t.py for t in self.twins.values()])
        self.tm_bm.check_invariants([t.tm.blocks for t in self.twins.values()])
        for name in ('num_free_blocks', 'num_cached_blocks', 'num_used_blocks', 'num_prefix_hit_tokens',
                     'num_prefix_query_tokens'):
            assert getattr(self.tm_bm, name) == getattr(self.py_bm, name), name
        assert self.tm_bm.free_block_ids() == list(self.py_bm._free)
        assert self.tm_bm.cached_block_ids() == list(self.py_bm._evictable)


def run_scenario(seed, num_blocks, block_size, max_batch_size, max_num_batched_tokens, prefix=True, steps=400):
    """Requests arrive over time and run to their end as an engine would run them; the two
    schedulers compared after every operation. Returns the Both for the caller's checks."""
    rng = random.Random(seed)
    both = Both(num_blocks, block_size, max_batch_size, max_num_batched_tokens, prefix)
    capacity = num_blocks * block_size
    heads = [[rng.randrange(50) for _ in range(3 * block_size)] for _ in range(3)]  # shared prompt heads
    next_sid = 0
    num_failed = 0

    def prompt():
        n = rng.choice([rng.randint(1, 2 * block_size), rng.randint(1, capacity // 2),
                        rng.randint(capacity // 2, capacity + block_size)])
        tokens = rng.choice(heads)[:rng.randint(0, n)] if rng.random() < 0.6 else []
        return tokens + [rng.randrange(50) for _ in range(n - len(tokens))]

    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):  # arrivals
            interactive = rng.random() < 0.3
            twin = Twin(next_sid, prompt(), sequence_end=not interactive, max_new_tokens=rng.randint(1, 12))
            next_sid += 1
            both.add(twin)
        idle = [t for t in both.twins.values() if t.py.status.value == 'idle']
        if idle and rng.random() < 0.3:
            twin = rng.choice(idle)
            if rng.random() < 0.6:  # the next turn
                twin.start_turn([rng.randrange(50) for _ in range(rng.randint(1, 2 * block_size))],
                                sequence_end=rng.random() < 0.4, max_new_tokens=rng.randint(1, 8))
                both.resume(twin)
            else:  # the session ends
                both.finish(twin, keep=False)
        active = [t for t in both.twins.values() if t.py.status.value in ('waiting', 'running')]
        if active and rng.random() < 0.05:  # an abort: an interactive session stays kept
            twin = rng.choice(active)
            both.finish(twin, keep=not twin.sequence_end)
        both.check()

        out_py, out_tm = both.schedule()
        for seq, _ in out_py.failed:  # the engine fails them
            num_failed += 1
            both.finish(both.twins[seq.session_id], keep=False)
        both.update(out_py, out_tm)
        for seq in out_py.seqs:  # caught up: a token is sampled, and may end the turn
            twin = both.twins[seq.session_id]
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            if rng.random() < 0.05:  # a stop token: neither kept nor counted
                both.finish(twin, keep=not twin.sequence_end)
                continue
            twin.append(rng.randrange(50))
            if seq.num_generated_tokens >= twin.max_new_tokens:
                both.finish(twin, keep=not twin.sequence_end)
        both.check()

    for twin in list(both.twins.values()):
        both.finish(twin, keep=False)
    both.check()
    assert both.tm_bm.num_used_blocks == 0
    both.num_failed = num_failed
    return both


@pytest.mark.parametrize('seed,num_blocks,block_size,max_batch_size,max_num_batched_tokens', [
    (0, 12, 4, 4, 16),    # tightest: preemption at every turn, kept blocks given up
    (1, 24, 4, 8, 12),    # small prefill budget: long prompts prefill in chunks beside decodes
    (2, 16, 8, 3, 64),    # few sequences at once, big blocks, whole prompts in one step
    (3, 40, 4, 16, 32),   # many sequences at once over more blocks
])
def test_random_scenario_matches_the_python_scheduler(seed, num_blocks, block_size, max_batch_size,
                                                      max_num_batched_tokens):
    both = run_scenario(seed, num_blocks, block_size, max_batch_size, max_num_batched_tokens)
    # the driver did reach what it means to test
    assert both.tm_bm.num_prefix_hit_tokens > 0
    assert both.num_failed > 0
    assert both.tm.num_preemptions > 0
    assert both.num_released > 0


def test_without_prefix_caching():
    both = run_scenario(4, 12, 4, 4, 16, prefix=False, steps=200)
    assert both.tm.num_preemptions > 0 and both.tm_bm.num_prefix_query_tokens == 0


def test_bad_arguments_raise_value_error():
    bm = ep.BlockManager(8, 4)
    with pytest.raises(ValueError, match='max_batch_size'):
        ep.Scheduler(bm, 0, 16)
    with pytest.raises(ValueError, match='BlockManager'):
        ep.Scheduler(object(), 4, 16)
    sched = ep.Scheduler(bm, 4, 16)
    a = ep.Sequence(1, [1, 2, 3])
    with pytest.raises(ValueError, match='not in this scheduler'):
        sched.finish(a)
    sched.add(a)
    with pytest.raises(ValueError, match='already queued'):
        sched.add(a)
    out = sched.schedule()
    with pytest.raises(ValueError, match='not idle'):
        sched.resume(a)
    sched.update(out)
    assert a.num_computed_tokens == 3 and a.status == 'running'
    sched.finish(a)
    assert a.status == 'finished' and not sched.has_work and bm.num_used_blocks == 0
