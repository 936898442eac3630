"""lmd serve proxy: one OpenAI-compatible address in front of many lmd api_servers ("nodes").

Nodes register with ``POST /nodes/add`` (an api_server started with ``--proxy-url`` does it
itself) and leave with ``POST /nodes/remove``. The proxy routes ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/embeddings`` to a healthy node serving the request's ``model``, streams SSE answers
through chunk by chunk, and lists the union of the healthy nodes' models at ``/v1/models``.

The node table (registration, health, the routing strategies) is ``proxy_nodes.py``; this module
relays requests to the node it picks and builds the app.

A request is retried on another node only while nothing has been sent to the client: the
connection was refused, or the node dropped it before the first byte of the answer. Once a
stream has started, a node that dies ends it with an SSE ``error`` event (the openai client
raises it) and no ``[DONE]``. A client that hangs up closes the upstream connection, so the node
aborts the request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .proxy_nodes import (
    LATENCY_WINDOW,
    ROUTING_STRATEGIES,
    Node,
    NodeTable,
    ProxyError,
    choose_node,
    describe,
    error_response,
    normalize_url,
    request_prefix,
)

__all__ = ['LATENCY_WINDOW', 'ROUTING_STRATEGIES', 'Node', 'NodeTable', 'ProxyError', 'Relay', 'build_app',
           'choose_node', 'error_response', 'main', 'normalize_url', 'proxy']

logger = logging.getLogger('lmd.proxy')

# request headers that describe the client's connection to the proxy, not the request
_HOP_REQUEST_HEADERS = frozenset({'host', 'content-length', 'connection', 'keep-alive', 'proxy-authorization',
                                  'proxy-connection', 'te', 'trailer', 'transfer-encoding', 'upgrade',
                                  'accept-encoding'})
_HOP_RESPONSE_HEADERS = frozenset({'content-length', 'connection', 'keep-alive', 'transfer-encoding',
                                   'content-encoding', 'date', 'server'})


# ---- relaying -------------------------------------------------------------------------------

class _RelayedStream(StreamingResponse):
    """A node's SSE answer passed through as it arrives. However the relay ends (done, node
    failure, client gone), the upstream connection is closed and the node's bookkeeping settled."""

    def __init__(self, upstream: httpx.Response, first: bytes, chunks, node: Node, table: NodeTable,
                 start: float, headers: dict):
        self.upstream, self.node, self.table, self.start = upstream, node, table, start
        self.completed = False
        super().__init__(self._body(first, chunks), status_code=upstream.status_code, headers=headers)

    async def _body(self, first: bytes, chunks):
        yield first
        try:
            async for chunk in chunks:
                yield chunk
            self.completed = True
        except httpx.TransportError as e:
            reason = f'dropped the stream: {describe(e)}'
            self.node.num_failures += 1
            self.node.last_error = reason
            logger.warning('node %s %s', self.node.url, reason)
            error = {'error': {'message': f'api_server {self.node.url} {reason}', 'type': 'upstream_error',
                               'param': None, 'code': 'node_failed'}}
            yield f'data: {json.dumps(error)}\n\n'.encode()
            self.table.probe_soon(self.node)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.node.unfinished -= 1
            if self.completed and self.upstream.status_code == 200:
                self.node.latencies.append(time.perf_counter() - self.start)
            elif not self.completed:
                logger.info('stream from %s closed before its end (client gone or node failed)', self.node.url)


class Relay:
    """Sends one OpenAI request to a node chosen by the table, retrying on another node while
    nothing has reached the client."""

    def __init__(self, table: NodeTable, client: httpx.AsyncClient):
        self.table = table
        self.client = client

    async def __call__(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProxyError(400, f'the request body is not valid JSON: {e}', code='invalid_json') from None
        if not isinstance(payload, dict):
            raise ProxyError(400, f'the request body must be a JSON object, got {type(payload).__name__}')
        model = payload.get('model')
        if model is not None and not isinstance(model, str):
            raise ProxyError(400, f'model must be a string, got {type(model).__name__}', param='model')
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_REQUEST_HEADERS}
        headers['accept-encoding'] = 'identity'  # relay bytes as they come, never re-encoded

        prefix = request_prefix(payload) if self.table.router is not None else None
        tried: set[str] = set()
        why: dict[str, str] = {}
        while True:
            node = self.table.choose(model, tried, why, prefix)
            # counted before the first await, so requests arriving together see each other's choice
            node.unfinished += 1
            node.num_requests += 1
            attempt = _Attempt()
            try:
                return await _unless_client_leaves(request, self._attempt(node, path, body, headers, attempt))
            except _ClientGone:
                logger.info('client left before %s answered; request closed on the node', node.url)
                return Response(status_code=499)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                reason = f'connection failed: {describe(e)}'
                self.table.mark_unhealthy(node, reason)
            except httpx.TransportError as e:
                # The node took the request and dropped it before answering: it may be dying (the
                # probe says) or a kept-alive connection may have gone stale; either way, another node.
                reason = f'dropped the request: {describe(e)}'
                self.table.probe_soon(node)
            finally:
                if not attempt.streaming:
                    node.unfinished -= 1
            node.num_failures += 1
            tried.add(node.url)
            why[node.url] = reason
            logger.warning('node %s %s; retrying on another node', node.url, reason)

    async def _attempt(self, node: Node, path: str, body: bytes, headers: dict, attempt: _Attempt) -> Response:
        """The node's answer: a whole body, or a stream whose first chunk has arrived (until then a
        failure can still go to another node)."""
        start = time.perf_counter()
        upstream = await self.client.send(
            self.client.build_request('POST', node.url + path, content=body, headers=headers), stream=True)
        try:
            if upstream.headers.get('content-type', '').startswith('text/event-stream'):
                chunks = upstream.aiter_raw()
                first = await anext(chunks, b'')
                attempt.streaming = True  # from here the response owns the upstream and the node's count
                return _RelayedStream(upstream, first, chunks, node, self.table, start, _response_headers(upstream))
            content = await upstream.aread()
        finally:
            if not attempt.streaming:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
        if upstream.status_code == 200:
            node.latencies.append(time.perf_counter() - start)
        return Response(content, status_code=upstream.status_code, headers=_response_headers(upstream))


