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
import logging
import os
import secrets
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.responses import Response as HTTPResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lmd.async_engine import AsyncEngine
from lmd.messages import GenerationConfig

from .chat_completions import ChatStream, chat_whole, prepare_chat
from .completions import CompletionStream, completion_prompts, completion_whole
from .generate import run_generate
from .metrics import ServerMetrics
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DecodeRequest,
    EncodeRequest,
    GenerateRequest,
)
from .streaming import (
    APIError,
    RequestTimer,
    error_response,
    merge_streams,
    run_answers,
    sse_response,
    until_done,
)
from .token_texts import TokenTexts

logger = logging.getLogger('lmd.serve')

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
        return error_response(e)

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
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError):
        server.metrics.error(400)
        return error_response(APIError(400, str(e)))

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
        timer = RequestTimer(server.metrics, body.n)
        prep = prepare_chat(server, engine, body)
        gen = server.gen_config(body, body.max_completion_tokens or body.max_tokens, len(prep.input_ids),
                                (body.top_logprobs or 0) if body.logprobs else None, prep.response_format)
        rid = f'chatcmpl-{secrets.token_hex(12)}'
        stream = run_answers(server, engine, prep.input_ids, gen, body.session_id)
        if body.stream:
            return await sse_response(request, server, timer, stream,
                                          ChatStream(server, body, prep, rid, timer))
        return await until_done(request, chat_whole(server, body, prep, rid, stream, timer), timer)

    # ---- completions -----------------------------------------------------------------------------

    @app.post('/v1/completions')
    async def completions(request: Request, body: CompletionRequest):
        server.check_auth(request)
        server.check_model(body.model)
        engine = server.ready_engine()
        if body.echo and body.logprobs is not None:
            raise APIError(400, 'echo with logprobs needs the prompt tokens\' logprobs, which lmd does not '
                                'compute; send echo or logprobs', param='echo')
        prompts = completion_prompts(engine, body.prompt)
        timer = RequestTimer(server.metrics, body.n * len(prompts))
        for i, ids in enumerate(prompts):
            server.check_prompt_len(engine, len(ids), 'prompt' if len(prompts) == 1 else f'prompt.{i}')
        response_format = body.response_format.to_generation_format() if body.response_format else None
        gens = [server.gen_config(body, body.max_tokens, len(ids), body.logprobs, response_format)
                for ids in prompts]
        streams = [run_answers(server, engine, ids, g, body.session_id if len(prompts) == 1 else None)
                   for ids, g in zip(prompts, gens)]
        rid = f'cmpl-{secrets.token_hex(12)}'
        echo = [engine.tokenizer.decode(ids, skip_special_tokens=False) if not isinstance(body.prompt, str)
                else body.prompt for ids in prompts] if body.echo else None
        ctx = CompletionStream(server, body, rid, echo, timer, n=body.n, n_prompts=len(prompts))
        merged = merge_streams(streams)
        if body.stream:
            return await sse_response(request, server, timer, merged, ctx)
        return await until_done(request, completion_whole(ctx, merged), timer)

    # ---- LMDeploy's /generate --------------------------------------------------------------------

    @app.post('/generate')
    async def generate(request: Request, body: GenerateRequest):
        server.check_auth(request)
        engine = server.ready_engine()
        return await run_generate(request, server, engine, body)

    return app


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
