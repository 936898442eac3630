"""The Engine interface: token ids in, token ids out.

Both engines (``lmd.pytorch_backend`` and ``lmd.turbomind``) implement ``Engine``.
Everything about text (templates, detokenization, stop strings, ``n``) lives in
``AsyncEngine`` above, once.

Threading contract: an engine runs its batching loop in its own thread.
``add_request``, ``abort`` and ``end`` may be called from any thread and never
block on a model step. ``add_request`` validates the request at once and raises
``ValueError`` with a clear message; a request it accepted always ends with
exactly one ``EngineOutput`` whose ``finish_reason`` is set. A callback runs on an
engine thread and must only hand the output over (e.g. ``loop.call_soon_threadsafe``),
unless the request was added with a ``loop``: then it runs on that event loop's thread, and
each step's outputs reach the loop with one thread wake, not one per output or two (the
engine hands them over together, ``deliver``): on two cores a second woken thread takes a
core from the kernels' thread team every step. A request's outputs keep their order either
way.

Structured output: a request may carry a ``constraint`` (``lmd.guided.TokenConstraint``, made
fresh for that request). Each step the engine asks it for the tokens allowed next
(``fill_bitmask``: int32 words, bit ``t % 32`` of word ``t // 32``), sets every other logit to
-inf after penalties and masks, samples, and hands it the chosen token (``accept``). Logprobs stay
those of the raw logits. The constraint lives in the request's sampling state, so preemption by
recompute does not replay it. A stop token of the request ends it as usual; a token in
``constraint.stop_token_ids`` ends it with 'stop' too (the grammar is complete), and
``min_new_tokens`` does not hold back the stop tokens (the grammar decides when the text ends).
A token the constraint refuses ends the request with 'error'.

Prompt logprobs: a request with ``SamplingParams.prompt_logprobs`` gets, on its first output, one
entry per prompt token (``EngineOutput.prompt_logprobs``): the first None, nothing predicts it; the
others ``{token_id: logprob}``, the prompt's own token first, then the top-k alternatives, as
``logprobs`` are for generated tokens (log_softmax of the raw float32 logits). They come from the
request's own prefill, every prompt row of it, across chunked-prefill steps: such a request is not
served from the prefix cache (it skips reading it; its blocks still join it for others), and after
a preemption only the rows not yet read are taken again. With ``max_new_tokens=0`` it is prefilled
and then finishes with 'length', no token generated. A kept session's next turn
(``sequence_start=False``) cannot ask for them: its history is already in the cache.

Scoring: ``get_logits`` runs one token sequence teacher-forced, in one forward pass, over a KV
cache of the call's own, and returns every position's logits (``AsyncEngine.get_logits`` /
``get_ppl`` above it, ``lmd.lite.eval_ppl``). It may be called from any thread; it blocks for the
forward pass, and the requests in flight and the serving cache are left as they were. Logits,
not per-token NLLs, cross the interface: ``get_logits`` needs them anyway, both engines run in
this process so the tensor is handed over, not copied, and the NLL is then computed once, in
float64, by ``token_nll``, so both engines' perplexities come from the same arithmetic.

Embedding: ``get_hidden_states`` is the same pass, the same contract, without the head: every
position's final hidden state (after the model's final norm, before lm_head), which an embedder pools
(``lmd.embeddings``; ``AsyncEngine.embed`` and ``/v1/embeddings`` above it). So a server answers
embeddings beside the generations in flight, which it leaves untouched.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from abc import ABC, abstractmethod
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from .errors import PromptTooLongError
from .lora import AdapterSlot, AdapterTable
from .messages import FinishReason, GenerationConfig

if TYPE_CHECKING:
    import torch

    from .guided import TokenConstraint
    from .lora import LoraAdapter


@dataclass(frozen=True)
class SamplingParams:
    """What the engine needs to pick tokens; built from a ``GenerationConfig`` with ids resolved."""
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    random_seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()   # eos ids included unless ignore_eos
    bad_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None            # None: none; k: the chosen token's and the top-k alternatives'
    prompt_logprobs: int | None = None     # None: none; k: each prompt token's and the top-k alternatives'

    @staticmethod
    def from_generation_config(gen: GenerationConfig, eos_token_ids: tuple[int, ...] = (),
                               bad_token_ids: tuple[int, ...] = (), seed: int | None = None) -> 'SamplingParams':
        stop = tuple(gen.stop_token_ids or ())
        if not gen.ignore_eos:
            stop = stop + tuple(t for t in eos_token_ids if t not in stop)
        return SamplingParams(
            max_new_tokens=gen.max_new_tokens,
            min_new_tokens=gen.min_new_tokens,
            greedy=gen.greedy,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            min_p=gen.min_p,
            repetition_penalty=gen.repetition_penalty,
            presence_penalty=gen.presence_penalty,
            frequency_penalty=gen.frequency_penalty,
            random_seed=gen.random_seed if seed is None else seed,
            stop_token_ids=stop,
            bad_token_ids=tuple(gen.bad_token_ids or ()) + tuple(bad_token_ids),
            logprobs=gen.logprobs,
            prompt_logprobs=gen.prompt_logprobs,
        )


@dataclass(frozen=True)
class EngineRequest:
    """One generation request.

    An interactive session keeps its tokens and KV cache after a turn when
    ``sequence_end`` is False; the next request with the same ``session_id`` and
    ``sequence_start=False`` brings only the new prompt tokens of its turn.
    """
    session_id: int
    token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sequence_start: bool = True
    sequence_end: bool = True
    # structured output: the request's own grammar state (see the module docstring); one request only
    constraint: TokenConstraint | None = field(default=None, compare=False, repr=False)
    # a LoRA adapter loaded into the engine (Engine.load_adapter), by name; None: the base model. A kept
    # session's later turns name the same adapter as its first.
    adapter: str | None = None


@dataclass(frozen=True)
class EngineOutput:
    """New tokens of one request since its last output; ``finish_reason`` is set on its last."""
    session_id: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[dict[int, float], ...] | None = None  # one {token_id: logprob} per new token
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0   # tokens in the context before generation (a session's history included)
    num_cached_tokens: int = 0   # of those, how many came from the prefix cache or the session's kept cache
    error: str | None = None     # set with finish_reason 'error'
    # on the first output of a request with SamplingParams.prompt_logprobs: one entry per prompt token,
    # None for the first, {token_id: logprob} with the prompt's token first for the others
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None


OutputCallback = Callable[[EngineOutput], None]

logger = logging.getLogger('lmd')


def deliver(outputs: Sequence[tuple[OutputCallback, asyncio.AbstractEventLoop | None, EngineOutput]],
            here: asyncio.AbstractEventLoop | None = None) -> None:
    """Hand one step's outputs to their callbacks, in order: a callback without a loop is called
    here and now; those with a loop in one handoff per loop, through its ready queue (``call_soon``
    when ``here`` is that loop, so this thread is its thread; else ``call_soon_threadsafe``, which
    wakes it). Through the queue, never called directly, so that a request's outputs stay in order
    whichever thread hands them over, as long as the handoffs themselves come in order.
    A loop already closed has no one left to read its outputs: they are dropped."""
    batches: dict[asyncio.AbstractEventLoop, list] = {}
    for callback, loop, out in outputs:
        if loop is None:
            _call(callback, out)
        else:
            batches.setdefault(loop, []).append((callback, out))
    for loop, batch in batches.items():
        try:
            (loop.call_soon if loop is here else loop.call_soon_threadsafe)(_call_all, batch)
        except RuntimeError:  # closed
            logger.debug('dropped %d outputs for a closed event loop', len(batch))


def _call(callback: OutputCallback, out: EngineOutput) -> None:
    try:
        callback(out)
    except Exception:
        logger.exception('the output callback of session %d raised', out.session_id)


def _call_all(batch: list[tuple[OutputCallback, EngineOutput]]) -> None:
    for callback, out in batch:
        _call(callback, out)


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0      # free but holding a reusable prefix
    num_prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache, all time
    num_prefix_query_tokens: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    # speculative decoding, all time (vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens):
    # sequences drafted for, tokens drafted, drafted tokens the model accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        used = self.num_total_blocks - self.num_free_blocks - self.num_cached_blocks
        return used / self.num_total_blocks if self.num_total_blocks else 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What the layers above an engine need to know of the model it runs."""
    vocab_size: int
    session_len: int
    eos_token_ids: tuple[int, ...]
    architecture: str
    model_format: str = 'hf'  # how the weights run: 'hf' (float), 'gguf' or a quantized checkpoint's format
    hidden_size: int = 0      # the width of get_hidden_states' rows (an embedding's values)