@dataclass
class _Attempt:
    streaming: bool = False  # a _RelayedStream took over the upstream response


class _ClientGone(Exception):
    pass


async def _unless_client_leaves(request: Request, work):
    """Await ``work``, cancelling it (which closes its upstream connection) if the client hangs up first.

    Uvicorn does not cancel a handler whose client left, and the node would go on generating an
    answer nobody reads; streams notice the hang-up on their own (StreamingResponse)."""
    async def disconnected():
        while (await request.receive())['type'] != 'http.disconnect':
            pass
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if watch.done() and not watch.cancelled():
            raise _ClientGone() from None
        raise


def _response_headers(upstream: httpx.Response) -> dict:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_RESPONSE_HEADERS}


# ---- the app --------------------------------------------------------------------------------

def _as_list(value, flag: str) -> list[str]:
    """A list flag as fire or argparse hands it over: None, 'a,b', a tuple, or one number (a numeric key)."""
    if value is None:
        return []
    if isinstance(value, str):
        items = value.replace(',', ' ').split()
    elif isinstance(value, (int, float)):
        items = [str(value)]
    else:
        items = [str(v) for v in value]
    if any(not v.strip() for v in items):
        raise ValueError(f'{flag} must not contain an empty value, got {value!r}')
    return items


def build_app(routing_strategy: str = 'min_expected_latency', api_keys=None, health_check_interval: float = 5.0,
              health_check_timeout: float = 5.0, nodes=None, seed: int | None = None) -> FastAPI:
    """The proxy's FastAPI app.

    Args:
        routing_strategy: 'random', 'min_expected_latency', 'min_observed_latency' or 'prefix_aware'.
        api_keys: keys a client must send as ``Authorization: Bearer KEY`` (to /v1/* and /nodes/*);
            None or empty lets everyone in.
        health_check_interval: seconds between health probes of every node.
        health_check_timeout: seconds a node's /health may take before it counts as down.
        nodes: api_server URLs to register at startup.
        seed: seeds the random choices (tests).
    """
    if routing_strategy not in ROUTING_STRATEGIES:
        raise ValueError(f'--routing-strategy {routing_strategy!r} is invalid: allowed values are '
                         f'{", ".join(ROUTING_STRATEGIES)}')
    if not health_check_interval > 0:
        raise ValueError(f'--health-check-interval must be > 0 seconds, got {health_check_interval!r}')
    if not health_check_timeout > 0:
        raise ValueError(f'--health-check-timeout must be > 0 seconds, got {health_check_timeout!r}')
    keys = _as_list(api_keys, '--api-keys')
    try:
        initial = [normalize_url(u) for u in _as_list(nodes, '--nodes')]
    except ProxyError as e:
        raise ValueError(f'--nodes: {e.message}') from None
    state = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # generation can take minutes: no read timeout on relayed requests
        client = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                       keepalive_expiry=2.0))
        table = NodeTable(routing_strategy, client, f'Bearer {keys[0]}' if keys else None, health_check_timeout,
                          seed)
        state['table'], state['relay'] = table, Relay(table, client)
        for url in initial:
            await table.add(url)
        health = asyncio.create_task(table.health_loop(health_check_interval))
        logger.info('proxy routing by %s across %d node(s)', routing_strategy, len(table.nodes))
        try:
            yield
        finally:
            health.cancel()
            table.close()
            await client.aclose()

    app = FastAPI(title='lmd proxy', lifespan=lifespan)

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, f'{request.method} {request.url.path}: {exc.detail}',
                              code=str(exc.status_code))

    async def check_api_key(request: Request):
        if not keys:
            return
        scheme, _, token = request.headers.get('authorization', '').partition(' ')
        if scheme.lower() != 'bearer' or not any(secrets.compare_digest(token.strip(), k) for k in keys):
            what = 'no API key was sent' if not token.strip() else "the API key is not one of the proxy's"
            raise ProxyError(401, f'Incorrect API key: {what}; send "Authorization: Bearer KEY"',
                             code='invalid_api_key')

    guard = [Depends(check_api_key)]

    @app.get('/health')
    async def health():
        table: NodeTable = state['table']
        healthy = sum(n.healthy for n in table.nodes.values())
        return JSONResponse({'status': 'ok' if healthy else 'no healthy node', 'healthy_nodes': healthy,
                             'nodes': len(table.nodes)}, status_code=200 if healthy else 503)

    @app.get('/v1/models', dependencies=guard)
    async def models():
        seen, data = set(), []
        for node in state['table'].nodes.values():
            for card in node.model_cards if node.healthy else ():
                if card['id'] not in seen:
                    seen.add(card['id'])
                    data.append(card)
        return {'object': 'list', 'data': data}

    @app.post('/v1/chat/completions', dependencies=guard)
    async def chat_completions(request: Request):
        return await state['relay'](request, '/v1/chat/completions')

    @app.post('/v1/completions', dependencies=guard)
    async def completions(request: Request):
        return await state['relay'](request, '/v1/completions')

    @app.post('/v1/embeddings', dependencies=guard)
    async def embeddings(request: Request):
        return await state['relay'](request, '/v1/embeddings')

    async def _json_object(request: Request) -> dict:
        try:
            payload = json.loads(await request.body())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProxyError(400, f'the request body is not valid JSON: {e}', code='invalid_json') from None
        if not isinstance(payload, dict):
            raise ProxyError(400, 'the request body must be a JSON object like {"url": "http://host:port"}')
        return payload

    @app.post('/nodes/add', dependencies=guard)
    async def add_node(request: Request):
        payload = await _json_object(request)
        url = normalize_url(payload.get('url'))
        status = payload.get('status') or {}
        if not isinstance(status, dict):
            raise ProxyError(400, f'status must be an object, got {type(status).__name__}', param='status')
        models = status.get('models')
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise ProxyError(400, 'status.models must be a list of model names', param='status.models')
        speed = status.get('speed')
        if speed is not None and (isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed > 0):
            raise ProxyError(400, f'status.speed must be a number > 0, got {speed!r}', param='status.speed')
        node = await state['table'].add(url, models, speed, request.headers.get('authorization'))
        return node.status()

    @app.post('/nodes/remove', dependencies=guard)
    async def remove_node(request: Request):
        payload = await _json_object(request)
        node = state['table'].remove(normalize_url(payload.get('url')))
        return {'url': node.url, 'removed': True}

    @app.get('/nodes/status', dependencies=guard)
    async def nodes_status():
        table: NodeTable = state['table']
        return {'routing_strategy': table.strategy, 'nodes': [n.status() for n in table.nodes.values()]}

    return app


