"""BlockManager: allocation, ref counts, prefix matching and LRU eviction, invariants after every operation."""
import pytest

from lmd.engine import SamplingParams
from lmd.pytorch_backend.block_manager import BlockManager
from lmd.pytorch_backend.sequence import Sequence

BS = 4


def make_seq(tokens, sid=0):
    return Sequence(sid, list(tokens), SamplingParams(), None, None)


def compute(bm, seq, n=None):
    """Pretend the model computed the first ``n`` tokens (all by default); register full blocks."""
    seq.num_computed_tokens = seq.num_tokens if n is None else n
    bm.cache_full_blocks(seq)


def check(bm, *seqs):
    bm.check_invariants(list(seqs))


def test_allocate_and_free_without_prefix_caching():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = make_seq(range(10)), make_seq(range(5))
    assert bm.allocate(a, 10)
    check(bm, a, b)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert bm.allocate(a, 12)          # still 3 blocks
    assert len(a.block_ids) == 3
    assert bm.allocate(a, 13)          # one more
    assert len(a.block_ids) == 4
    assert bm.allocate(b, 5)
    check(bm, a, b)
    assert not set(a.block_ids) & set(b.block_ids)
    compute(bm, a)
    assert bm.match_prefix(a.token_ids) == ([], 0)
    bm.free(a)
    check(bm, a, b)
    assert a.block_ids == [] and bm.num_free_blocks == 6 and bm.num_cached_blocks == 0
    bm.free(b)
    check(bm, a, b)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_allocate_fails_without_side_effects():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a, b = make_seq(range(12)), make_seq(range(100, 112))
    assert bm.allocate(a, 12)
    before = (list(a.block_ids), bm.num_free_blocks, bm.num_used_blocks)
    assert not bm.allocate(b, 12)
    assert b.block_ids == [] and (list(a.block_ids), bm.num_free_blocks, bm.num_used_blocks) == before
    assert bm.num_prefix_query_tokens == 12  # only a's successful admission counts
    check(bm, a, b)


def test_prefix_hit_gives_same_blocks_and_shares_them():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = make_seq(range(10))            # blocks [0..3] [4..7] [8, 9]
    assert bm.allocate(a, 10)
    compute(bm, a)
    check(bm, a)
    b = make_seq(list(range(8)) + [50, 51, 52])
    hit, n = bm.match_prefix(b.token_ids)
    assert hit == a.block_ids[:2] and n == 8
    assert bm.allocate(b, b.num_tokens, hit)
    check(bm, a, b)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.num_prefix_hit_tokens == 8 and bm.num_prefix_query_tokens == 10 + 11
    bm.free(a)
    check(bm, a, b)
    # a's shared blocks are still held by b; its own tail block is cached only if full (it is not)
    assert bm.num_used_blocks == 3 and bm.num_cached_blocks == 0
    bm.free(b)
    check(bm, a, b)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2  # the two full blocks of the prefix


def test_match_keeps_the_last_token_to_recompute():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = make_seq(range(8))             # exactly two full blocks
    assert bm.allocate(a, 8)
    compute(bm, a)
    bm.free(a)
    check(bm, a)
    hit, n = bm.match_prefix(list(range(8)))
    assert n == 4 and len(hit) == 1    # the whole prompt is cached, yet its last block is recomputed
    hit, n = bm.match_prefix(list(range(9)))
    assert n == 8 and len(hit) == 2
    assert bm.match_prefix(list(range(1, 9)))[1] == 0  # a different first block: no hit at all


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = make_seq(range(12))
    assert bm.allocate(a, 12)
    compute(bm, a, 6)                  # chunked prefill: one full block computed so far
    assert bm.match_prefix(list(range(12)) + [0])[1] == 4
    compute(bm, a, 12)
    assert bm.match_prefix(list(range(12)) + [0])[1] == 12
    check(bm, a)


