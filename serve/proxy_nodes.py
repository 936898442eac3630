"""The proxy's node table: the api_servers registered with it, their health, and the choice of one
for a request (``lmd serve proxy``; the relay and the app are in ``proxy.py``).

What a node's state means (``Node``):
- ``healthy``: its last ``GET /health`` answered below 500 within the timeout. A background task
  polls every ``health_check_interval`` seconds; a refused connection on a request marks the node
  unhealthy at once. Unhealthy nodes get no requests until they answer again.
- ``unfinished``: requests the proxy has sent it and not finished relaying (streams included).
- ``latencies``: end-to-end seconds of its last ``LATENCY_WINDOW`` successful requests.

The ``prefix_aware`` strategy (SGLang's cache-aware routing, ``lmd.prefix_router``) keeps a record of
the prompts sent to each node: a request goes to the node that was sent the longest prefix of its
prompt (``request_prefix``: a chat's messages as text, a completion's prompt text or token ids), whose
prefix cache most likely still holds it, unless the nodes' unfinished requests are out of balance.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from fastapi.responses import JSONResponse

from lmd.prefix_router import PrefixRouter, chunk_keys

logger = logging.getLogger('lmd.proxy')

ROUTING_STRATEGIES = ('random', 'min_expected_latency', 'min_observed_latency', 'prefix_aware')
LATENCY_WINDOW = 32
# prefix_aware: a prompt's record is kept in chunks of this many characters of text, or token ids (a text
# token is ~4 characters), and each node's record holds at most PREFIX_CAPACITY chunks
TEXT_CHUNK, IDS_CHUNK, PREFIX_CAPACITY = 64, 16, 1 << 16

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
    if strategy == 'prefix_aware':
        raise ValueError("routing strategy 'prefix_aware' needs the prompts sent before: NodeTable.choose keeps them")
    raise ValueError(f'routing strategy {strategy!r} is invalid: allowed values are {", ".join(ROUTING_STRATEGIES)}')


def request_prefix(payload: dict) -> str | list[int] | None:
    """What prefix_aware routes a request by: a chat's tools and messages as one text (each message its
    role and its text parts), a completion's prompt (the first, of a batch) as text or token ids, an
    embedding's input alike; None when there is none."""
    messages = payload.get('messages')
    if isinstance(messages, list):
        parts = [json.dumps(payload['tools'], sort_keys=True)] if payload.get('tools') else []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f'\x00{m.get("role")}\x00{_text(m.get("content"))}')
        return ''.join(parts)
    prompt = payload.get('prompt', payload.get('input'))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def _text(content) -> str:
    """A message's content as text: a string, or the text of its parts (images and audio count as nothing)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return ''.join(p.get('text') or '' for p in content if isinstance(p, dict))
    return ''


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
        self.router = PrefixRouter(TEXT_CHUNK, PREFIX_CAPACITY) if routing_strategy == 'prefix_aware' else None
        self._ready_tasks: dict[str, asyncio.Task] = {}
        self._probes: set[asyncio.Task] = set()

    def choose(self, model: str | None, exclude: set[str], why_excluded: dict[str, str],
               prefix: str | list[int] | None = None) -> Node:
        """A healthy node serving ``model``, not in ``exclude``, by the strategy; ``prefix``: the request's
        (``request_prefix``), which prefix_aware routes by and records."""
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
        if self.router is not None:
            keys = [] if prefix is None else chunk_keys(prefix, TEXT_CHUNK if isinstance(prefix, str) else IDS_CHUNK,
                                                        salt=model)
            url = self.router.choose([n.url for n in candidates], [n.unfinished for n in candidates], keys)
            return self.nodes[url]
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
        if self.router is not None:
            self.router.forget(url)
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
            ok, reason = False, f'GET /health failed: {describe(e)}'
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
            node.last_error = f'GET /v1/models failed: {describe(e)}'

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


def describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 200 else text[:200] + '...'