def proxy(*, server_name: str = '0.0.0.0', server_port: int = 8000, routing_strategy: str = 'min_expected_latency',
          api_keys=None, health_check_interval: float = 5.0, health_check_timeout: float = 5.0, nodes=None,
          log_level: str = 'INFO'):
    """Serve the proxy until interrupted (``lmd serve proxy``).

    Args:
        server_name: the address to listen on.
        server_port: the port to listen on.
        routing_strategy: random (weighted by node speed), min_expected_latency (least unfinished
            requests x mean latency), min_observed_latency (least mean latency) or prefix_aware (the node
            that was sent the longest prefix of the prompt, whose prefix cache likely holds it, unless the
            nodes' unfinished requests are out of balance; for api_servers with --enable-prefix-caching).
        api_keys: keys clients must send as "Authorization: Bearer KEY" (also for /nodes/*); the header
            is forwarded to the nodes unchanged.
        health_check_interval: seconds between health probes of the nodes.
        health_check_timeout: seconds a node's /health may take before it counts as down.
        nodes: api_server URLs to register at startup (more can join with POST /nodes/add).
        log_level: DEBUG, INFO, WARNING or ERROR.
    """
    import uvicorn
    level = str(log_level).upper()
    if level not in ('DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'):
        raise ValueError(f'--log-level {log_level!r} is invalid: allowed values are DEBUG, INFO, WARNING, ERROR')
    logging.basicConfig(level=level, format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    logger.setLevel(level)
    logging.getLogger('httpx').setLevel(max(logging.WARNING, logging.getLevelName(level)))  # one line per probe
    app = build_app(routing_strategy, api_keys, health_check_interval, health_check_timeout, nodes)
    uvicorn.run(app, host=server_name, port=int(server_port), log_level=level.lower(), timeout_keep_alive=5)


def main(argv: list[str] | None = None) -> int:
    from lmd.runner import run_command
    return run_command(proxy, argv, 'lmd serve proxy')


if __name__ == '__main__':
    raise SystemExit(main())
