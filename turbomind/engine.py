"""``TurbomindEngine``: lmd's Engine interface over TurboMind's C++ engine.

The C++ side owns everything per step: the request queue, the batching thread, the
block manager with its prefix cache, the model and its KV cache, and sampling. A request's
structured-output constraint (``lmd.guided``) goes in with it; the engine thread takes the GIL
once a step to ask all constrained rows for their bitmasks, and once to hand them their tokens.
This wrapper checks requests before they go in (one clear ``ValueError`` each) and hands each
output to its request's callback, in order. The C++ engine signals an eventfd once a step that
made outputs (``outputs_fd``): a request added with an event loop has that loop watch it
(``loop.add_reader``), so the step's outputs reach the loop with one thread wake and no thread
in between. Requests without a loop are served by a reader thread that waits on the same fd
(without the GIL); it runs only while such requests are in flight, or while no loop watches.
Speculative decoding (``speculative_config``: method 'ngram', or 'draft_target' with a draft model
built here as the model is and handed to C++) runs inside the C++ engine, drafts and verification
alike (turbomind/README.md); its counters come with ``stats()``. LoRA adapters
(``load_adapter``) live in the C++ model's slots; a request names one (``EngineRequest.adapter``) and
its rows run it, its prefix-cache keys salted with the adapter's load.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import os
import select
import threading
import weakref

import torch

from lmd.engine import (Engine, EngineOutput, EngineRequest, EngineStats, ModelInfo, OutputCallback, SessionTable,
                        deliver, scored_token_ids)
from lmd.errors import ModelFormatError
from lmd.lora import LoraAdapter
from lmd.messages import SpeculativeConfig, TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.weights.dtype import resolve_dtype
from lmd.weights.memory import cache_size, kv_block_bytes
from lmd.weights.turbomind_layout import load_fused

from lmd import kernels

from . import _turbomind
from .model import TurbomindModel

logger = logging.getLogger('lmd.turbomind')

# On a CPU, "free memory" is the host's RAM: cap what cache_max_entry_count may take of it.
MAX_CPU_CACHE_BYTES = 4 << 30


class TurbomindEngine(Engine):
    """``model_dir``: an HF directory (float, AWQ or W8A8 checkpoint, GGUF conversion) or one in
    TurboMind's own layout; ``config.model_format`` None reads each as it is
    (``lmd.weights.turbomind_layout.load_fused``)."""

    def __init__(self, model_dir: str, config: TurbomindEngineConfig | None = None):
        cfg = config or TurbomindEngineConfig()
        if cfg.tp != 1:
            raise ValueError(f'TurbomindEngineConfig.tp={cfg.tp} is invalid: TurboMind runs on one device (tp=1)')
        spec = cfg.speculative_config
        if spec is not None and spec.method not in ('ngram', 'draft_target'):
            raise ValueError(f'TurbomindEngineConfig.speculative_config.method={spec.method!r} is not supported by '
                             "TurboMind: use method='ngram' or 'draft_target'")
        if cfg.device != 'cpu':
            raise ValueError(f"TurbomindEngineConfig.device={cfg.device!r} is invalid: this build of TurboMind has "
                             "CPU kernels only; use device='cpu'")
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        kernels.ops.set_num_threads(torch.get_num_threads())
        _turbomind.set_num_threads(torch.get_num_threads())  # its own copy of the kernels
        self.config = cfg
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        self.dtype = resolve_dtype(cfg.dtype, mc)

        block_size = cfg.cache_block_seq_len
        num_blocks, session_len = cache_size(mc, cfg, kv_block_bytes(mc, block_size, self.dtype, cfg.quant_policy),
                                             torch.device('cpu'), MAX_CPU_CACHE_BYTES)
        self.session_len = session_len

        # float, GGUF (its 4-bit matmuls and Q8_0 head as they are), AWQ, W8A8, or TurboMind's own layout
        tensors, self.model_format = load_fused(model_dir, mc, self.dtype, cfg.model_format)
        try:
            self.model = TurbomindModel.from_fused(mc, tensors, self.dtype, num_blocks, block_size,
                                                   cfg.quant_policy, cfg.int8_activations, session_len)
        except ValueError as e:  # a tensor the C++ model cannot take
            raise ModelFormatError(f'{model_dir}: {e}') from None
        del tensors
        # the draft model (method 'draft_target'), built as this one, over a KV cache of as many blocks
        self.draft_model = None
        if spec is not None and spec.method == 'draft_target':
            self.draft_model = self._load_draft_model(spec.model, num_blocks, block_size, session_len)
        # torch's OpenMP workers from loading would sit idle beside the engine thread's and make
        # libgomp stop spinning between kernels (it throttles once it manages more threads than
        # CPUs): let them go; torch starts them again if it needs them
        kernels.release_openmp_threads()
        seed = int.from_bytes(os.urandom(8), 'little')
        self.cpp = _turbomind.Engine(self.model.cpp, cfg.max_batch_size, cfg.max_prefill_token_num or session_len,
                                     session_len, cfg.enable_prefix_caching, seed, window=mc.kv_window,
                                     draft_model=None if self.draft_model is None else self.draft_model.cpp,
                                     **_speculative_kwargs(spec))
        self.model_info = ModelInfo(vocab_size=mc.vocab_size, session_len=session_len,
                                    eos_token_ids=mc.eos_token_ids, architecture=mc.architecture,
                                    model_format=self.model_format, hidden_size=mc.hidden_size)
        self._sessions = SessionTable(mc.vocab_size, session_len)
        self._adapters = self._sessions.adapters  # lmd.lora.AdapterTable: names, slots, uids, who uses them
        self._adapter_lock = threading.Lock()  # loads and unloads one at a time (load_adapter)
        self._lock = threading.Lock()
        self._callbacks: dict[int, tuple[OutputCallback, asyncio.AbstractEventLoop | None]] = {}  # behind _lock
        self._num_threaded = 0  # requests in flight without a loop: the reader thread serves them
        self._reader: threading.Thread | None = None
        self._wake_reader = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # to look again: closed, or not needed
        self._watcher: asyncio.AbstractEventLoop | None = None  # the loop watching outputs_fd
        # one taker of outputs at a time, handing them over before the next takes: keeps them in order
        self._take_lock = threading.RLock()
        self._closed = False
        # An engine still open at interpreter exit is closed before teardown: its output thread,
        # waiting without the GIL, would otherwise wake into a finalizing interpreter.
        ref = weakref.ref(self)
        atexit.register(lambda: (engine := ref()) is not None and engine.close())

    def _load_draft_model(self, path: str, num_blocks: int, block_size: int, session_len: int) -> TurbomindModel:
        """The draft model of ``SpeculativeConfig(method='draft_target', model=path)``: any directory or GGUF
        file this engine runs, read as it is (its own format: a GGUF drafting for a float model keeps its
        4-bit matmuls), in this engine's dtype, KV-cache policy and activations. Its cache has the target's
        block count and block size, so whatever context fits the target's cache fits the draft's (in the
        draft's bytes per block: a smaller model's cache is smaller)."""
        from lmd.model_path import prepare_model_dir
        model_dir = prepare_model_dir(path)
        dmc = ModelConfig.from_dir(model_dir)
        if dmc.vocab_size != self.model_config.vocab_size:
            raise ValueError(f'SpeculativeConfig.model={path!r} is invalid: its vocabulary has {dmc.vocab_size} '
                             f'tokens, the model\'s {self.model_config.vocab_size}; a draft model shares the tokenizer')
        cfg = self.config
        tensors, _ = load_fused(model_dir, dmc, self.dtype, None)
        try:
            return TurbomindModel.from_fused(dmc, tensors, self.dtype, num_blocks, block_size, cfg.quant_policy,
                                             cfg.int8_activations, session_len)
        except ValueError as e:
            raise ModelFormatError(f'{model_dir} (the draft model): {e}') from None

    # ---- the Engine interface (any thread) ------------------------------------------------------------

    def add_request(self, request: EngineRequest, callback: OutputCallback,
                    loop: asyncio.AbstractEventLoop | None = None) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError('the engine is closed')
        adapter = self._sessions.admit(request, callback)
        sp = request.sampling
        with self._lock:
            self._callbacks[request.session_id] = (callback, loop)
            if loop is None:
                self._num_threaded += 1
                if self._reader is None:
                    self._reader = threading.Thread(target=self._read_outputs, name='lmd-turbomind-outputs',
                                                    daemon=True)
                    self._reader.start()
        if loop is not None and loop is not self._watcher:
            self._watch(loop)
        try:
            self.cpp.add(request.session_id, list(request.token_ids), sp.max_new_tokens, sp,
                         request.sequence_start, request.sequence_end, request.constraint,
                         adapter_slot=-1 if adapter is None else adapter.slot,
                         adapter_uid=0 if adapter is None else adapter.uid)
        except BaseException:
            with self._lock:
                self._callbacks.pop(request.session_id, None)
                self._num_threaded -= loop is None
            self._sessions.withdraw(request.session_id)
            raise

    def abort(self, session_id: int) -> None:
        self.cpp.abort(session_id)

    def end(self, session_id: int) -> None:
        self._sessions.forget(session_id)
        self.cpp.end(session_id)

    def stats(self) -> EngineStats:
        return EngineStats(**self.cpp.stats())

    def is_alive(self) -> bool:
        # the C++ engine thread runs until close(); a reader thread ends only when not needed
        reader = self._reader
        return not self.cpp.closed and (reader is None or reader.is_alive())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            reader = self._reader
        self.cpp.close()
        os.eventfd_write(self._wake_reader, 1)  # a loop may have taken the last outputs before it looked
        if reader is None or threading.current_thread() is not reader:
            if reader is not None:
                reader.join()
            os.close(self._wake_reader)  # no reader left to wait on it
        with self._take_lock:  # the last outputs (aborts), for the loops' requests
            self._hand_over(self.cpp.take_outputs(), _running_loop())
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            self._unwatch(watcher)

    def get_logits(self, token_ids, adapter: str | None = None) -> torch.Tensor:
        """The Engine interface's scoring call: one forward on the calling thread, beside the engine's,
        over a twin of the model with a KV cache of its own (the weights and adapters shared), dropped after."""
        return self._run_alone(scored_token_ids(token_ids, self.model_info), 'forward', adapter)

    def get_hidden_states(self, token_ids, adapter: str | None = None) -> torch.Tensor:
        """The Engine interface's embedding call: as ``get_logits``, the final norm's output in place
        of the logits (the C++ ``hidden_states``, the same pass without the head)."""
        return self._run_alone(scored_token_ids(token_ids, self.model_info, 'get_hidden_states'), 'hidden_states',
                               adapter)

    def _run_alone(self, ids: list[int], method: str, adapter: str | None) -> torch.Tensor:
        """``ids`` as one sequence through the twin model's ``method``, every row kept; the adapter
        ``adapter`` is held (not unloadable) for the call."""
        n, block_size = len(ids), self.model.block_size
        num_blocks = -(-n // block_size)
        entry = self._adapters.acquire(adapter) if adapter is not None else None
        try:
            scorer = self.model.with_own_cache(num_blocks)
            # one sequence in blocks 0, 1, ... in order: token t sits in slot t and sees tokens 0..t
            rows = torch.arange(n)
            tables = torch.arange(num_blocks, dtype=torch.int32).expand(n, -1).contiguous()
            row_adapters = None if entry is None else torch.full((n,), entry.slot, dtype=torch.int32)
            return getattr(scorer, method)(torch.tensor(ids), rows, rows, tables, (rows + 1).to(torch.int32), rows,
                                           row_adapters)
        finally:
            if entry is not None:
                self._adapters.release(entry.name)

    # ---- LoRA adapters (lmd.lora): their weights in the C++ model's slots, any thread ----------------

    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` from now on: its weights go into the C++ model's free slot first, then its
        name into the table, so a request naming it never runs before its weights are in. Loads and
        unloads take turns (``_adapter_lock``); steps running meanwhile take the C++ slots' mutex once
        each (``AdapterSlots``)."""
        with self._adapter_lock:
            if adapter.name in self._adapters.names():
                raise ValueError(f'an adapter named {adapter.name!r} is already loaded; unload it first')
            # the slot AdapterTable.add picks: the smallest one no loaded adapter holds
            used = {self._adapters.get(name).slot for name in self._adapters.names()}
            slot = next(i for i in range(len(used) + 1) if i not in used)
            self.model.set_adapter(slot, adapter)
            try:
                entry = self._adapters.add(adapter)
                if entry.slot != slot:  # AdapterTable's rule changed under us: a bug, not bad input
                    self._adapters.remove(adapter.name)
                    raise RuntimeError(f'adapter {adapter.name!r} got slot {entry.slot}, its weights are in {slot}')
            except BaseException:
                self.model.clear_adapter(slot)
                raise

    def unload_adapter(self, name: str) -> None:
        with self._adapter_lock:
            entry = self._adapters.remove(name)  # ValueError while requests or kept sessions use it
            self.model.clear_adapter(entry.slot)

    def adapter_names(self) -> list[str]:
        return self._adapters.names()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- outputs: taken by the loop watching outputs_fd, or the reader thread --------------------------

    def _hand_over(self, batch: list, here: asyncio.AbstractEventLoop | None) -> None:
        """One take of outputs (``cpp.take_outputs``) to their callbacks; under ``_take_lock``."""
        outputs = []
        for sid, token_ids, logprobs, finish, n_prompt, n_cached, n_context, kept, error, prompt_lps in batch:
            if finish is not None:  # before the callback: its caller may send the next turn at once
                self._sessions.finished(sid, n_context if kept else None)
                with self._lock:
                    callback, loop = self._callbacks.pop(sid, (None, None))
                    self._num_threaded -= callback is not None and loop is None
            else:
                with self._lock:
                    callback, loop = self._callbacks.get(sid, (None, None))
            if callback is None:
                continue
            outputs.append((callback, loop, EngineOutput(
                session_id=sid, token_ids=token_ids, logprobs=None if logprobs is None else tuple(logprobs),
                finish_reason=finish, num_prompt_tokens=n_prompt, num_cached_tokens=n_cached, error=error,
                prompt_logprobs=None if prompt_lps is None else tuple(prompt_lps))))
        deliver(outputs, here)

    def _take(self, here: asyncio.AbstractEventLoop | None = None) -> None:
        with self._take_lock:
            self._hand_over(self.cpp.take_outputs(), here)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make ``loop`` the one watching outputs_fd (add_reader on its own thread, or while it is not running)."""
        if _running_loop() is not loop and loop.is_running():
            loop.call_soon_threadsafe(self._watch, loop)
            return
        with self._lock:
            if self._closed or self._watcher is loop:
                return
            old, self._watcher = self._watcher, loop
            os.eventfd_write(self._wake_reader, 1)  # a reader serving no request leaves now (close() shuts the fd)
        loop.add_reader(self.cpp.outputs_fd, self._take, loop)  # outputs made meanwhile keep the fd readable
        if old is not None:
            self._unwatch(old)

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop.is_closed():
            return
        if _running_loop() is not loop and loop.is_running():
            loop.call_soon_threadsafe(self._unwatch, loop)
        elif self._watcher is not loop:  # it may have been chosen again since
            loop.remove_reader(self.cpp.outputs_fd)

    def _read_outputs(self) -> None:
        """The reader thread: serves requests without a loop, and every request while no loop
        watches; ends when neither is left (add_request starts another when needed)."""
        fds = [self.cpp.outputs_fd, self._wake_reader]
        while True:
            ready, _, _ = select.select(fds, [], [], 0.5)  # the GIL is let go while it waits
            if self._wake_reader in ready:
                os.eventfd_read(self._wake_reader)
            closed = self.cpp.closed  # before the take: a closed engine's last outputs are in it
            self._take()
            with self._lock:
                if closed or (self._num_threaded == 0 and self._watcher is not None):
                    self._reader = None
                    return


def _speculative_kwargs(spec: SpeculativeConfig | None) -> dict:
    """The C++ engine's speculative-decoding settings (none: off; the draft model goes separately)."""
    if spec is None:
        return {}
    return dict(num_speculative_tokens=spec.num_speculative_tokens, prompt_lookup_min=spec.prompt_lookup_min,
                prompt_lookup_max=spec.prompt_lookup_max, adaptive_draft_length=spec.adaptive_draft_length)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
