"""``PytorchEngine``: the batching loop of the PyTorch backend, on its own thread.

Callers (any thread) put messages into an inbox; the engine thread drains it,
schedules a step, runs it, samples, and hands each request its new tokens
through the request's callback: on the engine thread, or for a request added with an
event loop, the step's outputs for that loop in one ``call_soon_threadsafe``
(``lmd.engine.deliver``). Sequences, the scheduler, the block manager and
the KV cache are touched by the engine thread only; the one piece of state
shared with callers (which sessions are active or kept, for validating a new
request at once) sits behind ``_lock``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from lmd.engine import (Engine, EngineOutput, EngineRequest, EngineStats, ModelInfo, OutputCallback, SessionTable,
                        SamplingParams, deliver, scored_token_ids)
from lmd.lora import AdapterSlot, LoraAdapter, check_fits
from lmd.messages import PytorchEngineConfig
from lmd.model_config import ModelConfig
from lmd.weights.dtype import resolve_dtype
from lmd.weights.memory import cache_size, kv_block_bytes
from lmd.weights.tensor_parallel import shard_config

from .block_manager import BlockManager
from .loading import load_model
from .distributed import RankFailure, check_parallel_config
from .model_runner import ModelRunner
from .sampler import Sampler, SamplingState, greedy_ids
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .speculative import build_proposer

logger = logging.getLogger('lmd.pytorch_backend')

_GIB = 1 << 30


@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    callback: OutputCallback
    loop: asyncio.AbstractEventLoop | None = None  # where the callback runs (None: the engine thread)
    # test hook: teacher forcing (see ``teacher_forced_logits``)
    forced_token_ids: tuple[int, ...] | None = None
    logits_sink: list | None = None
    adapter: AdapterSlot | None = None  # the request's LoRA adapter (SessionTable.admit), held for it


@dataclass(frozen=True)
class _Abort:
    session_id: int
    end: bool  # end the session too (``end``), not only its running turn (``abort``)


@dataclass(frozen=True)
class _Call:
    fn: object
    future: Future


class PytorchEngine(Engine):

    def __init__(self, model_dir: str, config: PytorchEngineConfig | None = None):
        cfg = config or PytorchEngineConfig()
        device = torch.device(cfg.device)
        if device.type == 'cuda' and not torch.cuda.is_available():
            raise ValueError(f"PytorchEngineConfig.device={cfg.device!r} is invalid: no CUDA device here; use 'cpu'")
        self.config = cfg
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        self.dtype = resolve_dtype(cfg.dtype, mc)
        self.device = device
        tp, world = cfg.tp, cfg.tp * cfg.pp
        check_parallel_config(cfg, mc)
        # each rank's threads: the cores shared out over the ranks unless num_threads says
        threads = cfg.num_threads or (max(1, (os.cpu_count() or 1) // world) if world > 1 else None)
        if threads is not None:
            torch.set_num_threads(threads)

        block_size = cfg.cache_block_seq_len
        self.executor = None  # the other tensor- and pipeline-parallel ranks (executor.py); None: this process alone
        if world > 1:
            from .executor import start_ranks
            num_blocks, session_len = self._cache_size(mc, tp)  # known to every rank before it loads
            self.executor, self.runner, self.model_format = start_ranks(model_dir, cfg, num_blocks, session_len,
                                                                        torch.get_num_threads())
        else:
            model, self.model_format = load_model(model_dir, mc, cfg.model_format, self.dtype, device,
                                                  cfg.kernel_backend)
            num_blocks, session_len = self._cache_size(mc, tp)  # of the memory the weights left
            model.build_rope(session_len)  # LongRoPE picks its factors by the longest sequence served
            self.runner = ModelRunner(model, num_blocks, block_size, device, cfg.quant_policy)
        self.session_len = session_len
        model = self.runner.model
        self.block_manager = BlockManager(num_blocks, block_size, cfg.enable_prefix_caching, window=mc.kv_window)
        self.scheduler = Scheduler(self.block_manager, cfg.max_batch_size,
                                   cfg.max_prefill_token_num or session_len)
        self.sampler = Sampler()
        self.proposer = build_proposer(cfg.speculative_config, session_len,
                                       lambda path: self._load_draft_model(path, session_len), num_blocks,
                                       block_size, device)
        self.model_info = ModelInfo(vocab_size=mc.vocab_size, session_len=session_len,
                                    eos_token_ids=mc.eos_token_ids, architecture=mc.architecture,
                                    model_format=self.model_format, hidden_size=mc.hidden_size)

        # engine thread only
        self._seqs: dict[int, Sequence] = {}   # every active or kept session
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._spec_counts = [0, 0, 0]  # drafts, drafted tokens, accepted tokens
        # sent after each iteration's bookkeeping: (callback, its loop or None, output)
        self._outbox: list[tuple[OutputCallback, asyncio.AbstractEventLoop | None, EngineOutput]] = []
        # shared with callers, behind _lock
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inbox: list = []
        self._sessions = SessionTable(mc.vocab_size, session_len)  # in-flight and kept sessions
        self._closing = False
        self._closed_why = ''  # why it closed, when not by close()
        self._stats = EngineStats(num_total_blocks=num_blocks, num_free_blocks=num_blocks)

        # The kernel library's thread pool runs the model's heavy work on the CPU (kernels 'native'): torch's
        # own ops on the engine thread (sampling, a drafted step's argmax, small tensors) then run on that
        # thread alone. An OpenMP team of torch's beside the pool's workers, spinning after its region, takes
        # their cores: a drafted step's [1 + k, vocab] argmax alone made every step ~1.6x slower.
        threads = torch.get_num_threads()
        self._torch_inline = device.type == 'cpu' and model.kernels.name == 'native' and threads > 1
        self._torch_inline_set = threading.Event()
        if device.type == 'cpu':
            # the engine thread gets its own OpenMP team; the loading thread's idle one would make
            # libgomp stop spinning between kernels (see lmd.kernels.release_openmp_threads)
            from lmd import kernels
            kernels.release_openmp_threads()
        self._thread = threading.Thread(target=self._loop, name='lmd-pytorch-engine', daemon=True)
        self._thread.start()
        if self._torch_inline:
            # torch.set_num_threads(1) on the engine thread also set the count threads started later
            # take; this thread's setting (the one it had) is that count again
            self._torch_inline_set.wait()
            torch.set_num_threads(threads)

    def _cache_size(self, mc: ModelConfig, tp: int) -> tuple[int, int]:
        """(KV blocks, session_len) of this engine's cache (``lmd.weights.memory.cache_size``, capped on a
        CPU): a rank's cache holds its KV heads, and on a CPU the ranks share the host's memory."""
        cfg, cpu = self.config, self.device.type == 'cpu'
        block_bytes = kv_block_bytes(shard_config(mc, 0, tp), cfg.cache_block_seq_len, self.dtype, cfg.quant_policy)
        max_bytes = cfg.max_cache_memory_gib * _GIB if cpu and cfg.max_cache_memory_gib is not None else None
        return cache_size(mc, cfg, block_bytes * (tp if cpu else 1), self.device, max_bytes)

    # ---- the Engine interface (any thread) -------------------------------------------------------------

    def add_request(self, request: EngineRequest, callback: OutputCallback,
                    loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._submit(request, callback, loop=loop)

    def abort(self, session_id: int) -> None:
        self._post(_Abort(session_id, end=False))

    def end(self, session_id: int) -> None:
        self._sessions.forget(session_id)
        self._post(_Abort(session_id, end=True))

    def stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:  # from a callback: the loop ends after this step
            self._thread.join()

    def get_logits(self, token_ids, adapter: str | None = None) -> torch.Tensor:
        """The Engine interface's scoring call: run on the engine thread between two steps (it alone
        runs the model), over a KV cache of the call's own (``ModelRunner.score``)."""
        ids = scored_token_ids(token_ids, self.model_info)
        return self._with_adapter(adapter, lambda slot: self.call_on_engine_thread(
            lambda engine: engine.runner.score(ids, slot).cpu(), timeout=None))

    def get_hidden_states(self, token_ids, adapter: str | None = None) -> torch.Tensor:
        """The Engine interface's embedding call: run as ``get_logits`` runs, the final norm's output in
        place of the logits (``ModelRunner.hidden_states``)."""
        ids = scored_token_ids(token_ids, self.model_info, 'get_hidden_states')
        return self._with_adapter(adapter, lambda slot: self.call_on_engine_thread(
            lambda engine: engine.runner.hidden_states(ids, slot).cpu(), timeout=None))

    def _with_adapter(self, name: str | None, fn):
        """fn(the adapter's slot, -1 for None), the adapter held (not unloaded) meanwhile."""
        if name is None:
            return fn(-1)
        table = self._sessions.adapters
        entry = table.acquire(name)
        try:
            return fn(entry.slot)
        finally:
            table.release(name)

    # ---- LoRA adapters (lora.py) ---------------------------------------------------------------------------

    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Converted here (the caller's thread); put in its slot and published on the engine thread, between
        steps, so no request can name it before its weights are in place."""
        check_fits(adapter, self.model_config)
        weights = self.runner.lora.prepare(adapter)

        def install(engine: 'PytorchEngine') -> None:
            entry = engine._sessions.adapters.add(adapter)  # ValueError: the name is taken
            engine.runner.lora.install(entry.slot, entry.uid, weights)
        self.call_on_engine_thread(install, timeout=None)

    def unload_adapter(self, name: str) -> None:
        def remove(engine: 'PytorchEngine') -> None:
            entry = engine._sessions.adapters.remove(name)  # ValueError: unknown, or in use
            engine.runner.lora.remove(entry.slot)
        self.call_on_engine_thread(remove, timeout=None)

    def adapter_names(self) -> list[str]:
        return self._sessions.adapters.names()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- debugging and test aids -------------------------------------------------------------------------

    def teacher_forced_logits(self, prompt_ids, forced_token_ids, session_id: int = -1,
                              timeout: float | None = 600) -> torch.Tensor:
        """float32 logits [len(forced_token_ids) + 1, V]: after the prompt, then after each forced token.

        Runs through the real path (scheduler, chunked prefill, paged decode steps,
        batching with whatever else is running); the forced tokens replace sampling.
        """
        sink: list = []
        done = threading.Event()
        result: list[EngineOutput] = []

        def callback(out: EngineOutput):
            if out.finish_reason is not None:
                result.append(out)
                done.set()

        request = EngineRequest(session_id=session_id, token_ids=tuple(prompt_ids),
                                sampling=SamplingParams(max_new_tokens=len(forced_token_ids) + 1))
        self._submit(request, callback, forced_token_ids=tuple(forced_token_ids), logits_sink=sink)
        if not done.wait(timeout):
            raise TimeoutError('teacher_forced_logits timed out')
        if result[0].finish_reason == 'error':
            raise RuntimeError(result[0].error)
        return torch.stack(sink)

    def call_on_engine_thread(self, fn, timeout: float | None = 60):
        """Run ``fn(engine)`` between two steps on the engine thread; returns its result."""
        future: Future = Future()
        self._post(_Call(fn, future))
        return future.result(timeout)

    def check_invariants(self) -> None:
        """Check the block accounting (on the engine thread, between steps); AssertionError if off."""
        def check(engine: 'PytorchEngine'):
            held = [s for s in engine._seqs.values() if s.block_ids]
            engine.block_manager.check_invariants(held)
        self.call_on_engine_thread(check)

    # ---- submitting ----------------------------------------------------------------------------------------

    def _post(self, message) -> None:
        with self._cond:
            if self._closing:
                if isinstance(message, _Abort):
                    return  # close() aborted everything already
                raise RuntimeError(f'the engine is closed{self._closed_why}')
            self._inbox.append(message)
            self._cond.notify()

    def _submit(self, request: EngineRequest, callback: OutputCallback, **hooks) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError(f'the engine is closed{self._closed_why}')
        adapter = self._sessions.admit(request, callback)
        with self._cond:
            if self._closing:
                self._sessions.withdraw(request.session_id)
                raise RuntimeError(f'the engine is closed{self._closed_why}')
            self._inbox.append(_Add(request, callback, adapter=adapter, **hooks))
            self._cond.notify()

    # ---- the engine thread ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        if self._torch_inline:
            torch.get_num_threads()  # torch's first call on a thread takes the process count: have it now
            torch.set_num_threads(1)
            self._torch_inline_set.set()
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._inbox or self._closing or self.scheduler.has_work):
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    closing = self._closing
                for message in inbox:
                    try:
                        self._handle(message)
                    except Exception:  # a bug in handling one message must not stop the engine
                        logger.exception('engine: handling %r failed', message)
                if closing:
                    self._shutdown()
                    return
                progressed = True
                if self.scheduler.has_work:
                    try:
                        progressed = self._step()
                    except Exception as e:
                        logger.exception('engine: scheduling failed')
                        self._fail_all(f'{type(e).__name__}: {e}')
                self._update_stats()
                self._flush_outbox()
                if not progressed:
                    with self._cond:  # nothing could run: wait for news instead of spinning
                        if not self._inbox and not self._closing:
                            self._cond.wait(0.01)

    def _handle(self, message) -> None:
        if isinstance(message, _Add):
            self._on_add(message)
        elif isinstance(message, _Abort):
            seq = self._seqs.get(message.session_id)
            if seq is None:
                return
            if message.end:
                seq.sequence_end = True
            if seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
                self._finish(seq, 'abort')
            elif message.end:
                self._finish(seq, None)
        elif isinstance(message, _Call):
            self._update_stats()
            try:
                message.future.set_result(message.fn(self))
            except Exception as e:
                message.future.set_exception(e)
                if isinstance(e, RankFailure):
                    self._lose_ranks(e)

    def _on_add(self, message: _Add) -> None:
        request = message.request
        sid = request.session_id
        seq = self._seqs.get(sid)
        if request.sequence_start or seq is None:
            if seq is not None:  # a new session under a kept one's id replaces it
                self.scheduler.finish(seq)
            if not request.sequence_start:  # ended between validation and now
                self._emit_final_orphan(message, 'error', f'session {sid} was ended')
                return
            seq = Sequence(sid, list(request.token_ids), request.sampling, None, message.callback,
                           request.sequence_end)
            if message.adapter is not None:
                seq.adapter_slot, seq.adapter_uid = message.adapter.slot, message.adapter.uid
            self._seqs[sid] = seq
            self.scheduler.add(seq)
        else:
            seq.start_turn(request.token_ids, request.sampling, None, message.callback, request.sequence_end)
            self.scheduler.resume(seq)
        seq.loop = message.loop
        seq.sampling_state = SamplingState(request.sampling, tuple(seq.token_ids), request.constraint)
        seq.forced_token_ids = list(message.forced_token_ids) if message.forced_token_ids is not None else None
        seq.logits_sink = message.logits_sink
        # prompt logprobs are read from the request's own prefill: no prefix hit for it
        wants = request.sampling.prompt_logprobs is not None
        seq.prompt_logprobs = [None] if wants else None
        seq.skip_reading_prefix_cache = wants
        self._num_prompt_tokens += len(request.token_ids)
        if request.sampling.max_new_tokens == 0 and seq.prompt_logprobs is None:
            self._finish(seq, 'length')  # with prompt logprobs it is prefilled first (_step)

    def _load_draft_model(self, model_dir: str, session_len: int):
        """A draft model (``SpeculativeConfig.model``) built as this engine's: its dtype, device and kernels."""
        mc = ModelConfig.from_dir(model_dir)
        if mc.vocab_size != self.model_config.vocab_size:
            raise ValueError(f'SpeculativeConfig.model={model_dir!r} is invalid: its vocabulary has {mc.vocab_size} '
                             f'tokens, the model\'s {self.model_config.vocab_size}; a draft model shares the tokenizer')
        model, _ = load_model(model_dir, mc, None, self.dtype, self.device, self.config.kernel_backend)
        model.build_rope(session_len)
        return model

    def _step(self) -> bool:
        start = time.perf_counter()
        if self.proposer is not None:
            self.proposer.draft(self.scheduler.running)
        out: SchedulerOutput = self.scheduler.schedule()
        for seq, why in out.failed:
            self._finish(seq, 'error', error=f'session {seq.session_id}: {why}')
        if out.is_empty:
            return bool(out.failed)
        try:
            logits, sample_rows, prompt_lps = self.runner.run(out)
            caught_up = [s for s, row in zip(out.seqs, sample_rows) if row >= 0]
            # a caught-up sequence has one logits row, or one per token of a drafted step (verified below);
            # a prefill-only request (max_new_tokens 0, for its prompt logprobs) samples nothing
            sampled, sampled_rows, drafted, num_rows = [], [], [], 0
            for s in caught_up:
                if s.draft_token_ids:
                    drafted.append((s, num_rows))
                elif s.sampling.max_new_tokens > 0:
                    sampled.append(s)
                    sampled_rows.append(num_rows)
                num_rows += 1 + len(s.draft_token_ids)
            sampled_logits = logits
            if sampled and len(sampled) < num_rows:
                sampled_logits = logits[torch.tensor(sampled_rows, dtype=torch.int64, device=logits.device)]
            if sampled:
                result = self.sampler.sample(sampled_logits, [s.sampling_state for s in sampled])
        except Exception as e:
            if isinstance(e, RankFailure):
                self._lose_ranks(e)
                return True
            logger.exception('engine: a step of %d sequences failed', len(out.seqs))
            for seq in out.seqs:
                self._finish(seq, 'error', error=f'{type(e).__name__}: {e}')
            return True
        self.scheduler.update(out)
        for seq, entries in zip(out.seqs, prompt_lps):
            if entries:
                seq.prompt_logprobs.extend(entries)
                if len(seq.prompt_logprobs) == seq.num_prompt_tokens:  # all read: the cache may serve it again
                    seq.skip_reading_prefix_cache = False
        for seq in caught_up:
            if seq.sampling.max_new_tokens == 0:
                self._finish(seq, 'length')
        if sampled:
            for i, seq in enumerate(sampled):
                self._on_token(seq, result.token_ids[i], result.logprobs[i], sampled_logits, i)
        # a decode-only step (each row a sequence's next token or a draft) teaches the proposer a row's cost
        decode_only = self.proposer is not None and num_rows == sum(out.num_scheduled_tokens)
        for seq, row in drafted:
            self._verify(seq, logits, row)
        if decode_only:
            self.proposer.observe_step(sum(out.num_scheduled_tokens), time.perf_counter() - start)
        return True

    def _verify(self, seq: Sequence, logits: torch.Tensor, row: int) -> None:
        """Take ``seq``'s tokens from its drafted step's rows ``row`` .. ``row + len(draft)`` (speculative.py):
        each chosen by the sampler from the request's state so far and handed on as any generated token,
        until one differs from the draft or the request ends; then keep the accepted drafts' KV."""
        draft = seq.draft_token_ids
        seq.draft_token_ids = ()
        state = seq.sampling_state
        greedy = state.greedy and not state.needs_processing() and seq.sampling.logprobs is None
        if greedy:  # the common case: every row's argmax at once
            targets = greedy_ids(logits[row:row + len(draft) + 1]).tolist()
        accepted = 0
        for j in range(len(draft) + 1):
            if greedy:
                token, logprobs = targets[j], None
            else:
                result = self.sampler.sample(logits[row + j:row + j + 1], [state])
                token, logprobs = result.token_ids[0], result.logprobs[0]
            self._on_token(seq, token, logprobs, logits, row + j)
            if j == len(draft) or token != draft[j] or seq.status is not SequenceStatus.RUNNING:
                break
            accepted += 1
        self.proposer.observe(seq, len(draft), accepted)
        counts = self._spec_counts
        counts[0] += 1
        counts[1] += len(draft)
        counts[2] += accepted
        self.scheduler.accept_drafts(seq, accepted)

    def _on_token(self, seq: Sequence, token: int, logprobs: dict | None, logits: torch.Tensor, row: int) -> None:
        if seq.logits_sink is not None:  # teacher forcing
            seq.logits_sink.append(logits[row].clone())
            if not seq.forced_token_ids:
                self._finish(seq, 'length')
                return
            token, logprobs = seq.forced_token_ids.pop(0), None
        sp = seq.sampling
        constraint = seq.sampling_state.constraint
        if token in sp.stop_token_ids and (seq.num_generated_tokens >= sp.min_new_tokens or constraint is not None):
            self._finish(seq, 'stop')  # the stop token is neither output nor kept in the session
            return
        if constraint is not None and seq.forced_token_ids is None:
            try:
                why = None if constraint.accept(token) else f'token {token} breaks the response_format grammar'
            except Exception as e:  # the grammar's own failure ends this request only
                why = f'the response_format grammar failed: {type(e).__name__}: {e}'
            if why is not None:
                self._finish(seq, 'error', error=f'session {seq.session_id}: {why}')
                return
            if token in constraint.stop_token_ids:  # the grammar is complete (a stop token the request ignores)
                self._finish(seq, 'stop')
                return
        seq.token_ids.append(token)
        seq.sampling_state.append(token)
        self._num_generated_tokens += 1
        if seq.num_generated_tokens >= sp.max_new_tokens or seq.num_tokens >= self.session_len:
            self._finish(seq, 'length', (token,), logprobs)
            return
        self._emit(seq, EngineOutput(
            session_id=seq.session_id, token_ids=(token,),
            logprobs=None if logprobs is None else (logprobs,),
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=self._take_prompt_logprobs(seq)))

    def _finish(self, seq: Sequence, reason, token_ids: tuple[int, ...] = (), logprobs: dict | None = None,
                error: str | None = None) -> None:
        """End ``seq``'s turn (reason None: end a kept session silently); an interactive session stays kept."""
        keep = not seq.sequence_end and reason in ('stop', 'length', 'abort')
        self.scheduler.finish(seq, keep=keep)
        sid = seq.session_id
        if not keep and self._seqs.get(sid) is seq:
            del self._seqs[sid]
        # before the callback: its caller may send the next turn at once
        self._sessions.finished(sid, seq.num_tokens if keep else None)
        if reason is None:
            return
        self._emit(seq, EngineOutput(
            session_id=sid, token_ids=token_ids, logprobs=None if logprobs is None else (logprobs,),
            finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, error=error, prompt_logprobs=self._take_prompt_logprobs(seq)))
        seq.callback = None

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> tuple | None:
        """The prompt logprobs for the request's first output once all are read (then forgotten: they go
        out once); None before, or if it did not ask."""
        lps = seq.prompt_logprobs
        if lps is None or len(lps) < seq.num_prompt_tokens:
            return None
        seq.prompt_logprobs = None
        return tuple(lps)

    def _emit(self, seq: Sequence, out: EngineOutput) -> None:
        self._outbox.append((seq.callback, seq.loop, out))

    def _emit_final_orphan(self, message: _Add, reason, error=None) -> None:
        sid = message.request.session_id
        self._sessions.withdraw(sid)
        self._outbox.append((message.callback, message.loop,
                             EngineOutput(session_id=sid, finish_reason=reason, error=error)))

    def _flush_outbox(self) -> None:
        outbox, self._outbox = self._outbox, []
        deliver(outbox)

    def _fail_all(self, error: str) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            try:
                self._finish(seq, 'error', error=error)
            except Exception:
                logger.exception('engine: failing session %d failed', seq.session_id)

    def _lose_ranks(self, error: RankFailure) -> None:
        """A parallel rank is gone: every request held ends with the error, and the engine closes."""
        logger.error('engine: %s', error)
        self._fail_all(str(error))
        with self._cond:
            self._closing = True
            self._closed_why = f': {error}'

    def _shutdown(self) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, 'abort')
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for message in inbox:  # arrived with close(): never started
            if isinstance(message, _Add):
                self._emit_final_orphan(message, 'abort')
            elif isinstance(message, _Call):
                message.future.set_exception(RuntimeError('the engine is closed'))
        self._update_stats()
        self._flush_outbox()
        if self.executor is not None:
            self.executor.close()

    def _update_stats(self) -> None:
        bm, sched = self.block_manager, self.scheduler
        self._stats = EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_total_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_blocks, num_prefix_hit_tokens=bm.num_prefix_hit_tokens,
            num_prefix_query_tokens=bm.num_prefix_query_tokens, num_preemptions=sched.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens, num_generated_tokens=self._num_generated_tokens,
            spec_num_drafts=self._spec_counts[0], spec_num_draft_tokens=self._spec_counts[1],
            spec_num_accepted_tokens=self._spec_counts[2])
