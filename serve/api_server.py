"""``lmd serve api_server``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncEngine.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /generate`` (LMDeploy's raw endpoint, with interactive sessions), ``POST /v1/encode``
and ``/v1/decode``, ``GET /health``, ``GET /metrics``.

The engine loads in a background thread after the socket is open: ``/health`` answers 503
until it is ready (and again if an engine thread dies), so an orchestrator can watch a
large model load. Every request runs as a coroutine on uvicorn's event loop; tokens come
back from the engine thread through ``AsyncEngine.generate``. A client that goes away (a
closed stream, or a dropped connection while waiting for a whole answer) cancels its
coroutine, which aborts its request in the engine and frees its KV blocks.

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
bad field (named in ``param``) or a prompt that does not fit, 401 for a wrong or missing
API key, 404 for an unknown model, 503 while the engine is not ready.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.responses import Response as HTTPResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lmd.async_engine import AsyncEngine
from lmd.chat_template import to_messages
from lmd.messages import GenerationConfig, Response

from .metrics import ServerMetrics
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DecodeRequest,
    EncodeRequest,
    GenerateRequest,
    ToolChoiceFunction,
)
from .token_texts import TokenTexts

logger = logging.getLogger('lmd.serve')

_MAX_USER_SESSION_ID = 2**32 - 1  # AsyncEngine numbers its own requests above this


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: 'invalid_request_error', 401: 'authentication_error', 404: 'not_found_error',
                              503: 'service_unavailable'}.get(status, 'server_error')

    def body(self) -> dict:
        return {'error': {'message': self.message, 'type': self.type, 'param': self.param,
                          'code': self.code or str(self.status)}}


def _error_response(e: APIError) -> JSONResponse:
    headers = {'WWW-Authenticate': 'Bearer'} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj: dict) -> str:
    return f'data: {json.dumps(obj, ensure_ascii=False)}\n\n'


async def _merge(streams: list[AsyncIterator[Response]]) -> AsyncIterator[tuple[int, Response]]:
    """Interleave several Response streams as their items arrive: (stream number, item)."""
    if len(streams) == 1:
        async for r in streams[0]:
            yield 0, r
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, stream):
        try:
            async for r in stream:
                await queue.put((k, r))
        except BaseException as e:  # handed to the consumer
            await queue.put((k, e))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            k, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


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


@dataclass
class _Choice:
    """One answer being built: its text so far and its parsers' state."""
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    reasoning: Any = None      # a reasoning parser's per-request state (streaming)
    tools: Any = None          # a tool parser (streaming)
    sent_role: bool = False
    forced_call_id: str | None = None
    forced_args_sent: bool = False


class _Usage:

    def __init__(self):
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion: dict[int, int] = {}

    def add(self, key: int, r: Response) -> None:
        self.prompt_tokens = max(self.prompt_tokens, r.input_token_len)
        self.cached_tokens = max(self.cached_tokens, r.num_cached_tokens)
        self.completion[key] = r.generate_token_len

    def body(self, prompt_tokens: int | None = None) -> dict:
        p = self.prompt_tokens if prompt_tokens is None else prompt_tokens
        c = sum(self.completion.values())
        return {'prompt_tokens': p, 'completion_tokens': c, 'total_tokens': p + c,
                'prompt_tokens_details': {'cached_tokens': self.cached_tokens}}


class _RequestTimer:
    """Observes one request's latencies into the server's histograms, once, when its last answer
    ends (or when its client goes away: finish reason 'abort')."""

    def __init__(self, metrics: ServerMetrics, answers: int = 1):
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first: float | None = None
        self.left = answers
        self.generated = self.longest = self.prompt = 0
        self.closed = False

    def accepted(self) -> None:
        self.metrics.queue.observe(time.perf_counter() - self.arrival)

    def token(self, n: int) -> None:
        if n and self.first is None:
            self.first = time.perf_counter()
            self.metrics.ttft.observe(self.first - self.arrival)

    def done(self, generated: int, prompt: int, reason: str | None) -> None:
        """One answer ended; the request is recorded when the last one does."""
        self.generated += generated
        self.longest = max(self.longest, generated)
        self.prompt = max(self.prompt, prompt)
        self.left -= 1
        if self.left <= 0:
            self._record(reason)

    def abandoned(self) -> None:
        """The client went away before the end (nothing happens after the request was recorded)."""
        self._record('abort')

    def _record(self, reason: str | None) -> None:
        if self.closed:
            return
        self.closed = True
        now = time.perf_counter()
        self.metrics.e2e.observe(now - self.arrival)
        if self.first is not None and self.longest > 1:
            self.metrics.tpot.observe((now - self.first) / (self.longest - 1))
        self.metrics.prompt_len.observe(self.prompt)
        self.metrics.gen_len.observe(self.generated)
        self.metrics.finished(reason)


