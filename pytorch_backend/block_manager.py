"""The KV cache's blocks: who holds which, and which full blocks can be reused as a prefix.

Mechanism only; the scheduler decides when to call it. The pool has
``num_blocks`` blocks of ``block_size`` token slots. Each block is in exactly one
state:

- free:   ref count 0, holds nothing reusable (in ``_free``, FIFO)
- cached: ref count 0, holds a full block registered in the prefix cache
          (in ``_evictable``, least recently freed first); reusable by a prefix
          hit, or evicted (forgotten) when a fresh block is needed
- used:   ref count > 0, held by that many sequences (a used block may also be
          registered in the prefix cache, so other sequences can share it)

A full block's key is ``hash((parent_key, tuple(its token ids)))``: equal keys mean
equal tokens at equal positions, so equal K/V. Only full blocks are keyed.

With a sliding ``window`` on every layer (Mistral), a sequence lets go of the blocks no query of
it will read again, those wholly before its next query's window, as it runs
(``release_outside_window``): their place in ``seq.block_ids`` holds ``RELEASED``, so block i still
holds tokens i * block_size ..., and the kernels never read a released entry.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from lmd.weights.memory import window_blocks

from .sequence import Sequence

_ROOT_HASH = 0x6C6D64  # the parent key of a sequence's first block
RELEASED = -1  # a block_ids entry a sliding window no longer reads, given back


def _block_key(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def _root_key(salt: int) -> int:
    """The parent key of a sequence's first block: a LoRA adapter's uid (``Sequence.adapter_uid``) starts a
    chain of its own, so blocks computed with an adapter are only found by requests of that adapter."""
    return _ROOT_HASH if not salt else hash((_ROOT_HASH, 'lora', salt))


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, window: int = 0):
        if num_blocks < 1 or block_size < 1 or window < 0:
            raise ValueError(f'BlockManager needs num_blocks >= 1, block_size >= 1 and window >= 0, got {num_blocks}, '
                             f'{block_size}, {window}')
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # > 0: every layer reads only its last `window` tokens
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # prefix cache: key -> block, and per block its key and tokens (tokens guard against hash collisions)
        self._key_to_block: dict[int, int] = {}
        self._block_key: list[int | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0

    # ---- counters -------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free but holding a reusable prefix (evictable)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take: free ones, then evicted cached ones."""
        return len(self._free) + len(self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds at once, computed ``chunk`` tokens a step:
        all of them, or with a window ``window_blocks``."""
        n = self.blocks_needed(num_tokens)
        return min(n, window_blocks(self.window, chunk, self.block_size)) if self.window else n

    def _window_skip(self, num_prefix_blocks: int) -> int:
        """Of a prefix hit of that many blocks, the leading ones no query of the sequence reads."""
        return max(0, num_prefix_blocks * self.block_size - self.window + 1) // self.block_size if self.window else 0

    # ---- the scheduler's interface ----------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], salt: int = 0) -> tuple[list[int], int]:
        """The cached blocks holding the longest run of full leading blocks of ``token_ids``.

        Returns (block_ids, num_cached_tokens). Takes no reference: hand the ids to
        ``allocate`` in the same step. At most ``len(token_ids) - 1`` tokens match, so
        the last token is always recomputed (its logits are needed). ``salt``: the sequence's
        ``adapter_uid`` (``_root_key``).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        block_ids: list[int] = []
        parent = _root_key(salt)
        for start in range(0, len(token_ids) - bs, bs):
            tokens = tuple(token_ids[start:start + bs])
            key = _block_key(parent, tokens)
            block = self._key_to_block.get(key)
            if block is None or self._block_tokens[block] != tokens:
                break
            block_ids.append(block)
            parent = key
        return block_ids, len(block_ids) * bs

    def allocate(self, seq: Sequence, num_tokens: int, prefix_block_ids: list[int] = ()) -> bool:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens; False (and no change) if too few are left.

        ``prefix_block_ids`` (from ``match_prefix``, only for a sequence that holds no
        blocks yet) become its leading blocks, shared with whoever else holds them; with a window,
        those wholly before its first query's window are ``RELEASED`` at once, never taken.
        """
        num_needed = (num_tokens + self.block_size - 1) // self.block_size
        if not prefix_block_ids and num_needed <= len(seq.block_ids):
            return True  # the common decode step: its block has room
        if prefix_block_ids:
            assert not seq.block_ids, 'a prefix is only taken by a sequence without blocks'
        num_new = max(0, num_needed - len(seq.block_ids) - len(prefix_block_ids))
        skip = self._window_skip(len(prefix_block_ids))
        # a hit on a cached (evictable) block takes it out of the pool allocation draws from
        num_revived = sum(1 for b in prefix_block_ids[skip:] if self._ref_counts[b] == 0)
        if num_new + num_revived > self.num_available_blocks:
            return False
        if not seq.block_ids:  # admission: count this prompt once for the hit rate
            if self.enable_prefix_caching:
                self.num_prefix_query_tokens += seq.num_tokens
                self.num_prefix_hit_tokens += len(prefix_block_ids) * self.block_size
        for i, b in enumerate(prefix_block_ids):
            seq.block_hashes.append(self._block_key[b])
            if i < skip:
                seq.block_ids.append(RELEASED)
                continue
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1
            seq.block_ids.append(b)
        for _ in range(num_new):
            seq.block_ids.append(self._take_block())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks; registered ones stay reusable until evicted."""
        # last block first, so a sequence's tail is evicted before its head (heads are shared more)
        for b in reversed(seq.block_ids):
            if b != RELEASED:
                self._drop(b)
        seq.block_ids = []
        seq.block_hashes = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s blocks past its first ``num_tokens`` tokens (a rejected draft's slots)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_ids) > keep:
            b = seq.block_ids.pop()
            if b != RELEASED:
                self._drop(b)

    def release_outside_window(self, seq: Sequence) -> None:
        """With a window: give back ``seq``'s blocks wholly before the window of its next query (at
        position ``num_computed_tokens``, which reads keys from ``num_computed_tokens - window + 1`` on)."""
        if not self.window:
            return
        first_read = seq.num_computed_tokens - self.window + 1
        # released entries are always a prefix: walk back from the last block to give back until one is
        # met, so a decode step does constant work however long the sequence
        i = min(max(0, first_read) // self.block_size, len(seq.block_ids)) - 1
        while i >= 0 and seq.block_ids[i] != RELEASED:
            self._drop(seq.block_ids[i])
            seq.block_ids[i] = RELEASED
            i -= 1

    def _drop(self, b: int) -> None:
        """One holder less for block b; at none it is free, or cached if it is a registered prefix."""
        self._ref_counts[b] -= 1
        assert self._ref_counts[b] >= 0, f'block {b} freed more often than taken'
        if self._ref_counts[b] == 0:
            if self._block_key[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks that are full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // bs, len(seq.block_ids))
        hashes = seq.block_hashes
        if num_full <= len(hashes):
            return
        parent = hashes[-1] if hashes else _root_key(seq.adapter_uid)
        for i in range(len(hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            key = _block_key(parent, tokens)
            hashes.append(key)
            parent = key
            b = seq.block_ids[i]
            if b != RELEASED and key not in self._key_to_block and self._block_key[b] is None:
                self._key_to_block[key] = b
                self._block_key[b] = key
                self._block_tokens[b] = tokens
            # else: the same content was computed into another block at the same time; that one stays the entry

    # ---- internals ----------------------------------------------------------------------------------------

    def _take_block(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)  # least recently freed
            del self._key_to_block[self._block_key[b]]
            self._block_key[b] = None
            self._block_tokens[b] = None
        self._ref_counts[b] = 1
        return b

    def check_invariants(self, seqs: list[Sequence] | None = None) -> None:
        """Raise AssertionError if the accounting is off; ``seqs``: every sequence holding blocks."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), 'a block is twice in the free list'
        assert not free & evictable, 'a block is both free and cached'
        for b in range(self.num_blocks):
            rc = self._ref_counts[b]
            assert rc >= 0, f'block {b} has ref count {rc}'
            states = (b in free) + (b in evictable) + (rc > 0)
            assert states == 1, f'block {b} is in {states} states (ref count {rc})'
            if b in free:
                assert self._block_key[b] is None, f'free block {b} still has a prefix key'
            if b in evictable:
                assert self._block_key[b] is not None, f'cached block {b} has no prefix key'
            key = self._block_key[b]
            if key is not None:
                assert self._key_to_block.get(key) == b, f'block {b} key not mapped back to it'
        assert len(self._key_to_block) == sum(k is not None for k in self._block_key)
        assert self.num_free_blocks + self.num_cached_blocks + self.num_used_blocks == self.num_blocks
        if seqs is not None:
            held = [0] * self.num_blocks
            for s in seqs:
                num_released = next((i for i, b in enumerate(s.block_ids) if b != RELEASED), len(s.block_ids))
                assert RELEASED not in s.block_ids[num_released:], 'released blocks are not a prefix'
                for b in s.block_ids[num_released:]:
                    held[b] += 1
            assert held == self._ref_counts, 'ref counts differ from the blocks sequences hold'
