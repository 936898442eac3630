"""lmd serve proxy: one OpenAI-compatible address in front of many lmd api_servers ("nodes").

Nodes register with ``POST /nodes/add`` (an api_server started with ``--proxy-url`` does it
itself) and leave with ``POST /nodes/remove``. The proxy routes ``/v1/chat/completions`` and
``/v1/completions`` to a healthy node serving the request's ``model``, streams SSE answers
through chunk by chunk, and lists the union of the healthy nodes' models at ``/v1/models``.

What a node's state means (``Node``):
- ``healthy``: its last ``GET /health`` answered below 500 within the timeout. A background task
  polls every ``health_check_interval`` seconds; a refused connection on a request marks the node
  unhealthy at once. Unhealthy nodes get no requests until they answer again.
- ``unfinished``: requests the proxy has sent it and not finished relaying (streams included).
- ``latencies``: end-to-end seconds of its last ``LATENCY_WINDOW`` successful requests.

A request is retried on another node only while nothing has been sent to the client: the
connection was refused, or the node dropped it before the first byte of the answer. Once a
stream has started, a node that dies ends it with an SSE ``error`` event (the openai client
raises it) and no ``[DONE]``. A client that hangs up closes the upstream connection, so the node
aborts the request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import secrets
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger('lmd.proxy')

ROUTING_STRATEGIES = ('random', 'min_expected_latency', 'min_observed_latency')
LATENCY_WINDOW = 32
# request headers that describe the client's connection to the proxy, not the request
_HOP_REQUEST_HEADERS = frozenset({'host', 'content-length', 'connection', 'keep-alive', 'proxy-authorization',
                                  'proxy-connection', 'te', 'trailer', 'transfer-encoding', 'upgrade',
                                  'accept-encoding'})
_HOP_RESPONSE_HEADERS = frozenset({'content-length', 'connection', 'keep-alive', 'transfer-encoding',
                                   'content-encoding', 'date', 'server'})


_ERROR_TYPES = {400: 'invalid_request_error', 401: 'authentication_error', 404: 'not_found_error',
                503: 'service_unavailable'}  # as the api_server names them


class ProxyError(Exception):
    """An answer the proxy gives itself, as OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    type = type or _ERROR_TYPES.get(status, 'invalid_request_error' if status < 500 else 'server_error')
    body = {'error': {'message': message, 'type': type, 'param': param, 'code': code or str(status)}}
    return JSONResponse(body, status_code=status, headers={'WWW-Authenticate': 'Bearer'} if status == 401 else None)


def normalize_url(url) -> str:
    """``http(s)://host:port[/prefix]`` without a trailing slash; anything else is a ProxyError naming ``url``."""
    if not isinstance(url, str) or not url:
        raise ProxyError(400, f'url must be a non-empty string like "http://127.0.0.1:23333", got {url!r}',
                         param='url')
    parts = urlsplit(url.strip())
    if parts.scheme not in ('http', 'https') or not parts.hostname or parts.query or parts.fragment:
        raise ProxyError(400, f'url must look like "http://host:port", got {url!r}', param='url')
    try:
        parts.port
    except ValueError:
        raise ProxyError(400, f'url has an invalid port: {url!r}', param='url') from None
    return f'{parts.scheme}://{parts.netloc}{parts.path.rstrip("/")}'


@dataclass
class Node:
    url: str
    model_cards: list[dict] = field(default_factory=list)  # the node's /v1/models "data"
    models_known: bool = False  # false until /v1/models answered or the models were given at registration
    speed: float | None = None  # relative throughput given at registration (any unit shared by all nodes)
    auth: str | None = None  # Authorization header for the proxy's own calls to the node
    healthy: bool = False
    unfinished: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    num_requests: int = 0  # requests sent to it (retries on another node count there too)
    num_failures: int = 0  # requests it refused or dropped
    last_error: str | None = None
    last_checked: float | None = None  # time.time() of the last health probe

    @property
    def models(self) -> list[str]:
        return [card['id'] for card in self.model_cards]

    def mean_latency(self) -> float | None:
        return sum(self.latencies) / len(self.latencies) if self.latencies else None

    def status(self) -> dict:
        latency = self.mean_latency()
        return {'url': self.url, 'models': self.models, 'healthy': self.healthy, 'unfinished': self.unfinished,
                'latency': latency, 'recent_latencies': [round(x, 4) for x in self.latencies],
                'speed': self.speed, 'requests': self.num_requests, 'failures': self.num_failures,
                'last_error': self.last_error, 'last_checked': self.last_checked}