class Server:
    """What the routes share: the engine (once loaded), the config, sessions and metrics."""

    def __init__(self, config: ServerConfig, engine_factory=None, engine: AsyncEngine | None = None):
        self.config = config
        self.engine: AsyncEngine | None = engine
        self._engine_factory = engine_factory
        self.load_error: str | None = None
        self.metrics = ServerMetrics(config.model_name, self._stats)
        self.semaphore = (asyncio.Semaphore(config.max_concurrent_requests)
                          if config.max_concurrent_requests else None)
        self.sessions: dict[int, bool] = {}  # /generate's interactive sessions: id -> started
        self.token_texts: TokenTexts | None = None
        self.tool_parser_cls = self.reasoning_parser_cls = None
        if config.tool_call_parser:
            from .tool_parser import ToolParserManager
            self.tool_parser_cls = ToolParserManager.get(config.tool_call_parser)
        if config.reasoning_parser:
            from .reasoning_parser import ReasoningParserManager
            self.reasoning_parser_cls = ReasoningParserManager.get(config.reasoning_parser)
        self.created = int(time.time())
        if engine is not None:
            self._ready(engine)

    # ---- lifecycle -------------------------------------------------------------------------------

    def _ready(self, engine: AsyncEngine) -> None:
        self.token_texts = TokenTexts(engine.tokenizer)
        self.engine = engine

    def load(self) -> None:
        """Build the engine (in a background thread); /health turns 200 when it is ready."""
        try:
            self._ready(self._engine_factory())
        except BaseException as e:  # shown by /health; the process keeps answering 503
            logger.exception('the engine failed to load')
            self.load_error = f'{type(e).__name__}: {e}'
            return
        logger.info('engine ready: %s (%s)', self.config.model_name, type(self.engine.engine).__name__)
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

    def _stats(self):
        return None if self.engine is None else self.engine.engine.stats()

    def health(self) -> tuple[bool, str]:
        if self.load_error:
            return False, f'the engine failed to load: {self.load_error}'
        if self.engine is None:
            return False, 'the engine is loading'
        inner = self.engine.engine
        for name in ('_thread', '_reader'):
            t = getattr(inner, name, None)
            if isinstance(t, threading.Thread) and not t.is_alive():
                return False, f'the engine thread {t.name} has stopped'
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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(404, f'the model {model!r} does not exist here; this server serves '
                                f'{self.config.model_name!r} (GET /v1/models)', param='model',
                           code='model_not_found')

    def check_prompt_len(self, engine: AsyncEngine, n_tokens: int, param: str) -> None:
        if n_tokens >= engine.session_len:
            raise APIError(400, f'the prompt is {n_tokens} tokens; this model\'s session_len is '
                                f'{engine.session_len}, which must leave room for at least one generated token',
                           param=param, code='context_length_exceeded')

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
        room = engine.session_len - prompt_len
        max_new = room if max_tokens is None else min(max_tokens, room)
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


_TYPE_TAGS = {'str', 'int', 'float', 'bool', 'list', 'dict', 'none'}


def _param_of(loc) -> str | None:
    """The field a pydantic error location names, without its union-branch tags (``stop.str``)."""
    parts = []
    for p in loc:
        if p == 'body':
            continue
        if isinstance(p, str) and (p in _TYPE_TAGS or '[' in p or p[:1].isupper()):
            break  # pydantic names the union branch it tried; the field is what came before
        parts.append(str(p))
    return '.'.join(parts) or None


