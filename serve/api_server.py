"""``lmd serve api_server``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncEngine.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/embeddings`` (the one model route of ``--task embed``),
``POST /generate`` (LMDeploy's raw endpoint, with interactive sessions), ``POST /v1/encode``
and ``/v1/decode``, vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``,
``GET /health``, ``GET /metrics``; vLLM's ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (LoRA adapters, named by requests' ``model`` field, listed by
``/v1/models`` under the base model).

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
import socket
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.responses import Response as HTTPResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lmd.async_engine import AsyncEngine
from lmd.errors import ModelFormatError

from .chat_completions import answer_chat
from .completions import answer_completions
from .embeddings import answer_embeddings
from .errors import APIError, error_response
from .generate import run_generate
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DecodeRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    EncodeRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from .server import Server, ServerConfig
from .tokenization import check_in_vocab, detokenize, tokenize, tokenizer_info

__all__ = ['Server', 'ServerConfig', 'build_app', 'serve']

logger = logging.getLogger('lmd.serve')


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
        if server.needs_load:
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
        base = server.config.model_name
        card = {'id': base, 'object': 'model', 'created': server.created, 'owned_by': 'lmd', 'root': base,
                'parent': None}
        cards = [card]
        if engine is not None:
            card['max_model_len'] = engine.session_len
            # a LoRA adapter is a model of its own whose parent is the base, as vLLM lists them
            cards += [{'id': name, 'object': 'model', 'created': server.created, 'owned_by': 'lmd',
                       'root': engine.adapter_path(name), 'parent': base, 'max_model_len': engine.session_len}
                      for name in engine.adapter_names]
        return {'object': 'list', 'data': cards}

    # ---- LoRA adapters at run time (vLLM's routes) ---------------------------------------------------

    @app.post('/v1/load_lora_adapter')
    async def load_lora_adapter(request: Request, body: LoadLoraAdapterRequest):
        server.check_auth(request)
        engine = server.ready_engine()
        if body.lora_name == server.config.model_name or body.lora_name in engine.adapter_names:
            raise APIError(400, f'the name {body.lora_name!r} is taken: an adapter or the model is served under it',
                           param='lora_name')
        try:  # reads and fuses the adapter's files: off the event loop
            await asyncio.to_thread(engine.load_adapter, body.lora_name, body.lora_path)
        except (ModelFormatError, ValueError, OSError) as e:
            raise APIError(400, str(e), param='lora_path') from None
        return HTTPResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post('/v1/unload_lora_adapter')
    async def unload_lora_adapter(request: Request, body: UnloadLoraAdapterRequest):
        server.check_auth(request)
        engine = server.ready_engine()
        if body.lora_name not in engine.adapter_names:
            raise APIError(404, f'the LoRA adapter {body.lora_name!r} is not loaded', param='lora_name',
                           code='model_not_found')
        try:
            await asyncio.to_thread(engine.unload_adapter, body.lora_name)
        except ValueError as e:  # in use
            raise APIError(400, str(e), param='lora_name') from None
        return HTTPResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

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
                ids.append(engine.encode_text(t, add_special_tokens=body.add_bos))
        if isinstance(body.input, str):
            return {'input_ids': ids[0], 'length': len(ids[0])}
        return {'input_ids': ids, 'length': [len(x) for x in ids]}

    @app.post('/v1/decode')
    async def decode(request: Request, body: DecodeRequest):
        server.check_auth(request)
        engine = server.ready_engine()
        rows = body.input_ids if body.input_ids and isinstance(body.input_ids[0], list) else [body.input_ids]
        for row in rows:
            check_in_vocab(engine, row, 'input_ids')
        texts = [engine.decode(r, skip_special_tokens=body.skip_special_tokens) for r in rows]
        return {'text': texts if rows is body.input_ids else texts[0]}

    @app.post('/tokenize')  # vLLM's
    async def tokenize_route(request: Request, body: TokenizeRequest):
        server.check_auth(request)
        server.check_model(body.model)
        return tokenize(server.ready_engine(), body)

    @app.post('/detokenize')  # vLLM's
    async def detokenize_route(request: Request, body: DetokenizeRequest):
        server.check_auth(request)
        server.check_model(body.model)
        return detokenize(server.ready_engine(), body)

    @app.get('/tokenizer_info')  # vLLM's: what lm-evaluation-harness' remote tokenizer reads
    async def tokenizer_info_route(request: Request):
        server.check_auth(request)
        return tokenizer_info(server.ready_engine())

    # ---- generating -----------------------------------------------------------------------------

    @app.post('/v1/chat/completions')
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        server.check_auth(request)
        server.check_model(body.model)
        server.check_generating()
        return await answer_chat(request, server, server.ready_engine(), body)

    @app.post('/v1/completions')
    async def completions(request: Request, body: CompletionRequest):
        server.check_auth(request)
        server.check_model(body.model)
        server.check_generating()
        return await answer_completions(request, server, server.ready_engine(), body)

    @app.post('/generate')  # LMDeploy's own
    async def generate(request: Request, body: GenerateRequest):
        server.check_auth(request)
        server.check_generating()
        return await run_generate(request, server, server.ready_engine(), body)

    # ---- embeddings ------------------------------------------------------------------------------

    @app.post('/v1/embeddings')
    async def embeddings(request: Request, body: EmbeddingRequest):
        server.check_auth(request)
        server.check_model(body.model, adapters=False)
        return await answer_embeddings(server, server.ready_engine(), body)

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


def serve(model_path: str | None = None, *, backend: str = 'auto', server_name: str = '0.0.0.0',
          server_port: int = 23333, api_keys=None, model_name: str | None = None, chat_template: str | None = None,
          max_concurrent_requests: int | None = None, tool_call_parser: str | None = None,
          reasoning_parser: str | None = None, proxy_url: str | None = None, allow_origins=None,
          allow_credentials: bool = False, allow_methods=('*',), allow_headers=('*',),
          session_len: int | None = None, max_batch_size: int | None = None,
          cache_max_entry_count: float | None = None, cache_block_seq_len: int | None = None,
          enable_prefix_caching: bool = False, quant_policy: int = 0, model_format: str | None = None,
          tp: int = 1, dp: int = 1, pp: int = 1, distributed_executor_backend: str | None = None,
          ray_address: str | None = None, dtype: str = 'auto', num_threads: int | None = None,
          device: str | None = None,
          int8_activations: bool = False, speculative_algorithm: str | None = None,
          speculative_num_draft_tokens: int | None = None, speculative_draft_model: str | None = None,
          adapters=None, task: str = 'generate', log_level: str = 'INFO') -> None:
    """Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
    /v1/embeddings, /v1/models, /generate, /v1/encode, /v1/decode, /tokenize, /detokenize, /tokenizer_info,
    /health, /metrics (docs at /docs).

    Args:
        model_path: an HF model directory, a .gguf file, an AWQ/W8A8 directory, or 'smollm2' (the default).
        backend: 'auto' (TurboMind where it runs the model, else PyTorch), 'turbomind' or 'pytorch'.
        server_name: the address to listen on.
        server_port: the port to listen on.
        api_keys: keys clients must send as "Authorization: Bearer KEY"; several separated by commas.
        model_name: the name clients use in "model" (default: the model path's last part).
        chat_template: a built-in template name (chatml, llama3, qwen2, internlm2, base) instead of the model's.
        max_concurrent_requests: requests generating at once; more wait in the server.
        tool_call_parser: tool-call format: qwen (hermes), llama3, internlm, mistral, gpt-oss (default: by template).
        reasoning_parser: split reasoning into reasoning_content: deepseek-r1, qwen-qwq (qwen3), gpt-oss (harmony).
        proxy_url: a `lmd serve proxy` to register with at start (and leave at exit).
        allow_origins: CORS origins allowed, separated by commas ('*' for any).
        allow_credentials: CORS: allow credentials.
        allow_methods: CORS methods, separated by commas.
        allow_headers: CORS headers, separated by commas.
        session_len: the longest context in tokens (default: the model's, at most 8192).
        max_batch_size: requests the engine runs at once.
        cache_max_entry_count: the fraction of free memory the KV cache may take.
        cache_block_seq_len: tokens per KV cache block.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        quant_policy: KV cache quantization: 0 none, 8 int8, 4 int4.
        model_format: hf, awq, w8a8 or gguf (default: from the model).
        tp: tensor parallel degree.
        dp: data-parallel replicas: DP whole engines behind this one server, requests spread by load and by
            prefix-cache locality, each replica with NUM_THREADS // DP threads.
        pp: pipeline parallel stages (PyTorch engine).
        distributed_executor_backend: how the PyTorch engine starts its tp x pp ranks: mp (local processes,
            the default) or ray (a Ray cluster's placement group).
        ray_address: the Ray cluster to place the ranks on (default: RAY_ADDRESS, else a local one); implies
            --distributed-executor-backend ray.
        dtype: auto, float32, bfloat16 or float16.
        num_threads: CPU threads for the engine (default: all cores).
        device: cpu or cuda.
        int8_activations: TurboMind: quantized matmuls take int8 activations as llama.cpp's (faster on CPUs).
        speculative_algorithm: speculative decoding: ngram (drafts by prompt lookup) or draft_target.
        speculative_num_draft_tokens: tokens drafted per step (default 4).
        speculative_draft_model: the draft model, with draft_target.
        adapters: LoRA adapters (PEFT folders) served beside the model, as name=path, separated by commas;
            a request's "model" names one. More load at run time: POST /v1/load_lora_adapter.
        task: generate (text; /v1/embeddings answers too), or embed (an embedding model: /v1/embeddings
            only, pooled as its sentence-transformers files say, else last token, normalized).
        log_level: DEBUG, INFO, WARNING or ERROR.
    """
    import uvicorn

    from lmd.backend import check_backend, command_engine_config, command_speculative_config
    from lmd.embeddings import pooler_config_from_dir
    from lmd.lora import parse_adapters
    from lmd.messages import ChatTemplateConfig
    from lmd.model_path import prepare_model_dir

    level = str(log_level).upper()
    logging.basicConfig(level=level, format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    logging.getLogger('lmd').setLevel(level)
    model_dir = prepare_model_dir(model_path)  # a missing model fails here, before the port opens
    check_backend(backend)  # 'auto' is decided as the engine is built (lmd.backend), and logged
    fields = dict(session_len=session_len, max_batch_size=max_batch_size,
                  cache_max_entry_count=cache_max_entry_count, cache_block_seq_len=cache_block_seq_len,
                  enable_prefix_caching=enable_prefix_caching, quant_policy=quant_policy,
                  model_format=model_format, tp=tp, dp=dp, pp=pp,
                  distributed_executor_backend=distributed_executor_backend, ray_address=ray_address,
                  dtype=dtype, device=device, num_threads=num_threads,
                  speculative_config=command_speculative_config(speculative_algorithm, speculative_num_draft_tokens,
                                                                speculative_draft_model),
                  adapters=parse_adapters(adapters) or None)
    config = command_engine_config(fields, backend, int8_activations)  # checked before the port opens
    template = ChatTemplateConfig(model_name=chat_template) if chat_template else None
    if task == 'embed':  # an embedder's pooling files are checked before the port opens
        pooler = pooler_config_from_dir(model_dir)
        logger.info('task embed: %s pooling, %snormalized', pooler.pooling_type, '' if pooler.normalize else 'not ')
    name = model_name or (os.path.basename(str(model_path).rstrip('/')) if model_path else 'smollm2')
    server_config = ServerConfig(model_name=name, api_keys=_as_tuple(api_keys),
                                 max_concurrent_requests=max_concurrent_requests, tool_call_parser=tool_call_parser,
                                 reasoning_parser=reasoning_parser, proxy_url=proxy_url,
                                 allow_origins=_as_tuple(allow_origins), allow_credentials=allow_credentials,
                                 allow_methods=_as_tuple(allow_methods), allow_headers=_as_tuple(allow_headers),
                                 server_url=_own_url(server_name, server_port), task=task)
    server = Server(server_config, engine_factory=lambda: AsyncEngine(model_dir, backend=backend,
                                                                      backend_config=config,
                                                                      chat_template_config=template))
    app = build_app(server)
    print(f'lmd api_server: serving {name!r} on http://{server_name}:{server_port} '
          f'(docs: /docs; health: /health)', flush=True)
    uvicorn.run(app, host=server_name, port=server_port, log_level=level.lower(), timeout_keep_alive=30)


def main(argv: list[str] | None = None) -> int:
    from lmd.runner import run_command
    return run_command(serve, argv, 'lmd serve api_server')


if __name__ == '__main__':
    raise SystemExit(main())