def test_revived_cached_block_is_not_evicted_for_its_own_allocation():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = make_seq(range(12))
    assert bm.allocate(a, 12)
    compute(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 0
    b = make_seq(list(range(8)) + [77, 78, 79, 80])
    hit, n = bm.match_prefix(b.token_ids)
    assert n == 8
    assert bm.allocate(b, 12, hit)     # 2 revived + 1 new (evicts a's third block, not the revived ones)
    check(bm, b)
    assert b.block_ids[:2] == hit and bm.num_used_blocks == 3
    c = make_seq(range(200, 204))
    assert not bm.allocate(c, 4)
    check(bm, b, c)


def test_lru_eviction_order():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a, b = make_seq(range(0, 8)), make_seq(range(100, 108))
    for s in (a, b):
        assert bm.allocate(s, 8)
        compute(bm, s)
    bm.free(a)                         # a's blocks become the least recently used
    bm.free(b)
    check(bm, a, b)
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 4
    c = make_seq(range(200, 216))      # needs 4: the 2 free ones, then a's (tail first)
    assert bm.allocate(c, 12)
    check(bm, a, b, c)
    assert bm.match_prefix(list(range(8)) + [0])[1] == 4      # a lost its tail block, kept its head
    assert bm.match_prefix(list(range(100, 108)) + [0])[1] == 8
    assert bm.allocate(c, 16)
    assert bm.match_prefix(list(range(8)) + [0])[1] == 0      # and now its head
    assert bm.match_prefix(list(range(100, 108)) + [0])[1] == 8
    check(bm, a, b, c)
    bm.free(c)
    check(bm, a, b, c)
    assert bm.num_used_blocks == 0


def test_hit_refreshes_lru_position():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a, b = make_seq(range(0, 8)), make_seq(range(100, 108))
    for s in (a, b):
        assert bm.allocate(s, 8)
        compute(bm, s)
    bm.free(a)
    bm.free(b)
    a2 = make_seq(list(range(8)) + [9])    # reuses a's blocks, then frees them: now newest
    hit, _ = bm.match_prefix(a2.token_ids)
    assert bm.allocate(a2, 8, hit)
    bm.free(a2)
    c = make_seq(range(200, 208))
    assert bm.allocate(c, 8)               # evicts b's two blocks, the least recently freed
    assert bm.match_prefix(list(range(100, 108)) + [0])[1] == 0
    assert bm.match_prefix(list(range(8)) + [0])[1] == 8
    check(bm, a, b, a2, c)


def test_duplicate_content_computed_twice():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a, b = make_seq(range(8)), make_seq(range(8))
    assert bm.allocate(a, 8) and bm.allocate(b, 8)   # both admitted before either was computed
    compute(bm, a)
    compute(bm, b)
    check(bm, a, b)
    assert len(b.block_hashes) == 2 and b.block_hashes == a.block_hashes
    bm.free(a)
    bm.free(b)
    check(bm, a, b)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 6


def test_interleaved_random_operations_keep_invariants():
    import random
    rng = random.Random(0)
    bm = BlockManager(24, BS, enable_prefix_caching=True)
    live = []
    prefixes = [list(range(i * 100, i * 100 + 12)) for i in range(3)]
    for step in range(400):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(prefixes)[:rng.randint(1, 12)] + [rng.randint(0, 999) for _ in range(rng.randint(1, 9))]
            s = make_seq(tokens, sid=step)
            hit, n = bm.match_prefix(tokens)
            assert n < len(tokens)
            if bm.allocate(s, len(tokens), hit):
                s.num_computed_tokens = n
                live.append(s)
        elif op < 0.7 and live:
            s = rng.choice(live)
            compute(bm, s)
            s.token_ids.append(rng.randint(0, 999))
            bm.allocate(s, s.num_tokens)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        check(bm, *live)
    for s in live:
        bm.free(s)
    check(bm)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks + bm.num_cached_blocks == 24


def test_double_free_is_caught():
    bm = BlockManager(4, BS)
    a = make_seq(range(4))
    assert bm.allocate(a, 4)
    ids = list(a.block_ids)
    bm.free(a)
    a.block_ids = ids
    with pytest.raises(AssertionError):
        bm.free(a)


@pytest.mark.parametrize('prefix_caching', [False, True])
def test_a_sliding_window_gives_back_the_blocks_no_query_reads_again(prefix_caching):
    """window 6, blocks of 4: after computing n tokens, the next query (position n) reads keys from
    n - 5 on, so the blocks wholly before that are given back, and the accounting holds throughout."""
    from lmd.pytorch_backend.block_manager import RELEASED
    bm = BlockManager(8, BS, enable_prefix_caching=prefix_caching, window=6)
    seq, other = make_seq(range(30)), make_seq(range(100, 105), sid=1)
    assert bm.allocate(other, 5)
    for n in range(1, 31):
        assert bm.allocate(seq, n)
        seq.num_computed_tokens = n
        bm.cache_full_blocks(seq)
        bm.release_outside_window(seq)
        check(bm, seq, other)
        released = max(0, n - 5) // BS
        assert seq.block_ids[:released] == [RELEASED] * released
        assert RELEASED not in seq.block_ids[released:]
        assert bm.num_used_blocks == len(seq.block_ids) - released + len(other.block_ids)
    # 30 tokens in 8 blocks of 4, one of them another sequence's: only the window's fit at once
    assert len(seq.block_ids) == 8 and bm.num_used_blocks <= 4
    assert (bm.num_cached_blocks > 0) == prefix_caching  # released full blocks stay reusable prefixes
    bm.free(seq)
    check(bm, other)
    assert bm.num_used_blocks == len(other.block_ids)