def build_app(server: Server, load_in_background: bool = True) -> FastAPI:
    """The FastAPI app serving ``server``; the engine loads on startup unless it is there already."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if server.engine is None and server._engine_factory is not None:
            loader = threading.Thread(target=server.load, name='lmd-engine-load', daemon=True)
            loader.start()
            if not load_in_background:
                await asyncio.get_running_loop().run_in_executor(None, loader.join)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.close)

    app = FastAPI(title='lmd api_server', version='0.1.0', lifespan=lifespan,
                  description='OpenAI-compatible API over an lmd engine (TurboMind or PyTorch).')
    app.state.server = server
    if server.config.allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(server.config.allow_origins),
                           allow_credentials=server.config.allow_credentials,
                           allow_methods=list(server.config.allow_methods),
                           allow_headers=list(server.config.allow_headers))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        server.metrics.error(e.status)
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        param = _param_of(first.get('loc', ()))
        if first.get('type') == 'json_invalid':
            message = f'the request body is not valid JSON: {first.get("ctx", {}).get("error", first.get("msg"))}'
            param = None
        else:
            seen = {}
            for x in errors:
                seen.setdefault(_param_of(x.get('loc', ())) or 'body', x.get('msg'))
            details = '; '.join(f'{k}: {v}' for k, v in list(seen.items())[:5])
            message = f'invalid request: {details}'
        server.metrics.error(400)
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError):
        server.metrics.error(400)
        return _error_response(APIError(400, str(e)))

    # ---- info ------------------------------------------------------------------------------------

    @app.get('/health')
    async def health():
        ok, why = server.health()
        if ok:
            return {'status': 'ok'}
        return JSONResponse({'status': 'unavailable', 'error': {'message': why, 'type': 'service_unavailable',
                                                                  'param': None, 'code': '503'}},
                            status_code=503)

    @app.get('/metrics')
    async def metrics():
        return HTTPResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get('/v1/models')
    async def list_models(request: Request):
        server.check_auth(request)
        engine = server.engine
        card = {'id': server.config.model_name, 'object': 'model', 'created': server.created, 'owned_by': 'lmd',
                'root': server.config.model_name, 'parent': None}
        if engine is not None:
            card['max_model_len'] = engine.session_len
        return {'object': 'list', 'data': [card]}

    # ---- tokenizer -------------------------------------------------------------------------------

    @app.post('/v1/encode')
    async def encode(request: Request, body: EncodeRequest):
        server.check_auth(request)
        engine = server.ready_engine()
        texts = [body.input] if isinstance(body.input, str) else body.input
        ids = []
        for t in texts:
            if body.do_preprocess:
                ids.append(engine.encode(t, do_preprocess=True))
            else:
                ids.append(engine.tokenizer.encode(t, add_special_tokens=body.add_bos))
        if isinstance(body.input, str):
            return {'input_ids': ids[0], 'length': len(ids[0])}
        return {'input_ids': ids, 'length': [len(x) for x in ids]}

    @app.post('/v1/decode')
    async def decode(request: Request, body: DecodeRequest):
        server.check_auth(request)
        engine = server.ready_engine()
        rows = body.input_ids if body.input_ids and isinstance(body.input_ids[0], list) else [body.input_ids]
        vocab = engine.model_info.vocab_size
        for row in rows:
            bad = [t for t in row if t >= vocab]
            if bad:
                raise APIError(400, f'token id {bad[0]} is outside the vocabulary [0, {vocab})', param='input_ids')
        texts = [engine.tokenizer.decode(r, skip_special_tokens=body.skip_special_tokens) for r in rows]
        return {'text': texts if rows is body.input_ids else texts[0]}

    # ---- chat completions ------------------------------------------------------------------------

    @app.post('/v1/chat/completions')
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        server.check_auth(request)
        server.check_model(body.model)
        engine = server.ready_engine()
        timer = _RequestTimer(server.metrics, body.n)
        prep = _prepare_chat(server, engine, body)
        gen = server.gen_config(body, body.max_completion_tokens or body.max_tokens, len(prep.input_ids),
                                (body.top_logprobs or 0) if body.logprobs else None, prep.response_format)
        rid = f'chatcmpl-{secrets.token_hex(12)}'
        stream = _run(server, engine, prep.input_ids, gen, body.session_id)
        if body.stream:
            return await _stream_response(request, server, timer, stream,
                                          _ChatStream(server, body, prep, rid, timer))
        return await _until_done(request, _chat_whole(server, body, prep, rid, stream, timer), timer)

    # ---- completions -----------------------------------------------------------------------------

    @app.post('/v1/completions')
    async def completions(request: Request, body: CompletionRequest):
        server.check_auth(request)
        server.check_model(body.model)
        engine = server.ready_engine()
        if body.echo and body.logprobs is not None:
            raise APIError(400, 'echo with logprobs needs the prompt tokens\' logprobs, which lmd does not '
                                'compute; send echo or logprobs', param='echo')
        prompts = _completion_prompts(engine, body.prompt)
        timer = _RequestTimer(server.metrics, body.n * len(prompts))
        for i, ids in enumerate(prompts):
            server.check_prompt_len(engine, len(ids), 'prompt' if len(prompts) == 1 else f'prompt.{i}')
        response_format = body.response_format.to_generation_format() if body.response_format else None
        gens = [server.gen_config(body, body.max_tokens, len(ids), body.logprobs, response_format)
                for ids in prompts]
        streams = [_run(server, engine, ids, g, body.session_id if len(prompts) == 1 else None)
                   for ids, g in zip(prompts, gens)]
        rid = f'cmpl-{secrets.token_hex(12)}'
        echo = [engine.tokenizer.decode(ids, skip_special_tokens=False) if not isinstance(body.prompt, str)
                else body.prompt for ids in prompts] if body.echo else None
        ctx = _CompletionCtx(server, body, rid, echo, timer, n=body.n, n_prompts=len(prompts))
        merged = _merge(streams)
        if body.stream:
            return await _stream_response(request, server, timer, merged, ctx)
        return await _until_done(request, _completion_whole(ctx, merged), timer)

    # ---- LMDeploy's /generate --------------------------------------------------------------------

    @app.post('/generate')
    async def generate(request: Request, body: GenerateRequest):
        server.check_auth(request)
        engine = server.ready_engine()
        return await _generate(request, server, engine, body)

    return app


# ---- chat: preparing the prompt ----------------------------------------------------------------------

@dataclass
class _ChatPrep:
    input_ids: list[int]
    response_format: dict | None
    forced_tool: str | None = None      # tool_choice names a function: the output is its arguments
    required_tools: bool = False        # tool_choice 'required': the output is a JSON list of calls
    parse_tools: bool = False           # tool_choice 'auto' with a parser
    prompt_text: str | None = None      # the rendered prompt (a reasoning parser reads how it ends)


def _tool_schema_required(tools) -> dict:
    return {'type': 'array', 'minItems': 1, 'items': {'anyOf': [
        {'type': 'object', 'properties': {'name': {'type': 'string', 'enum': [t.function.name]},
                                          'parameters': t.function.parameters or {'type': 'object'}},
         'required': ['name', 'parameters']} for t in tools]}}


def _prepare_chat(server: Server, engine: AsyncEngine, body: ChatCompletionRequest) -> _ChatPrep:
    response_format = body.response_format.to_generation_format() if body.response_format else None
    if body.regex is not None:
        response_format = {'type': 'regex_schema', 'regex_schema': body.regex}
    if body.guided_json is not None:
        response_format = {'type': 'json_schema', 'json_schema': {'name': 'guided_json', 'schema': body.guided_json}}
    prep = _ChatPrep(input_ids=[], response_format=response_format)
    tools = body.tools if body.tool_choice != 'none' else None
    if tools:
        if response_format is not None:
            raise APIError(400, 'tools cannot be combined with response_format', param='response_format')
        choice = body.tool_choice or 'auto'
        if isinstance(choice, ToolChoiceFunction):
            fn = next(t.function for t in tools if t.function.name == choice.function.name)
            prep.forced_tool = fn.name
            prep.response_format = {'type': 'json_schema', 'json_schema': {
                'name': fn.name, 'schema': fn.parameters or {'type': 'object'}}}
        elif choice == 'required':
            prep.required_tools = True
            prep.response_format = {'type': 'json_schema', 'json_schema': {
                'name': 'tool_calls', 'schema': _tool_schema_required(tools)}}
        elif server.tool_parser_cls is None:
            raise APIError(400, "tools with tool_choice 'auto' need a server started with --tool-call-parser "
                                "(qwen, llama3, internlm); tool_choice 'required' or a named function works "
                                "without one", param='tool_choice')
        else:
            prep.parse_tools = True
    try:
        messages = to_messages(body.messages)
        if body.do_preprocess:
            kwargs = dict(body.chat_template_kwargs or {})
            if tools:
                kwargs['tools'] = [t.model_dump(exclude_none=True) for t in tools]
            text = engine.chat_template.render(messages, add_generation_prompt=True, **kwargs)
            prep.prompt_text = text
            prep.input_ids = engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            text = ''.join(m['content'] if isinstance(m['content'], str) else '' for m in messages)
            prep.input_ids = engine.tokenizer.encode(text, add_special_tokens=True)
    except TypeError as e:
        raise APIError(400, f'the chat template does not take these arguments: {e}',
                       param='chat_template_kwargs') from e
    except ValueError as e:
        raise APIError(400, str(e), param='messages') from e
    server.check_prompt_len(engine, len(prep.input_ids), 'messages')
    # parsers whose markers are special tokens need them kept in the text
    if prep.parse_tools:
        server.tool_parser_cls(engine.tokenizer).adjust_request(body)
    if server.reasoning_parser_cls is not None:
        server.reasoning_parser_cls(engine.tokenizer, prompt=prep.prompt_text).adjust_request(body)
    return prep


def _completion_prompts(engine: AsyncEngine, prompt) -> list[list[int]]:
    vocab = engine.model_info.vocab_size
    if isinstance(prompt, str):
        rows = [engine.tokenizer.encode(prompt, add_special_tokens=True)]
    elif isinstance(prompt[0], str):
        rows = [engine.tokenizer.encode(p, add_special_tokens=True) for p in prompt]
    elif isinstance(prompt[0], int):
        rows = [list(prompt)]
    else:
        rows = [list(p) for p in prompt]
    for i, row in enumerate(rows):
        if not row:
            raise APIError(400, 'the prompt is empty', param='prompt')
        if max(row) >= vocab:
            raise APIError(400, f'token id {max(row)} is outside the vocabulary [0, {vocab})', param='prompt')
    return rows


def _run(server: Server, engine: AsyncEngine, input_ids: list[int], gen: GenerationConfig,
         session_id: int | None) -> AsyncIterator[Response]:
    """The engine's stream of one prompt's ``n`` answers, run under the concurrency limit."""
    if session_id is not None and session_id > _MAX_USER_SESSION_ID:
        raise APIError(400, f'session_id must be at most {_MAX_USER_SESSION_ID}', param='session_id')

    async def stream():
        async with server.slot():
            kwargs = {} if session_id is None or gen.n > 1 else {'session_id': session_id}
            async for r in engine.generate_n(None, gen, input_ids=input_ids, stream_response=True, **kwargs):
                yield r
    return stream()


# ---- streaming plumbing --------------------------------------------------------------------------------

async def _first(stream):
    """The first item of ``stream`` (raising what starting it raises), and the stream itself."""
    agen = stream.__aiter__()
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        first = None
    return first, agen


async def _rest(first, agen):
    """``first``, then the rest of ``agen`` (what ``_first`` split)."""
    item = first
    while item is not None:
        yield item
        try:
            item = await agen.__anext__()
        except StopAsyncIteration:
            return


async def _until_done(request: Request, coro, timer: _RequestTimer):
    """Await ``coro`` (a whole answer) but cancel it when the client disconnects meanwhile."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                timer.abandoned()
                logger.info('client went away; request cancelled')
                return HTTPResponse(status_code=499)
    finally:
        if not task.done():
            task.cancel()


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f'{type(e).__name__}: {e}')


