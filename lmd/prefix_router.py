"""Cache-aware routing: which of several replicas serves a prompt, by prefix locality and by load.

As SGLang's cache-aware router: the router keeps, for each replica, a record of the prompts it
recently sent there, and sends a new prompt where the longest prefix of it went before, since that
replica's prefix cache most likely still holds its KV blocks; unless the replicas' loads are far
apart, when the least loaded one takes it whatever it holds. Two callers, one rule:
``lmd.dp_engine`` over the replicas of ``--dp`` (token ids, in blocks of the engines' block size) and
the proxy's ``prefix_aware`` strategy over api_servers (the prompt's text, or its token ids).

A record is of chunks, not tokens: a prompt is cut into whole chunks of ``chunk_size`` items (a
partial last chunk is left out, as a prefix cache keeps whole blocks only), and chunk i is known by
a hash chained over chunks 0..i, so one key stands for the whole prefix up to it. Each replica keeps
at most ``capacity`` keys, the least recently routed evicted first; a prompt's keys are touched
deepest first, so its shallow chunks, which more prompts share, are the last to go (as a prefix
cache evicts leaves first).

Not thread-safe: its owner holds a lock (the engine) or runs on one event loop (the proxy).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

Replica = Hashable


def chunk_keys(items: Sequence | str, chunk_size: int, salt: Hashable = None) -> list[int]:
    """The chained hash of each whole chunk of ``items`` (token ids, or a text's characters): key i
    stands for ``items[:(i + 1) * chunk_size]``; ``salt`` (an adapter's name, a model's) starts the chain,
    so prompts under different salts never match."""
    h = hash(('lmd-prefix', salt))
    keys = []
    for start in range(0, len(items) - chunk_size + 1, chunk_size):
        chunk = items[start:start + chunk_size]
        h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
        keys.append(h)
    return keys


class PrefixRouter:
    """Per-replica records of routed prefixes, and the choice of a replica for a prompt (``choose``).

    ``balance_abs_threshold`` and ``balance_rel_threshold``: the loads (requests in flight) count as
    out of balance when the busiest candidate has more than ``abs`` requests more than the idlest
    and more than ``rel`` times as many (SGLang's two thresholds)."""

    def __init__(self, chunk_size: int, capacity: int, balance_abs_threshold: float = 8,
                 balance_rel_threshold: float = 1.5):
        if chunk_size < 1 or capacity < 1:
            raise ValueError(f'PrefixRouter: chunk_size={chunk_size} and capacity={capacity} must be >= 1')
        self.chunk_size = chunk_size
        self.capacity = capacity
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._records: dict[Replica, OrderedDict[int, None]] = {}  # replica -> its keys, least recent first
        self._holders: dict[int, set[Replica]] = {}  # key -> the replicas whose records hold it

    def keys(self, items: Sequence | str, salt: Hashable = None) -> list[int]:
        return chunk_keys(items, self.chunk_size, salt)

    def matched(self, keys: Sequence[int]) -> dict[Replica, int]:
        """For each replica whose record holds a prefix of ``keys``: how many chunks of it, from the first."""
        depth: dict[Replica, int] = {}
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            if not holders:
                break
            deeper = False
            for r in holders:
                if depth.get(r, 0) == i:  # it holds every chunk before this one too
                    depth[r] = i + 1
                    deeper = True
            if not deeper:
                break
        return depth

    def choose(self, replicas: Sequence[Replica], loads: Sequence[float], keys: Sequence[int]) -> Replica:
        """The replica of ``replicas`` (with their ``loads``) for a prompt of chunk ``keys``, recorded there.

        The rule: when the loads are out of balance, the least loaded replica; else the one whose record
        holds the longest prefix of the prompt, ties (no prefix held anywhere included) going to the
        least loaded, then to the smallest record (the most room in its cache), then to the first."""
        if not replicas:
            raise ValueError('PrefixRouter.choose needs at least one replica')
        depth = self.matched(keys)
        lo, hi = min(loads), max(loads)
        unbalanced = hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

        def rank(i: int):
            r = replicas[i]
            size = len(self._records.get(r, ()))
            if unbalanced:
                return loads[i], -depth.get(r, 0), size, i
            return -depth.get(r, 0), loads[i], size, i
        chosen = replicas[min(range(len(replicas)), key=rank)]
        self.record(chosen, keys)
        return chosen

    def record(self, replica: Replica, keys: Sequence[int]) -> None:
        """Note that ``replica`` was sent the prefix of ``keys``; its least recent keys past ``capacity`` go."""
        record = self._records.setdefault(replica, OrderedDict())
        for key in reversed(keys):  # the shallowest chunk is the most recent: evicted last
            if key in record:
                record.move_to_end(key)
            else:
                record[key] = None
                self._holders.setdefault(key, set()).add(replica)
        while len(record) > self.capacity:
            key, _ = record.popitem(last=False)
            self._drop(key, replica)

    def forget(self, replica: Replica) -> None:
        """Drop ``replica``'s record (it left, or its cache was lost)."""
        for key in self._records.pop(replica, ()):
            self._drop(key, replica)

    def record_size(self, replica: Replica) -> int:
        return len(self._records.get(replica, ()))

    def _drop(self, key: int, replica: Replica) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[key]