class Engine(ABC):
    """A running inference engine; see the module docstring for the threading contract."""

    model_info: ModelInfo

    @abstractmethod
    def add_request(self, request: EngineRequest, callback: OutputCallback,
                    loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Queue a request; raise ``ValueError`` at once if it cannot be served. ``loop``: a running
        event loop whose thread the callback runs on (see the module docstring); None: an engine
        thread's."""

    @abstractmethod
    def abort(self, session_id: int) -> None:
        """Stop a request; its last output has finish_reason 'abort'. Unknown ids are ignored."""

    @abstractmethod
    def end(self, session_id: int) -> None:
        """Forget an interactive session and free its KV cache (aborting a running turn)."""

    @abstractmethod
    def stats(self) -> EngineStats:
        ...

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether the engine's threads are running (False once closed, or if one of them died)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the engine thread; pending requests finish with 'abort'."""

    @abstractmethod
    def get_logits(self, token_ids: Sequence[int], adapter: str | None = None) -> torch.Tensor:
        """Teacher-forced float32 logits [len(token_ids), vocab_size] on the CPU: row t is the
        distribution of the token after ``token_ids[:t + 1]``. One forward pass from an empty KV
        cache of this call's own (see the module docstring); ValueError for ids ``scored_token_ids``
        refuses. ``adapter``: a loaded LoRA adapter's name, applied for this pass."""

    @abstractmethod
    def get_hidden_states(self, token_ids: Sequence[int], adapter: str | None = None) -> torch.Tensor:
        """float32 [len(token_ids), hidden_size] on the CPU: row t is the final hidden state (after the
        model's final norm, before lm_head) of position t, run as ``get_logits`` runs it."""

    # -- LoRA adapters (lmd.lora): served beside the base model, chosen per request --------------------

    @abstractmethod
    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (``lmd.lora.load_lora_adapter``) under its name from now on; any thread,
        while requests run. ValueError when the name is taken or the adapter does not fit the model."""

    @abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name`` and free its weights; ValueError when it is not loaded
        or requests (or kept sessions) still use it."""

    @abstractmethod
    def adapter_names(self) -> list[str]:
        """The adapters loaded, in the order they were."""


def scored_token_ids(token_ids: Sequence[int], info: ModelInfo, caller: str = 'get_logits') -> list[int]:
    """``token_ids`` as a list of ints if ``get_logits`` (or ``get_hidden_states``, the ``caller``) can
    run them, else ValueError (TypeError for what is not a token id): not empty, inside the
    vocabulary, at most ``session_len`` long."""
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        raise TypeError(f'{caller} takes a sequence of int token ids') from None
    if not ids:
        raise ValueError(f'{caller}: the sequence is empty; send at least one token')
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= info.vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f'{caller}: token id {bad} is outside the vocabulary [0, {info.vocab_size})')
    if len(ids) > info.session_len:
        raise ValueError(f'{caller}: {len(ids)} tokens are more than session_len={info.session_len}; send '
                         'shorter sequences, or raise session_len in the engine config')
    return ids


