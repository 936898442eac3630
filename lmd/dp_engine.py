"""``DataParallelEngine``: N engines of one model (replicas) behind one Engine interface (``--dp N``).

``build_engine`` makes one when ``EngineConfig.dp > 1``: the replicas are whole engines of either
backend in this process (each its own weights, KV cache, scheduler and engine thread), so one
``AsyncEngine`` and one api_server serve them all, as SGLang's and vLLM's data parallelism do. Each
request goes to one replica (``add_request``); the rest of the interface reaches the one or all it
concerns:

- a new sequence is routed by ``routing``: 'prefix_aware' (the default) sends it where the longest
  prefix of its prompt went before, as long as the loads (requests in flight) are in balance
  (``lmd.prefix_router``: SGLang's cache-aware rule, on whole blocks of the engines' block size, the
  adapter's name salting the keys as the engines' prefix caches do); without prefix caching it is the
  least loaded replica alone. 'round_robin' and 'random' are the baselines a test compares with.
- an interactive session (``sequence_end=False``) is pinned to its replica while a turn is in flight
  or its cache is kept: its later turns, ``abort`` and ``end`` go there;
- ``get_logits`` / ``get_hidden_states`` run on the least busy replica; LoRA adapters load into and
  unload from every replica (all or none); ``stats`` sums the replicas' (``replica_stats``: each
  one's, their prefix-cache hits included); ``close`` closes them all.

Cores: on a CPU the replicas share ``num_threads`` (default: every core): each gets
``num_threads // dp`` threads, at least one, split again over its ranks when the PyTorch engine runs
tensor or pipeline parallel (an engine's ``num_threads`` is per rank there). Both engines set the
thread counts process-wide (torch's, and each kernel library's), which is right because every replica
asks for the same count. Each kernel library (``_kernels``, ``_turbomind``) has one thread pool, and
a region started while another replica's runs on it runs on its caller alone: with one thread per
replica (two replicas on two cores) each engine thread computes on its own core with no pool at all;
with more threads per replica, replicas whose regions overlap take turns at the pool's team, so the
cores are never oversubscribed but a replica may get fewer than its share for a region. TurboMind's
engine threads run without the GIL; the PyTorch engine's are Python threads, whose kernels let the GIL
go but whose Python between kernels does not, so its replicas overlap less. On CUDA, ``device='cuda'``
puts replica i on ``cuda:i``; ``cuda:K`` puts them all on that one device.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from .engine import Engine, EngineOutput, EngineRequest, EngineStats, OutputCallback
from .messages import EngineConfig
from .prefix_router import PrefixRouter

if TYPE_CHECKING:
    import torch

    from .lora import LoraAdapter

ROUTINGS = ('prefix_aware', 'round_robin', 'random')


def replica_configs(config: EngineConfig, cpu_count: int | None = None) -> list[EngineConfig]:
    """The configs of ``config.dp`` replicas: ``config`` with dp 1, each its share of the threads (see the
    module docstring) and, for ``device='cuda'``, a device of its own."""
    n = config.dp
    ranks = config.tp * getattr(config, 'pp', 1)
    total = config.num_threads or cpu_count or os.cpu_count() or 1
    threads = max(1, total // (n * ranks))
    devices = [config.device] * n
    if config.device == 'cuda':
        import torch
        found = torch.cuda.device_count()
        if found < n:
            raise ValueError(f'{type(config).__name__}.dp={n} with device=\'cuda\' puts each replica on a device '
                             f'of its own, and {found} CUDA device{"s" if found != 1 else ""} '
                             f'{"are" if found != 1 else "is"} here; set device=\'cuda:0\' to share one')
        devices = [f'cuda:{i}' for i in range(n)]
    return [dataclasses.replace(config, dp=1, num_threads=threads, device=d) for d in devices]


class _Session:
    """Where a session id lives: its replica, its turns in flight, whether its cache is kept."""
    __slots__ = ('replica', 'in_flight', 'kept')

    def __init__(self, replica: int):
        self.replica, self.in_flight, self.kept = replica, 0, False


class DataParallelEngine(Engine):
    """``configs``: one per replica (``replica_configs``); ``build(config)``: one engine (``build_engine``
    passes the backend's class). Replicas are built one after another; if one fails, those built close."""

    def __init__(self, configs: Sequence[EngineConfig], build: Callable[[EngineConfig], Engine],
                 routing: str = 'prefix_aware', seed: int | None = None):
        if routing not in ROUTINGS:
            raise ValueError(f'routing={routing!r} is invalid: allowed values are {", ".join(map(repr, ROUTINGS))}')
        if len(configs) < 1:
            raise ValueError('DataParallelEngine needs at least one replica config')
        self.replicas: list[Engine] = []
        try:
            for config in configs:
                self.replicas.append(build(config))
        except BaseException:
            for engine in self.replicas:
                engine.close()
            raise
        infos = [e.model_info for e in self.replicas]
        # a request must fit every replica: each sized its own cache from the memory it found
        self.model_info = dataclasses.replace(infos[0], session_len=min(i.session_len for i in infos))
        self.routing = routing
        self.prefix_caching = configs[0].enable_prefix_caching
        capacity = min(e.stats().num_total_blocks for e in self.replicas) or 1  # a record of at most a cache
        self._router = PrefixRouter(configs[0].cache_block_seq_len, capacity)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        # behind _lock
        self._sessions: dict[int, _Session] = {}  # session id -> its replica, while in flight or kept
        self._in_flight = [0] * len(self.replicas)  # requests added and not finished, per replica
        self._scoring = [0] * len(self.replicas)  # get_logits / get_hidden_states calls running, per replica
        self._turn = 0  # round-robin position
        self._adapters: dict[str, LoraAdapter] = {}  # loaded into every replica, for a failed unload's undo
        self._adapter_lock = threading.Lock()  # loads and unloads one at a time

    # ---- requests ----------------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest, callback: OutputCallback,
                    loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not isinstance(request, EngineRequest):
            raise TypeError(f'add_request expects an EngineRequest, got {type(request).__name__}')
        sid = request.session_id
        with self._lock:
            session = self._sessions.get(sid)
            new = session is None
            if new:  # a session not seen (or not kept): route it; an unknown continuation its replica refuses
                session = self._sessions[sid] = _Session(self._route(request))
            i = session.replica
            session.in_flight += 1
            self._in_flight[i] += 1

        def on_output(out: EngineOutput) -> None:
            if out.finish_reason is not None:  # before the callback: its caller may send the next turn at once
                self._finished(sid, session, i, kept=not request.sequence_end and out.finish_reason != 'error')
            callback(out)
        try:
            self.replicas[i].add_request(request, on_output, loop)
        except BaseException:
            with self._lock:
                self._in_flight[i] -= 1
                session.in_flight -= 1
                if new and session.in_flight == 0 and self._sessions.get(sid) is session:
                    del self._sessions[sid]
            raise

    def _route(self, request: EngineRequest) -> int:
        """The replica for a new sequence (under ``_lock``); see the module docstring."""
        n = len(self.replicas)
        if self.routing == 'random':
            return self._rng.randrange(n)
        if self.routing == 'round_robin' or not self.prefix_caching:
            start = self._turn
            self._turn = (self._turn + 1) % n
            if self.routing == 'round_robin':
                return start
            # least loaded; ties in turn, so that requests one at a time spread over the replicas too
            return min(((start + k) % n for k in range(n)), key=lambda i: self._in_flight[i])
        keys = self._router.keys(request.token_ids, salt=request.adapter)
        return self._router.choose(range(n), self._in_flight, keys)

    def _finished(self, sid: int, session: _Session, replica: int, kept: bool) -> None:
        with self._lock:
            self._in_flight[replica] -= 1
            session.in_flight -= 1
            if self._sessions.get(sid) is not session:  # ended meanwhile
                return
            session.kept = kept
            if session.in_flight == 0 and not kept:
                del self._sessions[sid]

    def abort(self, session_id: int) -> None:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is not None:
            self.replicas[session.replica].abort(session_id)

    def end(self, session_id: int) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            self.replicas[session.replica].end(session_id)

    def replica_of(self, session_id: int) -> int | None:
        """The replica a session in flight or kept is pinned to; None for one unknown here."""
        with self._lock:
            session = self._sessions.get(session_id)
            return None if session is None else session.replica

    # ---- state -------------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The replicas' stats summed, field by field (every field is a count)."""
        each = self.replica_stats()
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in each) for f in dataclasses.fields(EngineStats)})

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's own stats, in replica order (its prefix-cache hits: ``num_prefix_hit_tokens``)."""
        return [e.stats() for e in self.replicas]

    def is_alive(self) -> bool:
        return all(e.is_alive() for e in self.replicas)

    def close(self) -> None:
        errors = []
        for engine in self.replicas:
            try:
                engine.close()
            except Exception as e:  # the others still close
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- scoring: one replica, the least busy ----------------------------------------------------------------

    def get_logits(self, token_ids, adapter: str | None = None) -> torch.Tensor:
        return self._score('get_logits', token_ids, adapter)

    def get_hidden_states(self, token_ids, adapter: str | None = None) -> torch.Tensor:
        return self._score('get_hidden_states', token_ids, adapter)

    def _score(self, method: str, token_ids, adapter: str | None):
        with self._lock:
            i = min(range(len(self.replicas)), key=lambda k: (self._scoring[k] + self._in_flight[k], k))
            self._scoring[i] += 1
        try:
            return getattr(self.replicas[i], method)(token_ids, adapter)
        finally:
            with self._lock:
                self._scoring[i] -= 1

    # ---- LoRA adapters: in every replica, all or none ----------------------------------------------------

    def load_adapter(self, adapter: LoraAdapter) -> None:
        with self._adapter_lock:
            self._on_every_replica(lambda e: e.load_adapter(adapter), lambda e: e.unload_adapter(adapter.name))
            self._adapters[adapter.name] = adapter

    def unload_adapter(self, name: str) -> None:
        """ValueError when ``name`` is not loaded, or requests on any replica still use it (then every
        replica keeps it: those that had let it go load it again)."""
        with self._adapter_lock:
            adapter = self._adapters.get(name)
            self._on_every_replica(lambda e: e.unload_adapter(name),
                                   lambda e: adapter is not None and e.load_adapter(adapter))
            self._adapters.pop(name, None)

    def _on_every_replica(self, do, undo) -> None:
        """``do(engine)`` on every replica, or on none: where one raises, ``undo`` the replicas done, then raise."""
        done = []
        try:
            for engine in self.replicas:
                do(engine)
                done.append(engine)
        except BaseException:
            for engine in done:
                undo(engine)
            raise

    def adapter_names(self) -> list[str]:
        return self.replicas[0].adapter_names()
