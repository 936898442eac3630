"""``Server``: what every api_server route shares — the engine (once loaded), the config, the
checks of a request (API key, model name), ``/generate``'s interactive sessions, the concurrency
limit and the metrics. Route modules depend on this module; it depends on none of them."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

from fastapi import Request

from lmd.async_engine import AsyncEngine
from lmd.engine import EngineStats
from lmd.messages import GenerationConfig

from .errors import APIError
from .metrics import ServerMetrics
from .reasoning_parser import ReasoningParserManager
from .token_texts import TokenTexts
from .tool_parser import ToolParserManager, default_tool_parser

logger = logging.getLogger('lmd.serve')

TASKS = ('generate', 'embed')


@dataclass
class ServerConfig:
    model_name: str
    api_keys: tuple[str, ...] = ()
    max_concurrent_requests: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    proxy_url: str | None = None
    allow_origins: tuple[str, ...] = ()
    allow_credentials: bool = False
    allow_methods: tuple[str, ...] = ('*',)
    allow_headers: tuple[str, ...] = ('*',)
    server_url: str | None = None  # how a proxy reaches this server
    task: str = 'generate'  # 'embed': the model is an embedder, /v1/embeddings is its one model route

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f'task={self.task!r} is invalid: expected one of {", ".join(TASKS)}')


class Server:
    """What the routes share: the engine (once loaded), the config, sessions and metrics.

    ``engine_factory`` builds the engine when ``load`` runs (the app runs it in a thread after the
    port opens); ``engine`` serves an engine built already."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[], AsyncEngine] | None = None,
                 engine: AsyncEngine | None = None):
        self.config = config
        self.engine: AsyncEngine | None = engine
        self.engine_factory = engine_factory
        self.load_error: str | None = None
        self.metrics = ServerMetrics(config.model_name, self._stats, self._replica_stats)
        self.semaphore = (asyncio.Semaphore(config.max_concurrent_requests)
                          if config.max_concurrent_requests else None)
        self.sessions: dict[int, bool] = {}  # /generate's interactive sessions: id -> started
        self.token_texts: TokenTexts | None = None
        self.tool_parser_cls = self.reasoning_parser_cls = None  # the tool parser: the flag's, else the engine's
        if config.tool_call_parser:
            self.tool_parser_cls = ToolParserManager.get(config.tool_call_parser)
        if config.reasoning_parser:
            self.reasoning_parser_cls = ReasoningParserManager.get(config.reasoning_parser)
        self.created = int(time.time())
        if engine is not None:
            self._ready(engine)

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def needs_load(self) -> bool:
        """Whether ``load`` has an engine to build."""
        return self.engine is None and self.engine_factory is not None

    def _ready(self, engine: AsyncEngine) -> None:
        self.token_texts = TokenTexts(engine.tokenizer)
        self._pick_tool_parser(engine)
        self.engine = engine

    def _pick_tool_parser(self, engine: AsyncEngine) -> None:
        """Without --tool-call-parser, the parser the model's chat template implies, so a request with
        ``tools`` and no ``tool_choice`` (OpenAI's ``auto``) works on a default server."""
        if self.config.tool_call_parser:
            logger.info('tool-call parser: %s (--tool-call-parser)', self.config.tool_call_parser)
            return
        name, why = default_tool_parser(engine.chat_template, engine.model_info.architecture)
        self.tool_parser_cls = ToolParserManager.get(name)
        logger.info('tool-call parser: %s (%s; --tool-call-parser overrides)', name, why)

    def load(self) -> None:
        """Build the engine (in a background thread); /health turns 200 when it is ready."""
        try:
            self._ready(self.engine_factory())
        except BaseException as e:  # shown by /health; the process keeps answering 503
            logger.exception('the engine failed to load')
            self.load_error = f'{type(e).__name__}: {e}'
            return
        logger.info('engine ready: %s (%s)', self.config.model_name, self.engine.engine_name)
        if self.config.proxy_url:
            self._register_with_proxy()

    def _register_with_proxy(self) -> None:
        import httpx
        try:
            body = {'url': self.config.server_url, 'status': {'models': [self.config.model_name]}}
            httpx.post(f'{self.config.proxy_url.rstrip("/")}/nodes/add', json=body, headers=self._proxy_headers(),
                       timeout=10).raise_for_status()
            logger.info('registered %s with the proxy at %s', self.config.server_url, self.config.proxy_url)
        except Exception as e:
            logger.error('could not register with the proxy at %s: %s', self.config.proxy_url, e)

    def unregister_from_proxy(self) -> None:
        if not (self.config.proxy_url and self.engine is not None):
            return
        import httpx
        try:
            httpx.post(f'{self.config.proxy_url.rstrip("/")}/nodes/remove', json={'url': self.config.server_url},
                       headers=self._proxy_headers(), timeout=3)
        except Exception as e:
            logger.warning('could not unregister from the proxy: %s', e)

    def _proxy_headers(self) -> dict:
        keys = os.environ.get('LMD_PROXY_API_KEY') or (self.config.api_keys[0] if self.config.api_keys else None)
        return {'Authorization': f'Bearer {keys}'} if keys else {}

    def close(self) -> None:
        self.unregister_from_proxy()
        if self.engine is not None:
            self.engine.close()

    def _stats(self) -> EngineStats | None:
        return None if self.engine is None else self.engine.stats()

    def _replica_stats(self) -> list[EngineStats]:
        return [] if self.engine is None else self.engine.replica_stats()

    def health(self) -> tuple[bool, str]:
        if self.load_error:
            return False, f'the engine failed to load: {self.load_error}'
        if self.engine is None:
            return False, 'the engine is loading'
        if not self.engine.is_alive():
            return False, 'the engine has stopped (its thread ended)'
        return True, 'ok'

    def ready_engine(self) -> AsyncEngine:
        ok, why = self.health()
        if not ok:
            raise APIError(503, why)
        return self.engine

    # ---- checks ----------------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if not self.config.api_keys:
            return
        header = request.headers.get('authorization', '')
        scheme, _, key = header.partition(' ')
        if scheme.lower() != 'bearer' or not key:
            raise APIError(401, 'missing API key: send the header "Authorization: Bearer <key>"',
                           code='invalid_api_key')
        if not any(secrets.compare_digest(key.strip(), k) for k in self.config.api_keys):
            raise APIError(401, 'incorrect API key', code='invalid_api_key')

    def check_generating(self) -> None:
        """A 400 on a generating route of a server whose model is an embedder (``--task embed``)."""
        if self.config.task == 'embed':
            raise APIError(400, f'this server runs {self.config.model_name!r} as an embedding model (--task embed): '
                                'it answers POST /v1/embeddings, not text generation; start it with --task '
                                'generate to generate', code='wrong_task')

    def check_model(self, model: str | None, adapters: bool = True) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model), or a 404 naming what is
        served; ``adapters`` False: a route that serves the base model only."""
        if model is None or model == self.config.model_name:
            return None
        names = self.engine.adapter_names if self.engine is not None and adapters else []
        if model in names:
            return model
        served = ', '.join(repr(n) for n in [self.config.model_name, *names])
        raise APIError(404, f'the model {model!r} does not exist here; this server serves {served} '
                            f'(GET /v1/models)', param='model', code='model_not_found')

    def model_label(self, model: str | None) -> str:
        """The ``model`` an answer reports: the adapter the request named, else the served model's name."""
        return self.check_model(model) or self.config.model_name

    # ---- running requests ------------------------------------------------------------------------

    @asynccontextmanager
    async def slot(self):
        if self.semaphore is None:
            yield
            return
        async with self.semaphore:
            yield

    def gen_config(self, req, max_tokens: int | None, prompt_len: int, logprobs: int | None,
                   response_format: dict | None) -> GenerationConfig:
        engine = self.engine
        sent = next((f for f in ('max_completion_tokens', 'max_tokens')
                     if f in getattr(req, 'model_fields_set', ()) and getattr(req, f, None) is not None), None)
        max_new = max_new_tokens(engine.session_len, prompt_len, max_tokens, sent)
        seed = None if req.seed is None else req.seed % 2**64
        try:
            return GenerationConfig(
                n=req.n, max_new_tokens=max_new, min_new_tokens=min(req.min_tokens, max_new),
                do_sample=req.temperature > 0, temperature=req.temperature, top_p=req.top_p,
                top_k=max(req.top_k, 0), min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                ignore_eos=req.ignore_eos, random_seed=seed, stop_words=req.stop,
                stop_token_ids=req.stop_token_ids, skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
                response_format=response_format)
        except ValueError as e:
            raise APIError(400, str(e)) from e


def max_new_tokens(session_len: int, prompt_len: int, max_tokens: int | None, param: str | None) -> int:
    """The ``max_new_tokens`` a request runs with: ``max_tokens`` when it fits in the context after the
    prompt, the rest of the context when it is absent. ``param``: the field the client sent it in (None:
    not sent, so a default such as /v1/completions' 16 is cut to fit). A sent value that does not fit
    is a 400 naming both numbers, as vLLM and OpenAI answer, never silently cut.

    A prompt that leaves no room at all is the engine's to refuse (``PromptTooLongError``, which alone
    knows a kept session's history), so it is let through here with one token."""
    room = session_len - prompt_len
    if room <= 0:
        return 1 if max_tokens is None else min(max_tokens, 1)
    if max_tokens is None:
        return room
    if max_tokens > room and param is not None:
        raise APIError(400, f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
                            f'{session_len} tokens and your request has {prompt_len} input tokens '
                            f'({max_tokens} > {session_len} - {prompt_len}): send at most {room}',
                       param=param, code='context_length_exceeded')
    return min(max_tokens, room)