def token_nll(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """float64 [n - 1]: -log p(token_ids[t + 1] | token_ids[:t + 1]) from ``get_logits``' rows
    [n, vocab_size], the log-softmax taken in float64; the one definition behind every perplexity."""
    import torch
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -logprobs.gather(1, torch.tensor(list(token_ids[1:]), dtype=torch.int64)[:, None])[:, 0]


class SessionTable:
    """The request checks every engine runs in ``add_request``, and the session state they need:
    which sessions have a turn in flight, and which interactive sessions are kept (with the
    length of the context they hold). Thread-safe.

    It owns lmd's one prompt-length check (``PromptTooLongError``): only here is a kept session's
    history known, and every caller, ``AsyncEngine`` and the servers included, comes through it."""

    def __init__(self, vocab_size: int, session_len: int, adapters: AdapterTable | None = None):
        self.vocab_size = vocab_size
        self.session_len = session_len
        self.adapters = adapters if adapters is not None else AdapterTable()
        self._lock = threading.Lock()
        self._active: set[int] = set()
        self._kept: dict[int, int] = {}
        self._adapter_of: dict[int, str] = {}  # sessions in flight or kept that run an adapter: its name

    def admit(self, request: EngineRequest, callback) -> AdapterSlot | None:
        """Raise ValueError (TypeError for wrong types) unless ``request`` can be served; else mark it in
        flight, and return its adapter's slot (None: the base model), held until the session is done."""
        if not isinstance(request, EngineRequest):
            raise TypeError(f'add_request expects an EngineRequest, got {type(request).__name__}')
        if not callable(callback):
            raise TypeError('add_request needs a callable callback')
        sid, ids = request.session_id, request.token_ids
        if not ids:
            raise ValueError(f'session {sid}: the prompt is empty; send at least one token')
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f'session {sid}: token id {bad} is outside the vocabulary [0, {self.vocab_size})')
        k = request.sampling.prompt_logprobs
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20:
                raise ValueError(f'session {sid}: prompt_logprobs={k!r} is invalid: expected an integer in [0, 20]')
            if not request.sequence_start:
                raise ValueError(f'session {sid}: prompt_logprobs needs a new sequence (sequence_start=True): a '
                                 'kept session\'s history is already in the cache, its logits are gone')
        c = request.constraint
        if c is not None:
            if not (callable(getattr(c, 'fill_bitmask', None)) and callable(getattr(c, 'accept', None))):
                raise TypeError(f'session {sid}: constraint must be a TokenConstraint (fill_bitmask, accept), '
                                f'got {type(c).__name__}')
            if getattr(c, 'vocab_size', None) != self.vocab_size:
                raise ValueError(f'session {sid}: the constraint was built for a vocabulary of '
                                 f'{getattr(c, "vocab_size", None)} tokens; the model has {self.vocab_size}')
        with self._lock:
            if sid in self._active:
                raise ValueError(f'session {sid} already has a request in flight; wait for it to finish or abort it')
            history = 0
            if not request.sequence_start:
                if sid not in self._kept:
                    raise ValueError(f'session {sid} is unknown: sequence_start=False continues a session kept '
                                     'by an earlier request with sequence_end=False')
                history = self._kept[sid]
            if history + len(ids) >= self.session_len:  # the one prompt-length check of lmd
                raise PromptTooLongError(sid, len(ids), history, self.session_len)
            held = self._adapter_of.get(sid)
            if request.sequence_start:
                slot = self.adapters.acquire(request.adapter) if request.adapter is not None else None
                if held is not None:  # a kept session started over: its old adapter is let go
                    self.adapters.release(held)
                    del self._adapter_of[sid]
                if slot is not None:
                    self._adapter_of[sid] = slot.name
            elif request.adapter != held:
                raise ValueError(f'session {sid} runs adapter {held!r}; its later turns cannot switch to '
                                 f'{request.adapter!r} (its kept cache was computed with the first)')
            else:
                slot = self.adapters.get(held) if held is not None else None
            self._active.add(sid)
            return slot

    def withdraw(self, session_id: int) -> None:
        """An admitted request that never reached the engine."""
        with self._lock:
            self._active.discard(session_id)
            self._let_go(session_id)

    def finished(self, session_id: int, kept_tokens: int | None) -> None:
        """A turn ended; ``kept_tokens``: the context a kept session now holds (None: not kept)."""
        with self._lock:
            self._active.discard(session_id)
            if kept_tokens is None:
                self._kept.pop(session_id, None)
                self._let_go(session_id)
            else:
                self._kept[session_id] = kept_tokens

    def forget(self, session_id: int) -> None:
        with self._lock:
            self._kept.pop(session_id, None)
            self._let_go(session_id)

    def _let_go(self, session_id: int) -> None:
        """The session's adapter is released once the session is neither in flight nor kept."""
        if session_id not in self._active and session_id not in self._kept and session_id in self._adapter_of:
            self.adapters.release(self._adapter_of.pop(session_id))
