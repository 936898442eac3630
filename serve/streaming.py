"""What every generating api_server route shares: SSE framing, the split between the first
engine output (errors before it are HTTP errors, see ``errors.py``) and the rest, cancellation
when the client leaves, usage counts and the per-request latency metrics."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response as HTTPResponse
from fastapi.responses import StreamingResponse

from lmd.async_engine import AsyncEngine
from lmd.errors import PromptTooLongError
from lmd.messages import GenerationConfig, Response

from .errors import APIError, as_api_error
from .metrics import ServerMetrics
from .server import Server

logger = logging.getLogger('lmd.serve')

MAX_USER_SESSION_ID = 2**32 - 1  # AsyncEngine numbers its own requests above this


def sse_event(obj: dict) -> str:
    return f'data: {json.dumps(obj, ensure_ascii=False)}\n\n'


async def merge_streams(streams: list[AsyncIterator[Response]]) -> AsyncIterator[tuple[int, Response]]:
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
class ChoiceState:
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


class Usage:

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


class RequestTimer:
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


def run_answers(server: Server, engine: AsyncEngine, input_ids: list[int], gen: GenerationConfig,
                session_id: int | None, prompt_param: str, adapter: str | None = None) -> AsyncIterator[Response]:
    """The engine's stream of one prompt's ``n`` answers, run under the concurrency limit;
    ``prompt_param``: the request field a prompt too long for the engine is blamed on; ``adapter``:
    the LoRA adapter the request's ``model`` named (``Server.check_model``)."""
    if session_id is not None and session_id > MAX_USER_SESSION_ID:
        raise APIError(400, f'session_id must be at most {MAX_USER_SESSION_ID}', param='session_id')

    async def stream():
        async with server.slot():
            kwargs = {} if session_id is None or gen.n > 1 else {'session_id': session_id}
            if adapter is not None:
                kwargs['adapter_name'] = adapter
            try:
                async for r in engine.generate_n(None, gen, input_ids=input_ids, stream_response=True, **kwargs):
                    yield r
            except PromptTooLongError as e:
                raise as_api_error(e, prompt_param) from e
    return stream()


# ---- streaming plumbing --------------------------------------------------------------------------------

async def split_first(stream):
    """The first item of ``stream`` (raising what starting it raises), and the stream itself."""
    agen = stream.__aiter__()
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        first = None
    return first, agen


async def rejoin(first, agen):
    """``first``, then the rest of ``agen`` (what ``split_first`` split)."""
    item = first
    while item is not None:
        yield item
        try:
            item = await agen.__anext__()
        except StopAsyncIteration:
            return


async def until_done(request: Request, coro, timer: RequestTimer):
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


async def sse_response(request: Request, server: Server, timer: RequestTimer, stream, ctx):
    """An SSE response for ``stream``: errors before the first token are plain HTTP errors, later
    ones an error event; the stream ends with ``data: [DONE]``."""
    try:
        first, agen = await split_first(stream)
    except Exception as e:
        raise as_api_error(e) from e
    timer.accepted()

    async def body():
        try:
            for chunk in ctx.start():
                yield sse_event(chunk)
            async for item in rejoin(first, agen):
                for chunk in ctx.feed(item):
                    yield sse_event(chunk)
            for chunk in ctx.finish():
                yield sse_event(chunk)
        except Exception as e:
            err = as_api_error(e)
            logger.warning('request failed mid-stream: %s', err.message)
            server.metrics.error(err.status)
            yield sse_event(err.body())
        finally:
            timer.abandoned()  # a no-op after the last answer; else the client closed the stream
            await agen.aclose()
        yield 'data: [DONE]\n\n'

    return StreamingResponse(body(), media_type='text/event-stream',
                             headers={'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no'})