# ---- routing policy -------------------------------------------------------------------------

def _known_latency(node: Node) -> float | None:
    """Seconds a request takes on the node: observed, else 1 / the speed given at registration."""
    latency = node.mean_latency()
    if latency is None and node.speed:
        latency = 1.0 / node.speed
    return latency


def _known_mean(values: list[float | None], fallback: float) -> float:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else fallback


def _argmin_random(nodes: list[Node], costs: list[float], rng: random.Random) -> Node:
    best = min(costs)
    return rng.choice([n for n, c in zip(nodes, costs) if c <= best * (1 + 1e-9)])


def choose_node(nodes: list[Node], strategy: str, rng: random.Random) -> Node:
    """One of ``nodes`` (all healthy and able to serve the request) by ``strategy``.

    - random: weighted by speed: the speed given at registration, else 1 / observed mean latency;
      nodes with neither weigh as the mean of those known (all equal when none is known).
    - min_expected_latency: least unfinished requests x mean latency (LMDeploy's unfinished / speed);
      a node never measured counts at the mean of the measured ones. Idle nodes tie, and ties go at
      random, so light traffic spreads over all nodes.
    - min_observed_latency: least mean latency of recent requests; a node never measured counts as 0,
      so each new node is tried once. Ties at random.
    """
    if strategy == 'random':
        speeds = [n.speed or (1.0 / n.mean_latency() if n.mean_latency() else None) for n in nodes]
        fill = _known_mean(speeds, 1.0)
        return rng.choices(nodes, weights=[s if s is not None else fill for s in speeds])[0]
    if strategy == 'min_expected_latency':
        latencies = [_known_latency(n) for n in nodes]
        fill = _known_mean(latencies, 1.0)
        return _argmin_random(nodes, [n.unfinished * (lat if lat is not None else fill)
                                      for n, lat in zip(nodes, latencies)], rng)
    if strategy == 'min_observed_latency':
        return _argmin_random(nodes, [n.mean_latency() or 0.0 for n in nodes], rng)
    raise ValueError(f'routing strategy {strategy!r} is invalid: allowed values are {", ".join(ROUTING_STRATEGIES)}')


# ---- the node table -------------------------------------------------------------------------

