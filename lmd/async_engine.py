"""AsyncEngine: text in, streamed text out, over either engine.

It owns everything about text, once: chat templates, tokenization,
incremental detokenization, stop strings, ``n`` and interactive sessions.
Engines below it see token ids only (``lmd.engine.Engine``); their outputs come
back on the caller's event loop, each step's in one wake (``Engine.add_request``'s ``loop``).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, AsyncIterator

from .backend import CONFIGS, resolve_backend
from .chat_template import get_chat_template, to_messages
from .dp_engine import DataParallelEngine, replica_configs
from .embeddings import PoolerConfig, embedding, pooler_config_from_dir
from .engine import Engine, EngineOutput, EngineRequest, EngineStats, SamplingParams, token_nll
from .errors import InputTooLongError
from .guided import constraint_for
from .messages import (ChatTemplateConfig, EngineConfig, GenerationConfig, PytorchEngineConfig, Response,
                       TurbomindEngineConfig)
from .lora import load_lora_adapter
from .model_config import ModelConfig
from .model_path import prepare_model_dir
from .tokenizer import DetokenizeState, StopStringMatcher, Tokenizer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger('lmd')


def build_engine(model_dir: str, backend: str | None,
                 backend_config: PytorchEngineConfig | TurbomindEngineConfig | EngineConfig | None) -> Engine:
    """The engine for ``backend``: 'turbomind', 'pytorch', or 'auto' (None alike), which picks by the
    config's type and, without one, TurboMind where it runs the model (``lmd.backend``). The choice
    is logged once at INFO: the commands show it at start. With ``dp > 1``, a ``DataParallelEngine``
    over that many of them."""
    backend, why = resolve_backend(model_dir, backend, backend_config)
    config_type = CONFIGS[backend]
    if backend_config is None:
        backend_config = config_type()
    elif type(backend_config) is EngineConfig:  # the shared fields alone: they suit either engine
        # field by field, not asdict: a nested config (speculative_config) stays the dataclass it is
        backend_config = config_type(**{f.name: getattr(backend_config, f.name) for f in fields(backend_config)})
    if not isinstance(backend_config, config_type):
        raise ValueError(f'backend {backend} needs a {config_type.__name__}, got {type(backend_config).__name__}')
    logger.info('engine %s (%s)%s', backend, why, f', {backend_config.dp} replicas' if backend_config.dp > 1 else '')
    if backend == 'turbomind':
        from .turbomind.engine import TurbomindEngine as engine_type
    else:
        from .pytorch_backend import PytorchEngine as engine_type
    if backend_config.dp > 1:  # data parallel: dp whole engines behind one interface (lmd.dp_engine)
        return DataParallelEngine(replica_configs(backend_config), lambda config: engine_type(model_dir, config))
    return engine_type(model_dir, backend_config)


def _id_batch(input_ids, min_len: int) -> list[list[int]]:
    """``input_ids`` (one sequence of token ids, or a list of them) as a list of sequences."""
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        raise ValueError('input_ids must be a non-empty list of token ids, or a list of such lists')
    batch = [input_ids] if not isinstance(input_ids[0], (list, tuple)) else list(input_ids)
    for i, ids in enumerate(batch):
        if not isinstance(ids, (list, tuple)) or len(ids) < min_len:
            raise ValueError(f'input_ids[{i}] must be a list of at least {min_len} token id'
                             f'{"s" if min_len > 1 else ""}')
    return [list(ids) for ids in batch]


def _is_ids(x) -> bool:
    """Whether ``x`` is a list of int token ids (an empty one too)."""
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


@dataclass
class Session:
    """An interactive conversation whose KV cache the engine keeps between turns."""
    session_id: int
    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # what the engine holds for it
    started: bool = False


@dataclass(frozen=True)
class ChatPrompt:
    """A chat as the engine takes it (``AsyncEngine.encode_chat``)."""
    input_ids: tuple[int, ...]
    text: str | None  # the rendered template (a reasoning parser reads how it ends); None: no template


class AsyncEngine:

    def __init__(self, model_path: str | None = None, backend: str | None = None,
                 backend_config: PytorchEngineConfig | TurbomindEngineConfig | None = None,
                 chat_template_config: ChatTemplateConfig | None = None):
        self.model_dir = prepare_model_dir(model_path)
        self.tokenizer = Tokenizer(self.model_dir)
        self.chat_template = get_chat_template(self.tokenizer, chat_template_config)
        self.engine = build_engine(self.model_dir, backend, backend_config)
        self._adapter_paths: dict[str, str] = {}  # the LoRA adapters loaded, name -> folder
        try:
            for name, path in ((backend_config.adapters if backend_config is not None else None) or {}).items():
                self.load_adapter(name, path)
        except BaseException:
            self.engine.close()
            raise
        self.model_info = self.engine.model_info
        self.session_len = self.model_info.session_len
        eos = set(self.model_info.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        # single-token stop words of the template (e.g. <|im_end|>) stop in the engine, cheaply
        eos |= set(self.tokenizer.token_ids_of_words(self.chat_template.stop_words))
        self.eos_token_ids = tuple(sorted(eos))
        self._ids = itertools.count(1 << 32)  # request ids, above any user session id
        self._ids_lock = threading.Lock()
        self._pooler_config: PoolerConfig | None = None

    # ---- LoRA adapters ---------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter in folder ``path`` as ``name`` (``lmd.lora``); LoraError (a
        ModelFormatError) when it does not fit the model, ValueError when the name is taken."""
        adapter = load_lora_adapter(path, ModelConfig.from_dir(self.model_dir), name)
        self.engine.load_adapter(adapter)
        self._adapter_paths[name] = adapter.path

    def unload_adapter(self, name: str) -> None:
        """ValueError when ``name`` is not loaded or requests still use it."""
        self.engine.unload_adapter(name)
        self._adapter_paths.pop(name, None)

    @property
    def adapter_names(self) -> list[str]:
        return self.engine.adapter_names()

    def adapter_path(self, name: str) -> str | None:
        """The folder the adapter ``name`` was loaded from."""
        return self._adapter_paths.get(name)

    def next_session_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    # ---- text -> ids ---------------------------------------------------------------------

    def render(self, prompt: str | list[dict], do_preprocess: bool = True) -> str:
        """The prompt as the model sees it: the chat template applied unless ``do_preprocess`` is False."""
        if not do_preprocess:
            if not isinstance(prompt, str):
                raise ValueError('a raw prompt (do_preprocess=False) must be a string')
            return prompt
        return self.chat_template.render(to_messages(prompt), add_generation_prompt=True)

    def encode(self, prompt: str | list[dict], do_preprocess: bool = True) -> list[int]:
        text = self.render(prompt, do_preprocess)
        # a rendered template already carries its own BOS where the model wants one
        return self.tokenizer.encode(text, add_special_tokens=not do_preprocess)

    def encode_chat(self, messages: str | list[dict], *, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None, do_preprocess: bool = True) -> ChatPrompt:
        """A chat rendered and tokenized, as a server takes it: the template applied with ``tools``
        (OpenAI tool dicts) and ``chat_template_kwargs`` (a Jinja template's variables, e.g.
        ``enable_thinking``). Without ``do_preprocess`` the messages' text is joined as it is and
        tokenized with the model's BOS. ValueError for bad messages; TypeError for arguments the
        template does not take."""
        messages = to_messages(messages)
        if not do_preprocess:
            text = ''.join(m['content'] if isinstance(m['content'], str) else '' for m in messages)
            return ChatPrompt(tuple(self.tokenizer.encode(text, add_special_tokens=True)), None)
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs['tools'] = list(tools)
        text = self.chat_template.render(messages, add_generation_prompt=True, **kwargs)
        # a rendered template already carries its own BOS where the model wants one
        return ChatPrompt(tuple(self.tokenizer.encode(text, add_special_tokens=False)), text)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` tokenized as it is, no template; ``add_special_tokens`` adds the model's BOS."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def sampling_params(self, gen: GenerationConfig, seed: int | None = None) -> SamplingParams:
        bad = tuple(self.tokenizer.token_ids_of_words(gen.bad_words)) if gen.bad_words else ()
        return SamplingParams.from_generation_config(gen, self.eos_token_ids, bad, seed=seed)

    # ---- generation ----------------------------------------------------------------------

    async def generate(self, prompt: str | list[dict] | None, session_id: int | None = None,
                       gen_config: GenerationConfig | None = None, *, input_ids: list[int] | None = None,
                       stream_response: bool = True, do_preprocess: bool = True,
                       sequence_start: bool = True, sequence_end: bool = True,
                       index: int = 0, seed: int | None = None,
                       engine_ids: list[int] | None = None,
                       adapter_name: str | None = None) -> AsyncIterator[Response]:
        """Generate one answer; yields a Response per new piece (or one at the end).

        ``input_ids`` replaces ``prompt`` with token ids. With ``sequence_start=False``
        the ids extend the session's kept history (see ``Session``). ``engine_ids``, when
        given, receives every token the engine appended to the session (stop tokens too).
        ``adapter_name``: a loaded LoRA adapter (``load_adapter``) answers instead of the base model.
        """
        gen = gen_config or GenerationConfig()
        if input_ids is None:
            if prompt is None:
                raise ValueError('either prompt or input_ids is required')
            input_ids = self.encode(prompt, do_preprocess)
        if session_id is None:
            session_id = self.next_session_id()
        request = EngineRequest(session_id=session_id, token_ids=tuple(input_ids),
                                sampling=self.sampling_params(gen, seed),
                                sequence_start=sequence_start, sequence_end=sequence_end,
                                constraint=constraint_for(self, gen.response_format),  # a fresh one per sample
                                adapter=adapter_name)

        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        # the engine runs the callback on this loop's thread, a step's outputs in one wake
        self.engine.add_request(request, queue.put_nowait, loop=asyncio.get_running_loop())  # ValueError: bad input
        stops = StopStringMatcher(gen.stop_words, gen.include_stop_str_in_output)
        state = DetokenizeState()
        token_ids: list[int] = []
        logprobs: list[dict[int, float]] | None = [] if gen.logprobs is not None else None
        pending_text, pending_ids, pending_lp = '', [], []
        prompt_lp = None  # the prompt logprobs (GenerationConfig.prompt_logprobs), until the first piece takes them
        num_prompt, num_cached = len(input_ids), 0
        finished = engine_done = False
        try:
            while not finished:
                out = await queue.get()
                engine_done = out.finish_reason is not None
                if engine_ids is not None:
                    engine_ids.extend(out.token_ids)
                num_prompt, num_cached = out.num_prompt_tokens or num_prompt, out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    prompt_lp = list(out.prompt_logprobs)
                new_ids = list(out.token_ids)
                if out.finish_reason == 'stop' and new_ids and new_ids[-1] in request.sampling.stop_token_ids:
                    new_ids = new_ids[:-1]  # the stop token ends the answer; it is not part of it
                # token by token: an output of several tokens (a speculative step's) ends at the token that
                # completes a stop string, as single-token outputs do
                text, hit_stop = '', False
                pieces = [[t] for t in new_ids] or [[]]
                for j, piece in enumerate(pieces):
                    token_ids.extend(piece)
                    pending_ids.extend(piece)
                    if logprobs is not None and out.logprobs:
                        pending_lp.extend(out.logprobs[j:j + len(piece)])
                    piece_text, state = self.tokenizer.detokenize_incrementally(
                        token_ids, state, skip_special_tokens=gen.skip_special_tokens,
                        spaces_between_special_tokens=gen.spaces_between_special_tokens,
                        final=out.finish_reason is not None and j == len(pieces) - 1)
                    piece_text, hit_stop = stops.feed(piece_text)
                    text += piece_text
                    if hit_stop:
                        break
                finish_reason = out.finish_reason
                if finish_reason == 'error':
                    raise RuntimeError(out.error or 'the engine failed this request')
                if hit_stop:
                    finish_reason = 'stop'
                    self.engine.abort(session_id)
                elif finish_reason is not None:
                    text += stops.flush()
                finished = finish_reason is not None
                pending_text += text
                if not stream_response and not finished:
                    continue
                if not (pending_text or pending_ids or finished):
                    continue  # a held-back partial character: nothing to show yet
                if logprobs is not None:
                    logprobs.extend(pending_lp)
                yield Response(text=pending_text, generate_token_len=len(token_ids),
                               input_token_len=num_prompt, finish_reason=finish_reason,
                               token_ids=pending_ids if stream_response else list(token_ids),
                               logprobs=(pending_lp if stream_response else logprobs) if logprobs is not None
                               else None,
                               index=index, session_id=session_id, num_cached_tokens=num_cached,
                               prompt_logprobs=prompt_lp)
                pending_text, pending_ids, pending_lp, prompt_lp = '', [], [], None
            while engine_ids is not None and not engine_done:  # learn exactly what the session holds
                out = await queue.get()
                engine_done = out.finish_reason is not None
                engine_ids.extend(out.token_ids)
        finally:
            if not finished:  # the caller went away (cancelled, closed the stream): free its blocks
                self.engine.abort(session_id)

    async def generate_n(self, prompt, gen_config: GenerationConfig, **kwargs) -> AsyncIterator[Response]:
        """``gen_config.n`` answers of one prompt, streamed interleaved; ``index`` tells them apart."""
        n = gen_config.n
        if n == 1:
            async for r in self.generate(prompt, gen_config=gen_config, **kwargs):
                yield r
            return
        if 'session_id' in kwargs and kwargs['session_id'] is not None:
            raise ValueError('n > 1 cannot be combined with an interactive session_id')
        input_ids = kwargs.pop('input_ids', None)
        if input_ids is None:
            input_ids = self.encode(prompt, kwargs.pop('do_preprocess', True))
        base_seed = gen_config.random_seed
        queue: asyncio.Queue = asyncio.Queue()

        async def run(i: int):
            seed = None if base_seed is None else (base_seed + i) % 2**64
            try:
                async for r in self.generate(None, gen_config=gen_config, input_ids=input_ids,
                                             index=i, seed=seed, **kwargs):
                    await queue.put(r)
            except BaseException as e:  # surfaced to the consumer below
                await queue.put(e)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(run(i)) for i in range(n)]
        try:
            done = 0
            while done < n:
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    # ---- scoring ---------------------------------------------------------------------------

    async def get_logits(self, input_ids: list[int] | list[list[int]]) -> list[torch.Tensor]:
        """As LMDeploy's: the teacher-forced float32 logits [len(ids), vocab_size] of each sequence
        (one list of token ids, or a list of them), row t for the token after ``ids[:t + 1]``. Each
        is scored alone from an empty KV cache (``Engine.get_logits``), off the event loop, beside
        the requests being generated; ValueError for an empty or out-of-vocabulary sequence or one
        longer than session_len."""
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(None, self.engine.get_logits, ids) for ids in _id_batch(input_ids, 1)]

    async def get_ppl(self, input_ids: list[int] | list[list[int]]) -> list[float]:
        """As LMDeploy's: for each sequence (of at least 2 tokens) the mean negative log-likelihood,
        in nats, of its tokens 1.. given their prefix: the cross-entropy loss, whose exp is the
        perplexity. No BOS is added: the ids are scored as given."""
        loop = asyncio.get_running_loop()
        out = []
        for ids in _id_batch(input_ids, 2):
            logits = await loop.run_in_executor(None, self.engine.get_logits, ids)
            out.append(token_nll(logits, ids).sum().item() / (len(ids) - 1))
        return out

    # ---- embeddings ------------------------------------------------------------------------

    @property
    def pooler_config(self) -> PoolerConfig:
        """How this model's hidden states become its embeddings, as its directory declares
        (``lmd.embeddings.pooler_config_from_dir``); read on first use, so that a generating server
        never fails on files only an embedder reads."""
        if self._pooler_config is None:
            self._pooler_config = pooler_config_from_dir(self.model_dir)
        return self._pooler_config

    def embedding_inputs(self, inputs) -> list[list[int]]:
        """OpenAI's ``input`` (a text, a list of texts, a list of token ids or a list of such lists) as
        token-id lists. A text is tokenized as it is, with the tokenizer's special tokens, as
        sentence-transformers tokenizes it (the BOS, or the EOS that Qwen3-Embedding's tokenizer appends
        for last-token pooling to read). ValueError naming ``input[i]`` for an empty input, an id outside
        the vocabulary, or more tokens than session_len."""
        if isinstance(inputs, str) or _is_ids(inputs):
            inputs = [inputs]
        if not isinstance(inputs, (list, tuple)):
            raise ValueError('input must be a text, a list of texts, a list of token ids or a list of such lists, '
                             f'not {type(inputs).__name__}')
        batch = []
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                ids = self.encode_text(x, add_special_tokens=True)
            elif _is_ids(x):
                ids = list(x)
            else:
                raise ValueError(f'input[{i}] must be a text or a list of token ids, got {type(x).__name__}')
            vocab = self.model_info.vocab_size
            if not ids:
                raise ValueError(f'input[{i}] is empty: it has no tokens to embed')
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f'input[{i}]: token id {bad} is outside the vocabulary [0, {vocab})')
            if len(ids) > self.session_len:
                raise InputTooLongError(i, len(ids), self.session_len)
            batch.append(ids)
        return batch

    async def embed(self, inputs, dimensions: int | None = None) -> list[torch.Tensor]:
        """As vLLM's ``LLM.embed``: one float32 embedding [hidden_size, or ``dimensions``] per input
        (``embedding_inputs`` reads them), pooled as ``pooler_config`` says (``lmd.embeddings``). Each
        input runs alone, in one forward pass over a KV cache of its own (``Engine.get_hidden_states``),
        off the event loop and beside the requests being generated, which it leaves untouched.
        ValueError for bad inputs or ``dimensions`` the model does not declare."""
        config = self.pooler_config
        config.check_dimensions(dimensions, self.model_info.hidden_size)
        loop = asyncio.get_running_loop()
        out = []
        for ids in self.embedding_inputs(inputs):
            hidden = await loop.run_in_executor(None, self.engine.get_hidden_states, ids)
            out.append(embedding(hidden, config, dimensions))
        return out

    # ---- interactive sessions -------------------------------------------------------------

    def new_session(self, system: str | None = None) -> Session:
        s = Session(session_id=self.next_session_id())
        if system:
            s.messages.append({'role': 'system', 'content': system})
        return s

    async def chat(self, session: Session, user_message: str,
                   gen_config: GenerationConfig | None = None) -> AsyncIterator[Response]:
        """One turn of ``session``: only the tokens new since its last turn are prefilled."""
        messages = session.messages + [{'role': 'user', 'content': user_message}]
        full_ids = self.encode(messages)
        history = session.token_ids
        if session.started and full_ids[:len(history)] == history:
            new_ids, start = full_ids[len(history):], False
        else:  # first turn, or the template re-rendered the past differently: start over
            if session.started:
                self.end_session(session)
            new_ids, start = full_ids, True
        answer, engine_ids = [], []
        session.started, completed = True, False
        try:
            async for r in self.generate(None, session.session_id, gen_config, input_ids=new_ids,
                                         sequence_start=start, sequence_end=False, engine_ids=engine_ids):
                answer.append(r.text)
                yield r
            completed = True
        finally:
            if not completed:  # an interrupted turn leaves the engine's history unknown: drop it
                self.end_session(session)
        session.token_ids = full_ids + engine_ids
        session.messages = messages + [{'role': 'assistant', 'content': ''.join(answer)}]

    def end_session(self, session: Session) -> None:
        if session.started:
            self.engine.end(session.session_id)
        session.started = False
        session.token_ids = []

    # ---- the engine below, for servers ------------------------------------------------------

    def is_alive(self) -> bool:
        """Whether the engine's threads run (a server's health: False once closed or if one died)."""
        return self.engine.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def replica_stats(self) -> list[EngineStats]:
        """Each engine replica's stats (``--dp``; one entry for a single engine)."""
        if isinstance(self.engine, DataParallelEngine):
            return self.engine.replica_stats()
        return [self.engine.stats()]

    @property
    def engine_name(self) -> str:
        """The engine's class name (TurbomindEngine or PytorchEngine), for logs."""
        return type(self.engine).__name__

    def abort(self, session_id: int) -> None:
        """Stop the request running under ``session_id``; unknown ids are ignored."""
        self.engine.abort(session_id)

    def end(self, session_id: int) -> None:
        """Forget the session the engine keeps under ``session_id`` (a request with ``sequence_end=False``),
        freeing its KV cache; ``end_session`` does it for a ``Session``."""
        self.engine.end(session_id)

    def close(self) -> None:
        self.engine.close()
