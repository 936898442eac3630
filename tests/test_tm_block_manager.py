"""TurboMind's C++ BlockManager against the Python one as the oracle: the same operations give
the same counters, hit lengths and even block ids (both take free blocks FIFO and evict cached
ones least recently freed first); invariants after every operation; the C++-only guards (hash
collisions, double free, bad arguments)."""
import random

import pytest

from lmd.engine import SamplingParams
from lmd.pytorch_backend.block_manager import BlockManager as PyBlockManager
from lmd.pytorch_backend.sequence import Sequence
from lmd.turbomind._turbomind import engine_parts as ep

BS = 4


class Pair:
    """One sequence in both block managers."""

    def __init__(self, tokens, sid=0):
        self.py = Sequence(sid, list(tokens), SamplingParams(), None, None)
        self.tm = ep.BlockSequence(list(tokens))

    def append(self, t):
        self.py.token_ids.append(t)
        self.tm.append_token(t)

    def set_computed(self, n):
        self.py.num_computed_tokens = n
        self.tm.num_computed_tokens = n


class Both:
    """Runs each operation on the Python and the C++ block manager and checks they agree."""

    def __init__(self, num_blocks, block_size=BS, prefix=True, window=0):
        self.py = PyBlockManager(num_blocks, block_size, enable_prefix_caching=prefix, window=window)
        self.tm = ep.BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, window=window)
        self.num_released = 0  # released entries seen in the live sequences, over every check

    def match_prefix(self, tokens):
        hit = self.py.match_prefix(list(tokens))
        assert self.tm.match_prefix(list(tokens)) == hit
        assert hit[1] < len(tokens) or len(tokens) == 0  # the last prompt token is always recomputed
        return hit

    def allocate(self, s, num_tokens, prefix=()):
        ok = self.py.allocate(s.py, num_tokens, list(prefix))
        assert self.tm.allocate(s.tm, num_tokens, list(prefix)) == ok
        return ok

    def free(self, s):
        self.py.free(s.py)
        self.tm.free(s.tm)

    def compute(self, s, n=None):
        s.set_computed(s.py.num_tokens if n is None else n)
        self.py.cache_full_blocks(s.py)
        self.tm.cache_full_blocks(s.tm)
        self.py.release_outside_window(s.py)   # a sliding window gives back what it no longer reads
        self.tm.release_outside_window(s.tm)

    def check(self, live):
        py, tm = self.py, self.tm
        py.check_invariants([s.py for s in live])
        tm.check_invariants([s.tm for s in live])
        for name in ('num_free_blocks', 'num_cached_blocks', 'num_used_blocks', 'num_available_blocks',
                     'num_prefix_hit_tokens', 'num_prefix_query_tokens'):
            assert getattr(tm, name) == getattr(py, name), name
        assert tm.num_free_blocks + tm.num_cached_blocks + tm.num_used_blocks == tm.num_blocks
        assert tm.free_block_ids() == list(py._free)
        assert tm.cached_block_ids() == list(py._evictable)
        for s in live:
            assert s.tm.block_ids == s.py.block_ids
            assert len(s.tm.block_hashes) == len(s.py.block_hashes)
            self.num_released += s.py.block_ids.count(-1)


@pytest.mark.parametrize('seed,num_blocks,prefix,window', [(0, 24, True, 0), (1, 12, True, 0), (2, 40, True, 0),
                                                            (3, 16, False, 0), (4, 24, True, 6), (5, 16, False, 9)])
def test_random_operations_match_the_python_block_manager(seed, num_blocks, prefix, window):
    rng = random.Random(seed)
    both = Both(num_blocks, prefix=prefix, window=window)
    live: list[Pair] = []
    heads = [[rng.randint(0, 9) for _ in range(14)] for _ in range(4)]  # shared prompt heads
    for step in range(700):
        op = rng.random()
        if op < 0.3:  # admit a new sequence through the prefix cache
            tokens = rng.choice(heads)[:rng.randint(0, 14)] + [rng.randint(0, 9) for _ in range(rng.randint(1, 9))]
            s = Pair(tokens, sid=step)
            hit, n = both.match_prefix(tokens)
            if both.allocate(s, len(tokens), hit):
                s.set_computed(n)
                live.append(s)
        elif op < 0.55 and live:  # a step: its tokens computed, one token appended, room for it
            s = rng.choice(live)
            both.compute(s)
            s.append(rng.randint(0, 9))
            both.allocate(s, s.py.num_tokens)
        elif op < 0.65 and live:  # a chunk of a prefill computed
            s = rng.choice(live)
            both.compute(s, rng.randint(s.py.num_computed_tokens, s.py.num_tokens))
        elif op < 0.75 and live:  # preempted and recomputed: freed, then admitted again
            s = rng.choice(live)
            both.free(s)
            s.set_computed(0)
            hit, n = both.match_prefix(s.py.token_ids)
            if both.allocate(s, s.py.num_tokens, hit):
                s.set_computed(n)
            else:
                live.remove(s)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            both.free(s)
        both.check(live)
    for s in live:
        both.free(s)
    both.check([])
    assert both.tm.num_used_blocks == 0
    if prefix:
        assert both.tm.num_prefix_hit_tokens > 0  # the driver did exercise the prefix cache
    assert (both.num_released > 0) == (window > 0)  # and the window gave blocks back