class NodeTable:
    """Registered nodes, their health, and the choice of one for a request."""

    def __init__(self, routing_strategy: str, client: httpx.AsyncClient, default_auth: str | None,
                 health_check_timeout: float, seed: int | None = None):
        if routing_strategy not in ROUTING_STRATEGIES:
            raise ValueError(f'--routing-strategy {routing_strategy!r} is invalid: allowed values are '
                             f'{", ".join(ROUTING_STRATEGIES)}')
        self.strategy = routing_strategy
        self.client = client
        self.default_auth = default_auth
        self.health_check_timeout = health_check_timeout
        self.nodes: dict[str, Node] = {}
        self.rng = random.Random(seed)
        self._ready_tasks: dict[str, asyncio.Task] = {}
        self._probes: set[asyncio.Task] = set()

    def choose(self, model: str | None, exclude: set[str], why_excluded: dict[str, str]) -> Node:
        if not self.nodes:
            raise ProxyError(503, 'no api_server is registered with the proxy: start one with --proxy-url '
                             'pointing here, or POST {"url": ...} to /nodes/add',
                             code='no_node')
        serving = list(self.nodes.values())
        if model is not None:
            serving = [n for n in serving if model in n.models]
            if not serving:
                pending = [n.url for n in self.nodes.values() if not n.models_known]
                if pending:
                    raise ProxyError(503, f'no api_server known to serve model {model!r}; '
                                     f'{", ".join(pending)} ha{"s" if len(pending) == 1 else "ve"} not reported '
                                     'its models yet', param='model',
                                     code='model_not_ready')
                served = sorted({m for n in self.nodes.values() for m in n.models})
                raise ProxyError(404, f'The model `{model}` does not exist. Served models: '
                                 f'{", ".join(served) or "none"}', param='model', code='model_not_found')
        candidates = [n for n in serving if n.healthy and n.url not in exclude]
        if not candidates:
            reasons = []
            for n in serving:
                if n.url in why_excluded:
                    reasons.append(f'{n.url} ({why_excluded[n.url]})')
                else:
                    reasons.append(f'{n.url} (unhealthy: {n.last_error or "not checked yet"})')
            what = f'model {model!r}' if model is not None else 'this request'
            raise ProxyError(503, f'no healthy api_server can serve {what}: {"; ".join(reasons)}',
                             code='no_healthy_node')
        return choose_node(candidates, self.strategy, self.rng)

    async def add(self, url: str, models: list[str] | None = None, speed: float | None = None,
                  auth: str | None = None) -> Node:
        node = self.nodes.get(url)
        if node is None:
            node = self.nodes[url] = Node(url)
            logger.info('node %s registered', url)
        if models is not None:
            node.model_cards = [{'id': m, 'object': 'model', 'owned_by': 'lmd'} for m in models]
            node.models_known = True
        else:  # (re)registering: a restarted node may serve another model now
            node.models_known = False
        if speed is not None:
            node.speed = speed
        node.auth = auth or node.auth
        # One quick probe: a node that registers while still starting (its port not yet bound)
        # is refused at once and becomes ready in the background.
        await self.probe(node, timeout=min(self.health_check_timeout, 2.0))
        if not node.healthy:
            self._watch_until_ready(node)
        return node

    def remove(self, url: str) -> Node:
        node = self.nodes.pop(url, None)
        if node is None:
            raise ProxyError(404, f'no node with url {url!r} is registered; registered: '
                             f'{", ".join(self.nodes) or "none"}', param='url', code='node_not_found')
        task = self._ready_tasks.pop(url, None)
        if task is not None:
            task.cancel()
        logger.info('node %s removed', url)
        return node

    def _headers(self, node: Node) -> dict:
        auth = node.auth or self.default_auth
        return {'Authorization': auth} if auth else {}

    def mark_unhealthy(self, node: Node, reason: str) -> None:
        if node.healthy:
            logger.warning('node %s is unhealthy: %s', node.url, reason)
        node.healthy = False
        node.last_error = reason
        if node.url in self.nodes:
            self._watch_until_ready(node)

    async def probe(self, node: Node, timeout: float | None = None) -> bool:
        """GET /health (and /v1/models when they are not known or the node was down); sets ``healthy``."""
        timeout = self.health_check_timeout if timeout is None else timeout
        was_healthy = node.healthy
        try:
            r = await self.client.get(f'{node.url}/health', timeout=timeout, headers=self._headers(node))
            ok, reason = r.status_code < 500, f'GET /health answered {r.status_code}'
        except httpx.TimeoutException:
            ok, reason = False, f'GET /health timed out after {timeout:g} s'
        except httpx.TransportError as e:
            ok, reason = False, f'GET /health failed: {_describe(e)}'
        node.last_checked = time.time()
        if ok:
            if not was_healthy:
                node.last_error = None
            if not node.models_known or not was_healthy:
                await self._fetch_models(node, timeout)
            if not was_healthy:
                logger.info('node %s is healthy, serving %s', node.url, ', '.join(node.models) or 'unknown models')
            node.healthy = True
        else:
            if was_healthy:
                logger.warning('node %s is unhealthy: %s', node.url, reason)
            node.healthy = False
            node.last_error = reason
        return ok

    async def _fetch_models(self, node: Node, timeout: float) -> None:
        try:
            r = await self.client.get(f'{node.url}/v1/models', timeout=timeout, headers=self._headers(node))
            if r.status_code != 200:
                node.last_error = (f'GET /v1/models answered {r.status_code}: {r.text[:200]} (a node with its own '
                                   'API keys must share one with the proxy, or register with status.models)')
                return
            cards = r.json().get('data')
            if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get('id'), str)
                                                      for c in cards):
                node.last_error = 'GET /v1/models did not answer an OpenAI model list'
                return
            node.model_cards = cards
            node.models_known = True
        except (httpx.TransportError, ValueError) as e:
            node.last_error = f'GET /v1/models failed: {_describe(e)}'

    def probe_soon(self, node: Node) -> None:
        task = asyncio.create_task(self.probe(node))
        self._probes.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._probes.discard)

    def _watch_until_ready(self, node: Node) -> None:
        """Probe a down node every half second for a while, so it is back before the next health round."""
        task = self._ready_tasks.get(node.url)
        if task is not None and not task.done():
            return

        async def watch():
            for _ in range(120):
                await asyncio.sleep(0.5)
                if self.nodes.get(node.url) is not node or await self.probe(node):
                    return
        self._ready_tasks[node.url] = asyncio.create_task(watch())

    async def health_loop(self, interval: float) -> None:
        while True:
            nodes = list(self.nodes.values())
            results = await asyncio.gather(*(self.probe(n) for n in nodes), return_exceptions=True)
            for node, result in zip(nodes, results):
                if isinstance(result, Exception):
                    logger.error('health probe of %s failed: %r', node.url, result)
            await asyncio.sleep(interval)

    def close(self) -> None:
        for task in [*self._ready_tasks.values(), *self._probes]:
            task.cancel()


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 200 else text[:200] + '...'


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
            reason = f'dropped the stream: {_describe(e)}'
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

        tried: set[str] = set()
        why: dict[str, str] = {}
        while True:
            node = self.table.choose(model, tried, why)
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
                reason = f'connection failed: {_describe(e)}'
                self.table.mark_unhealthy(node, reason)
            except httpx.TransportError as e:
                # The node took the request and dropped it before answering: it may be dying (the
                # probe says) or a kept-alive connection may have gone stale; either way, another node.
                reason = f'dropped the request: {_describe(e)}'
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
        routing_strategy: 'random', 'min_expected_latency' or 'min_observed_latency'.
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