async def _stream_response(request: Request, server: Server, timer: _RequestTimer, stream, ctx):
    """An SSE response for ``stream``: errors before the first token are plain HTTP errors, later
    ones an error event; the stream ends with ``data: [DONE]``."""
    try:
        first, agen = await _first(stream)
    except Exception as e:
        raise _engine_error(e) from e
    timer.accepted()

    async def body():
        try:
            for chunk in ctx.start():
                yield _sse(chunk)
            async for item in _rest(first, agen):
                for chunk in ctx.feed(item):
                    yield _sse(chunk)
            for chunk in ctx.finish():
                yield _sse(chunk)
        except Exception as e:
            err = _engine_error(e)
            logger.warning('request failed mid-stream: %s', err.message)
            server.metrics.error(err.status)
            yield _sse(err.body())
        finally:
            timer.abandoned()  # a no-op after the last answer; else the client closed the stream
            await agen.aclose()
        yield 'data: [DONE]\n\n'

    return StreamingResponse(body(), media_type='text/event-stream',
                             headers={'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no'})


# ---- chat: turning engine output into OpenAI chunks -------------------------------------------------------

class _ChatStream:
    """Builds chat.completion.chunk objects from one request's merged engine outputs."""

    def __init__(self, server: Server, body: ChatCompletionRequest, prep: _ChatPrep, rid: str, timer: _RequestTimer):
        self.server, self.body, self.prep, self.rid, self.timer = server, body, prep, rid, timer
        self.created = int(time.time())
        self.model = server.config.model_name
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        self.usage = _Usage()
        self.choices = [_Choice(i) for i in range(body.n)]
        for c in self.choices:
            if server.reasoning_parser_cls is not None:
                c.reasoning = server.reasoning_parser_cls(server.engine.tokenizer, prompt=prep.prompt_text)
            if prep.parse_tools:
                c.tools = server.tool_parser_cls(server.engine.tokenizer)

    def _chunk(self, index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        chunk = {'id': self.rid, 'object': 'chat.completion.chunk', 'created': self.created, 'model': self.model,
                 'choices': [{'index': index, 'delta': delta, 'logprobs': logprobs,
                              'finish_reason': finish_reason}]}
        if self.include_usage:
            chunk['usage'] = self.usage.body() if self.continuous_usage else None
        return chunk

    def start(self):
        for c in self.choices:
            c.sent_role = True
            yield self._chunk(c.index, {'role': 'assistant', 'content': ''})

    def feed(self, r: Response):
        c = self.choices[r.index]
        self.usage.add(r.index, r)
        self.timer.token(r.generate_token_len)
        logprobs = None
        if self.body.logprobs and r.logprobs:
            logprobs = {'content': self.server.token_texts.chat_logprobs(r.token_ids, r.logprobs,
                                                                          self.body.top_logprobs or 0)}
        deltas = self._deltas(c, r.text, final=r.finish_reason is not None)
        finish = None
        if r.finish_reason is not None:
            c.finish_reason = r.finish_reason
            c.num_tokens = r.generate_token_len
            finish = self._finish_reason(c)
            self.timer.done(r.generate_token_len, r.input_token_len, finish)
        if not deltas and (logprobs is not None or finish is not None):
            deltas = [{}]
        for k, d in enumerate(deltas):
            last = k == len(deltas) - 1
            yield self._chunk(c.index, d, finish if last else None, logprobs if k == 0 else None)

    def _deltas(self, c: _Choice, text: str, final: bool) -> list[dict]:
        """The delta objects for a new piece of text of choice ``c``."""
        c.text.append(text)
        prep = self.prep
        if prep.forced_tool:  # the text is the arguments of the named function
            out = []
            if c.forced_call_id is None:
                c.forced_call_id = f'call_{secrets.token_hex(12)}'
                out.append({'tool_calls': [{'index': 0, 'id': c.forced_call_id, 'type': 'function',
                                            'function': {'name': prep.forced_tool, 'arguments': ''}}]})
            if text:
                out.append({'tool_calls': [{'index': 0, 'function': {'arguments': text}}]})
            return out
        if prep.required_tools:  # a JSON list: sent whole once it is complete
            if not final:
                return []
            calls = _parse_required_calls(''.join(c.text))
            return [{'tool_calls': [dict(call, index=i) for i, call in enumerate(calls)]}] if calls else \
                [{'content': ''.join(c.text)}]
        deltas = []
        content = text
        if c.reasoning is not None:
            reasoning, content = c.reasoning.feed(text)
            if final:
                r2, c2 = c.reasoning.finish()
                reasoning, content = reasoning + r2, content + c2
            if reasoning:
                deltas.append({'reasoning_content': reasoning})
        if c.tools is not None:
            pieces = []
            if content:
                d = c.tools.extract_tool_calls_streaming(content)
                if d is not None:
                    pieces.append(d)
            if final:
                d = c.tools.finish()
                if d is not None:
                    pieces.append(d)
            for d in pieces:
                deltas.extend(_tool_delta_dicts(d))
        elif content:
            deltas.append({'content': content})
        return deltas

    def _finish_reason(self, c: _Choice) -> str:
        if c.finish_reason in ('stop', 'length'):
            if self.prep.forced_tool or (self.prep.required_tools and c.finish_reason == 'stop'):
                return 'tool_calls'
            if c.tools is not None and c.tools.has_tool_calls() and c.finish_reason == 'stop':
                return 'tool_calls'
        return c.finish_reason or 'stop'

    def finish(self):
        if self.include_usage:
            yield {'id': self.rid, 'object': 'chat.completion.chunk', 'created': self.created, 'model': self.model,
                   'choices': [], 'usage': self.usage.body()}


def _tool_delta_dicts(d) -> list[dict]:
    """A tool parser's DeltaMessage as OpenAI delta dicts."""
    out = {}
    if getattr(d, 'content', None):
        out['content'] = d.content
    calls = getattr(d, 'tool_calls', None)
    if calls:
        out['tool_calls'] = [call if isinstance(call, dict) else call.to_dict() for call in calls]
    return [out] if out else []


def _parse_required_calls(text: str) -> list[dict]:
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    out = []
    for call in calls if isinstance(calls, list) else []:
        if isinstance(call, dict) and 'name' in call:
            out.append({'id': f'call_{secrets.token_hex(12)}', 'type': 'function',
                        'function': {'name': call['name'],
                                     'arguments': json.dumps(call.get('parameters', {}), ensure_ascii=False)}})
    return out


async def _chat_whole(server: Server, body: ChatCompletionRequest, prep: _ChatPrep, rid: str, stream,
                      timer: _RequestTimer):
    """A non-streamed chat completion."""
    try:
        first, agen = await _first(stream)
    except Exception as e:
        raise _engine_error(e) from e
    timer.accepted()
    usage = _Usage()
    choices = [_Choice(i) for i in range(body.n)]
    try:
        async for r in _rest(first, agen):
            c = choices[r.index]
            usage.add(r.index, r)
            timer.token(r.generate_token_len)
            c.text.append(r.text)
            c.token_ids.extend(r.token_ids)
            if r.logprobs:
                c.logprobs.extend(r.logprobs)
            if r.finish_reason is not None:
                c.finish_reason = r.finish_reason
                c.num_tokens = r.generate_token_len
                timer.done(r.generate_token_len, r.input_token_len, r.finish_reason)
    except Exception as e:
        raise _engine_error(e) from e
    finally:
        await agen.aclose()
    out = []
    for c in choices:
        text = ''.join(c.text)
        message: dict[str, Any] = {'role': 'assistant', 'content': text}
        finish = c.finish_reason or 'stop'
        if server.reasoning_parser_cls is not None:
            reasoning, text = server.reasoning_parser_cls(server.engine.tokenizer,
                                                          prompt=prep.prompt_text).extract(text)
            text = text or ''
            message['content'] = text
            message['reasoning_content'] = reasoning
        if prep.forced_tool:
            message['content'] = None
            message['tool_calls'] = [{'id': f'call_{secrets.token_hex(12)}', 'type': 'function',
                                      'function': {'name': prep.forced_tool, 'arguments': text}}]
            finish = 'tool_calls'
        elif prep.required_tools:
            calls = _parse_required_calls(text)
            if calls:
                message['content'] = None
                message['tool_calls'] = calls
                finish = 'tool_calls' if finish == 'stop' else finish
        elif prep.parse_tools:
            parsed = server.tool_parser_cls(server.engine.tokenizer).extract_tool_calls(text)
            if parsed.tool_calls:
                message['content'] = parsed.content or None
                message['tool_calls'] = [call if isinstance(call, dict) else call.to_dict()
                                         for call in parsed.tool_calls]
                finish = 'tool_calls' if finish == 'stop' else finish
        choice = {'index': c.index, 'message': message, 'logprobs': None, 'finish_reason': finish}
        if body.logprobs:
            choice['logprobs'] = {'content': server.token_texts.chat_logprobs(c.token_ids, c.logprobs,
                                                                               body.top_logprobs or 0)}
        out.append(choice)
    return {'id': rid, 'object': 'chat.completion', 'created': int(time.time()), 'model': server.config.model_name,
            'choices': out, 'usage': usage.body()}


# ---- completions -----------------------------------------------------------------------------------------

class _CompletionCtx:

    def __init__(self, server: Server, body: CompletionRequest, rid: str, echo: list[str] | None,
                 timer: _RequestTimer, n: int, n_prompts: int):
        self.server, self.body, self.rid, self.echo, self.timer = server, body, rid, echo, timer
        self.n, self.n_prompts = n, n_prompts
        self.created = int(time.time())
        self.model = server.config.model_name
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.usages = [_Usage() for _ in range(n_prompts)]
        self.offsets = [0] * (n * n_prompts)
        self.echoed = [False] * (n * n_prompts)
        self.done = 0

    def index(self, k: int, r: Response) -> int:
        return k * self.n + r.index

    def start(self):
        return ()

    def logprobs(self, i: int, token_ids, logprobs) -> dict:
        lp = self.server.token_texts.completion_logprobs(token_ids, logprobs, self.body.logprobs or 0,
                                                         self.offsets[i])
        if lp['text_offset']:
            self.offsets[i] = lp['text_offset'][-1] + len(lp['tokens'][-1])
        return lp

    def feed(self, item: tuple[int, Response]):
        k, r = item
        i = self.index(k, r)
        self.usages[k].add(r.index, r)
        self.timer.token(r.generate_token_len)
        text = r.text
        if self.echo is not None and not self.echoed[i]:
            self.echoed[i] = True
            text = self.echo[k] + text
        lp = self.logprobs(i, r.token_ids, r.logprobs) if self.body.logprobs is not None and r.logprobs else None
        if r.finish_reason is not None:
            self.done += 1
            self.timer.done(r.generate_token_len, r.input_token_len, r.finish_reason)
        if not text and lp is None and r.finish_reason is None:
            return
        chunk = {'id': self.rid, 'object': 'text_completion', 'created': self.created, 'model': self.model,
                 'choices': [{'index': i, 'text': text, 'logprobs': lp, 'finish_reason': r.finish_reason}]}
        if self.include_usage:
            chunk['usage'] = None
        yield chunk

    def usage(self) -> dict:
        p = sum(u.prompt_tokens for u in self.usages)
        c = sum(sum(u.completion.values()) for u in self.usages)
        return {'prompt_tokens': p, 'completion_tokens': c, 'total_tokens': p + c,
                'prompt_tokens_details': {'cached_tokens': sum(u.cached_tokens for u in self.usages)}}

    def finish(self):
        if self.include_usage:
            yield {'id': self.rid, 'object': 'text_completion', 'created': self.created, 'model': self.model,
                   'choices': [], 'usage': self.usage()}


async def _completion_whole(ctx: _CompletionCtx, merged):
    try:
        first, agen = await _first(merged)
    except Exception as e:
        raise _engine_error(e) from e
    ctx.timer.accepted()
    total = ctx.n * ctx.n_prompts
    texts = [[] for _ in range(total)]
    lps: list[dict | None] = [None] * total
    finish = ['stop'] * total
    try:
        async for item in _rest(first, agen):
            for chunk in ctx.feed(item):
                ch = chunk['choices'][0]
                i = ch['index']
                texts[i].append(ch['text'])
                if ch['logprobs'] is not None:
                    if lps[i] is None:
                        lps[i] = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
                    for key in lps[i]:
                        lps[i][key].extend(ch['logprobs'][key])
                if ch['finish_reason'] is not None:
                    finish[i] = ch['finish_reason']
    except Exception as e:
        raise _engine_error(e) from e
    finally:
        await agen.aclose()
    if ctx.body.logprobs is not None:
        empty = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
        lps = [lp or dict(empty) for lp in lps]
    choices = [{'index': i, 'text': ''.join(texts[i]), 'logprobs': lps[i], 'finish_reason': finish[i]}
               for i in range(total)]
    return {'id': ctx.rid, 'object': 'text_completion', 'created': ctx.created, 'model': ctx.model,
            'choices': choices, 'usage': ctx.usage()}


# ---- /generate ---------------------------------------------------------------------------------------------

async def _generate(request: Request, server: Server, engine: AsyncEngine, body: GenerateRequest):
    sid = body.session_id
    if sid > _MAX_USER_SESSION_ID:
        raise APIError(400, f'session_id must be at most {_MAX_USER_SESSION_ID}', param='session_id')
    if body.cancel:
        if sid >= 0:
            engine.engine.abort(sid)
            if server.sessions.pop(sid, None) is not None:
                engine.engine.end(sid)
        return {'text': '', 'tokens': 0, 'input_tokens': 0, 'history_tokens': 0, 'finish_reason': 'abort'}
    continuing = sid >= 0 and server.sessions.get(sid, False)
    if body.input_ids is not None:
        ids = list(body.input_ids)
        if max(ids) >= engine.model_info.vocab_size:
            raise APIError(400, f'token id {max(ids)} is outside the vocabulary '
                                f'[0, {engine.model_info.vocab_size})', param='input_ids')
    elif body.do_preprocess:
        ids = engine.encode(body.prompt, do_preprocess=True)
    else:
        ids = engine.tokenizer.encode(body.prompt, add_special_tokens=not continuing)
    if not ids:
        raise APIError(400, 'the prompt is empty', param='prompt')
    max_tokens = body.max_tokens or body.request_output_len
    room = engine.session_len - len(ids)
    try:
        gen = GenerationConfig(max_new_tokens=max(1, min(max_tokens or room, room)),
                               min_new_tokens=body.min_new_tokens if body.min_new_tokens <= (max_tokens or room)
                               else 0,
                               do_sample=body.temperature > 0, temperature=body.temperature, top_p=body.top_p,
                               top_k=max(body.top_k, 0), min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                               ignore_eos=body.ignore_eos, random_seed=body.seed, stop_words=body.stop,
                               skip_special_tokens=body.skip_special_tokens,
                               spaces_between_special_tokens=body.spaces_between_special_tokens,
                               logprobs=1 if body.return_logprobs else None)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    kwargs: dict[str, Any] = {}
    if sid >= 0:
        kwargs = dict(session_id=sid, sequence_start=not continuing, sequence_end=not body.interactive_mode)
    timer = _RequestTimer(server.metrics)

    async def stream():
        ok = False
        try:
            async with server.slot():
                async for r in engine.generate(None, gen_config=gen, input_ids=ids, **kwargs):
                    yield r
            ok = True
        finally:
            if sid >= 0:
                if ok and body.interactive_mode:
                    server.sessions[sid] = True
                else:
                    if server.sessions.pop(sid, None) is not None and not ok:
                        engine.engine.end(sid)

    def piece(r: Response) -> dict:
        out = {'text': r.text, 'tokens': r.generate_token_len, 'input_tokens': r.input_token_len,
               'history_tokens': r.input_token_len - len(ids), 'finish_reason': r.finish_reason}
        if body.return_logprobs:
            out['logprobs'] = [{str(k): v for k, v in d.items()} for d in (r.logprobs or [])]
            out['token_ids'] = list(r.token_ids)
        return out

    try:
        first, agen = await _first(stream())
    except Exception as e:
        raise _engine_error(e) from e
    timer.accepted()
    if body.stream:
        async def lines():
            try:
                async for r in _rest(first, agen):
                    timer.token(r.generate_token_len)
                    if r.finish_reason is not None:
                        timer.done(r.generate_token_len, r.input_token_len, r.finish_reason)
                    yield json.dumps(piece(r), ensure_ascii=False) + '\n'
            except Exception as e:
                yield json.dumps(_engine_error(e).body()) + '\n'
            finally:
                timer.abandoned()  # a no-op after the last answer
                await agen.aclose()
        return StreamingResponse(lines(), media_type='application/x-ndjson')

    async def whole():
        pieces, last, all_ids, lps = [], None, [], []
        try:
            async for r in _rest(first, agen):
                timer.token(r.generate_token_len)
                pieces.append(r.text)
                all_ids.extend(r.token_ids)
                lps.extend(r.logprobs or [])
                last = r
        except Exception as e:
            raise _engine_error(e) from e
        finally:
            await agen.aclose()
        timer.done(last.generate_token_len, last.input_token_len, last.finish_reason)
        out = piece(last)
        out['text'] = ''.join(pieces)
        if body.return_logprobs:
            out['token_ids'] = all_ids
            out['logprobs'] = [{str(k): v for k, v in d.items()} for d in lps]
        return out

    return await _until_done(request, whole(), timer)


# ---- entry point -------------------------------------------------------------------------------------------

def _as_tuple(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(',')
    elif not isinstance(value, (list, tuple)):
        value = [value]  # fire reads --api-keys 123 as a number
    return tuple(str(v).strip() for v in value if str(v).strip())


def _own_url(server_name: str, server_port: int) -> str:
    host = server_name
    if host in ('0.0.0.0', '::', ''):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = '127.0.0.1'
    return f'http://{host}:{server_port}'


def serve(model_path: str | None = None, backend: str | None = None, server_name: str = '0.0.0.0',
          server_port: int = 23333, api_keys=None, model_name: str | None = None, chat_template: str | None = None,
          max_concurrent_requests: int | None = None, tool_call_parser: str | None = None,
          reasoning_parser: str | None = None, proxy_url: str | None = None, allow_origins=None,
          allow_credentials: bool = False, allow_methods=('*',), allow_headers=('*',),
          session_len: int | None = None, max_batch_size: int | None = None,
          cache_max_entry_count: float | None = None, cache_block_seq_len: int | None = None,
          enable_prefix_caching: bool = False, quant_policy: int = 0, model_format: str | None = None,
          tp: int = 1, dtype: str = 'auto', num_threads: int | None = None, device: str | None = None,
          log_level: str = 'INFO') -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (see ``lmd serve api_server --help``)."""
    import uvicorn

    from lmd.messages import (
        ChatTemplateConfig,
        PytorchEngineConfig,
        TurbomindEngineConfig,
    )
    from lmd.model_path import prepare_model_dir

    level = str(log_level).upper()
    logging.basicConfig(level=level, format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    logging.getLogger('lmd').setLevel(level)
    model_dir = prepare_model_dir(model_path)  # a missing model fails here, before the port opens
    if backend not in (None, 'pytorch', 'turbomind'):
        raise ValueError(f"--backend {backend!r} is invalid: allowed values are 'pytorch', 'turbomind'")
    if backend is None:  # as pipeline() picks: TurboMind for what only it runs, else PyTorch
        from lmd.async_engine import _turbomind_only
        backend = 'turbomind' if _turbomind_only(model_dir) else 'pytorch'
    fields = dict(session_len=session_len, max_batch_size=max_batch_size,
                  cache_max_entry_count=cache_max_entry_count, cache_block_seq_len=cache_block_seq_len,
                  enable_prefix_caching=enable_prefix_caching, quant_policy=quant_policy,
                  model_format=model_format, tp=tp, dtype=dtype, device=device, num_threads=num_threads)
    fields = {k: v for k, v in fields.items() if v is not None}
    config = (TurbomindEngineConfig if backend == 'turbomind' else PytorchEngineConfig)(**fields)
    template = ChatTemplateConfig(model_name=chat_template) if chat_template else None
    name = model_name or (os.path.basename(str(model_path).rstrip('/')) if model_path else 'smollm2')
    server_config = ServerConfig(model_name=name, api_keys=_as_tuple(api_keys),
                                 max_concurrent_requests=max_concurrent_requests, tool_call_parser=tool_call_parser,
                                 reasoning_parser=reasoning_parser, proxy_url=proxy_url,
                                 allow_origins=_as_tuple(allow_origins), allow_credentials=allow_credentials,
                                 allow_methods=_as_tuple(allow_methods), allow_headers=_as_tuple(allow_headers),
                                 server_url=_own_url(server_name, server_port))
    server = Server(server_config, engine_factory=lambda: AsyncEngine(model_dir, backend=backend,
                                                                      backend_config=config,
                                                                      chat_template_config=template))
    app = build_app(server)
    print(f'lmd api_server: serving {name!r} on http://{server_name}:{server_port} '
          f'(docs: /docs; health: /health)', flush=True)
    uvicorn.run(app, host=server_name, port=server_port, log_level=level.lower(), timeout_keep_alive=30)


def main(argv: list[str] | None = None) -> int:
    from lmd.cli import main as lmd_main
    return lmd_main(['serve', 'api_server', *(argv if argv is not None else __import__('sys').argv[1:])])


if __name__ == '__main__':
    raise SystemExit(main())