def test_hit_never_covers_the_last_prompt_token():
    both = Both(16)
    a = Pair(range(12))
    assert both.allocate(a, 12)
    both.compute(a)
    both.free(a)
    hit, n = both.match_prefix(list(range(12)))  # all three blocks cached, the last one not hit
    assert n == 8 and hit == [0, 1]
    assert both.tm.match_prefix(list(range(13)))[1] == 12
    assert both.tm.match_prefix(list(range(5)))[1] == 4
    assert both.tm.match_prefix(list(range(4)))[1] == 0
    assert both.tm.match_prefix([])[1] == 0
    assert both.tm.match_prefix(list(range(1, 13)))[1] == 0  # a different first block: nothing


def test_lru_eviction_order():
    both = Both(6)
    a, b = Pair(range(0, 8)), Pair(range(100, 108))
    for s in (a, b):
        assert both.allocate(s, 8)
        both.compute(s)
    both.free(a)                       # a's blocks are freed first (tail first), then b's
    both.free(b)
    both.check([])
    tm = both.tm
    assert tm.cached_block_ids() == [1, 0, 3, 2]
    c = Pair(range(200, 216))          # needs 4: the 2 free blocks, then a's tail, then a's head
    assert both.allocate(c, 12)
    both.check([c])
    assert tm.match_prefix(list(range(8)) + [0])[1] == 4
    assert tm.match_prefix(list(range(100, 108)) + [0])[1] == 8
    assert both.allocate(c, 16)
    assert tm.match_prefix(list(range(8)) + [0])[1] == 0
    assert tm.match_prefix(list(range(100, 108)) + [0])[1] == 8
    both.check([c])
    # a hit takes blocks out of the middle of the LRU list; freeing them makes them the newest
    both.free(c)
    d = Pair(list(range(100, 108)) + [1])
    hit, _ = both.match_prefix(d.py.token_ids)
    assert both.allocate(d, 9, hit)
    both.check([d])
    both.free(d)
    both.check([])
    assert tm.cached_block_ids()[-2:] == list(reversed(hit))


def test_revived_cached_block_is_not_evicted_for_its_own_allocation():
    both = Both(3)
    a = Pair(range(12))
    assert both.allocate(a, 12)
    both.compute(a)
    both.free(a)
    b = Pair(list(range(8)) + [77, 78, 79, 80])
    hit, n = both.match_prefix(b.py.token_ids)
    assert n == 8
    assert both.allocate(b, 12, hit)
    assert b.tm.block_ids[:2] == hit
    both.check([b])
    c = Pair(range(200, 204))
    assert not both.allocate(c, 4)     # fails without side effects
    both.check([b, c])


def test_hash_collisions_are_misses():
    bm = ep.BlockManager(8, BS, enable_prefix_caching=True)
    bm.set_key_mask(0)                 # every key is 0: every lookup after the first is a collision
    a = ep.BlockSequence([7] * 8 + [1])
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 2    # both keyed, only the first registered (the key is taken)
    assert bm.match_prefix([5, 5, 5, 5, 0])[1] == 0  # same key, other tokens
    # same key and tokens, other parent: without the parent guard this would hit the first block twice
    assert bm.match_prefix([7] * 8 + [1]) == ([a.block_ids[0]], 4)
    b = ep.BlockSequence([5] * 4 + [1])
    assert bm.allocate(b, 5)
    b.num_computed_tokens = 5
    bm.cache_full_blocks(b)
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_cached_blocks == 1 and bm.num_free_blocks == 7


def test_block_key_is_a_fixed_function():
    # pinned: the keys are deterministic across runs and machines (a change here is deliberate)
    assert ep.ROOT_KEY == 0x6C6D64
    k1 = ep.block_key(ep.ROOT_KEY, [1, 2, 3, 4])
    assert k1 == ep.block_key(ep.ROOT_KEY, [1, 2, 3, 4])
    assert k1 == 0x15324397C5ED6A6F or pytest.fail(f'block_key changed: {k1:#x}')
    assert ep.block_key(k1, [1, 2, 3, 4]) != k1
    assert ep.block_key(ep.ROOT_KEY, [1, 2, 4, 3]) != k1
    assert ep.block_key(ep.ROOT_KEY, [1, 2, 3]) != ep.block_key(ep.ROOT_KEY, [1, 2, 3, 0])
    a = ep.BlockSequence([1, 2, 3, 4, 5])
    bm = ep.BlockManager(4, 4, True)
    assert bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert a.block_hashes == [k1]


def test_double_free_is_caught_and_changes_nothing():
    bm = ep.BlockManager(4, BS)
    a = ep.BlockSequence(list(range(8)))
    assert bm.allocate(a, 8)
    ids = list(a.block_ids)
    bm.free(a)
    assert a.block_ids == []
    a.block_ids = ids
    with pytest.raises(AssertionError, match='more often'):
        bm.free(a)
    assert a.block_ids == ids and bm.num_free_blocks == 4
    bm.check_invariants([])


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match='num_blocks'):
        ep.BlockManager(0, 4)
    with pytest.raises(ValueError, match='block_size'):
        ep.BlockManager(4, 0)
    bm = ep.BlockManager(8, BS, enable_prefix_caching=True)
    a = ep.BlockSequence(list(range(9)))
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    hit, _ = bm.match_prefix(list(range(9)))
    with pytest.raises(ValueError, match='without blocks'):
        bm.allocate(a, 9, hit)
    with pytest.raises(ValueError, match='out of range'):
        bm.allocate(ep.BlockSequence([1, 2]), 2, [99])
    with pytest.raises(ValueError, match='not cached'):
        bm.allocate(ep.BlockSequence([1, 2]), 2, [a.block_ids[2]])
    bm.check_invariants([a])


def test_invariant_check_sees_a_forged_reference():
    bm = ep.BlockManager(4, BS)
    a = ep.BlockSequence(list(range(4)))
    assert bm.allocate(a, 4)
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match='held 0 times'):
        bm.check_invariants([])