def proxy(server_name: str = '0.0.0.0', server_port: int = 8000, routing_strategy: str = 'min_expected_latency',
          api_keys=None, health_check_interval: float = 5.0, health_check_timeout: float = 5.0, nodes=None,
          log_level: str = 'INFO'):
    """Serve the proxy until interrupted (``lmd serve proxy``).

    Args:
        server_name: the address to listen on.
        server_port: the port to listen on.
        routing_strategy: random (weighted by node speed), min_expected_latency (least unfinished
            requests x mean latency) or min_observed_latency (least mean latency).
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m lmd.serve.proxy', description=proxy.__doc__.split('\n')[0])
    parser.add_argument('--server-name', default='0.0.0.0')
    parser.add_argument('--server-port', type=int, default=8000)
    parser.add_argument('--routing-strategy', default='min_expected_latency', choices=ROUTING_STRATEGIES)
    parser.add_argument('--api-keys', nargs='+', default=None)
    parser.add_argument('--health-check-interval', type=float, default=5.0)
    parser.add_argument('--health-check-timeout', type=float, default=5.0)
    parser.add_argument('--nodes', nargs='+', default=None)
    parser.add_argument('--log-level', default='INFO')
    args = parser.parse_args(argv)
    try:
        proxy(**vars(args))
    except (ValueError, ProxyError) as e:
        parser.error(str(e))


if __name__ == '__main__':
    main()
