"""A client for lmd's models on a Triton Inference Server, and ``lmd serve triton_client ADDRESS``.

``lmd serve triton`` writes a repository whose ``ensemble`` and ``lmd_model``
share one interface: a ``prompt`` (a user message, or a JSON list of messages),
optional sampling inputs, and a session (``session_id``, ``sequence_start``,
``sequence_end``) whose KV cache the server keeps between turns. Both models
are decoupled, so every answer streams over gRPC ``stream_infer``.

``TritonChatClient.stream`` opens one gRPC stream per answer and keeps it open
until the final response: closing it (the consumer stops early, is cancelled,
or fails) is how the server learns that nobody listens, so it aborts the
request and frees its KV blocks.

A turn cut short (Ctrl-C, Stop) leaves the server's session holding a partial
answer that the chat template cannot continue, so ``Conversation`` ends that
session and replays the whole history into a fresh one on its next turn.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from lmd.errors import LmdError
from lmd.prompt_loop import HELP, read_turns
from lmd.runner import run_command

DEFAULT_MODEL = 'ensemble'
# session ids lmd's Triton models accept (AsyncEngine numbers its own requests above them)
MAX_SESSION_ID = (1 << 32) - 1
# how long a finished stream may take to close before it is cut
CLOSE_TIMEOUT_S = 5.0

# input name -> Triton datatype; every input but stop_words holds one value
INPUT_TYPES = {
    'prompt': 'BYTES', 'max_tokens': 'INT32', 'temperature': 'FP32', 'top_p': 'FP32', 'top_k': 'INT32',
    'repetition_penalty': 'FP32', 'random_seed': 'UINT64', 'ignore_eos': 'BOOL', 'stop_words': 'BYTES',
    'session_id': 'UINT64', 'sequence_start': 'BOOL', 'sequence_end': 'BOOL',
}
_NUMPY_TYPES = {'BYTES': 'object', 'INT32': 'int32', 'FP32': 'float32', 'UINT64': 'uint64', 'BOOL': 'bool'}


class TritonClientError(LmdError):
    """The Triton server cannot be reached, or it refused or failed a request."""


def parse_address(address: str) -> tuple[str, str | None]:
    """``HOST:PORT``, ``triton://HOST:PORT`` or ``triton://HOST:PORT/MODEL`` -> (``HOST:PORT``, model or None).

    The port is Triton's gRPC port (8001 by default): streaming answers need gRPC.
    """
    if not isinstance(address, str):
        # ValueError, not TypeError: fire hands over a bare number (8001) as an int, and this is the user's slip
        raise ValueError(f'{address!r} is not a Triton address: expected HOST:PORT (the gRPC port)')
    rest = address.removeprefix('triton://')
    if '://' in rest:
        raise ValueError(f'{address!r} is not a Triton address: expected HOST:PORT or triton://HOST:PORT[/MODEL] '
                         '(the gRPC port, without http://)')
    hostport, _, model = rest.partition('/')
    host, _, port = hostport.rpartition(':')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f'{address!r} is not a Triton address: expected HOST:PORT with the gRPC port (e.g. '
                         '127.0.0.1:8001)')
    return hostport, (model.strip('/') or None)


def random_session_id() -> int:
    """A session id unlikely to collide with another client's on the same server."""
    return random.randint(1, MAX_SESSION_ID)


def build_inputs(prompt: str | list[dict], **values) -> list:
    """The request's input tensors: ``prompt`` and every other input whose value is not None."""
    import numpy as np
    from tritonclient.grpc import InferInput
    if not isinstance(prompt, str):
        if not isinstance(prompt, list) or not all(isinstance(m, dict) and 'role' in m for m in prompt):
            raise ValueError('prompt must be a string or a list of messages ({"role": ..., "content": ...})')
        prompt = json.dumps(prompt, ensure_ascii=False)
    values = {'prompt': prompt, **values}
    inputs = []
    for name, value in values.items():
        if value is None:
            continue
        if name not in INPUT_TYPES:
            raise ValueError(f'{name!r} is not an input of lmd\'s Triton models; they take: {", ".join(INPUT_TYPES)}')
        dtype = INPUT_TYPES[name]
        if name == 'stop_words':
            if isinstance(value, str):
                value = [value]
            items = [str(w).encode() for w in value]
            if not items:
                continue
        else:
            items = [value.encode() if isinstance(value, str) else value]
        arr = np.array(items, dtype=_NUMPY_TYPES[dtype])
        t = InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _text(result, name: str) -> str:
    arr = result.as_numpy(name)
    if arr is None or arr.size == 0:
        return ''
    v = arr.reshape(-1)[0]
    return v.decode('utf-8', errors='replace') if isinstance(v, bytes) else str(v)


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return 'triton_final_response' in params and params['triton_final_response'].bool_param


class TritonChatClient:
    """Streams answers of lmd's Triton models (``ensemble`` or ``lmd_model``) over gRPC.

    Each ``stream`` call opens its own channel: a gRPC aio channel belongs to the event loop it was
    made in, and one client serves callers on different loops (a terminal's per-turn loop, Gradio's).
    """

    def __init__(self, address: str, model: str | None = None):
        self.address, model_in_address = parse_address(address)
        if model is not None and model_in_address is not None and model != model_in_address:
            raise ValueError(f'the address {address!r} names model {model_in_address!r}, but model={model!r}')
        self.model = model or model_in_address or DEFAULT_MODEL

    def _where(self, model: str) -> str:
        return f"model '{model}' at {self.address}"

    def _describe(self, e: Exception, model: str) -> str:
        """One line for a user about a failed gRPC call (tritonclient wraps some in its own exception)."""
        import grpc
        if isinstance(e, grpc.RpcError):
            code, details = e.code().name, e.details()
        else:
            code, details = str(e.status() or '').removeprefix('StatusCode.'), e.message()
        if code == 'UNAVAILABLE':
            return f'cannot reach the Triton server at {self.address} (gRPC): {details}'
        return f'{self._where(model)}: {details}'

    async def check(self) -> None:
        """Raise TritonClientError unless the server is up and ready to serve ``self.model``."""
        import grpc
        from tritonclient.grpc.aio import InferenceServerClient
        from tritonclient.utils import InferenceServerException
        client = InferenceServerClient(self.address)
        try:
            if not await client.is_model_ready(self.model):
                index = await client.get_model_repository_index(as_json=True)
                ready = [m['name'] for m in index.get('models', []) if m.get('state') == 'READY']
                raise TritonClientError(f"model '{self.model}' is not ready at {self.address}; ready models: "
                                        f"{', '.join(ready) or 'none'}")
        except (grpc.RpcError, InferenceServerException) as e:
            raise TritonClientError(self._describe(e, self.model)) from None
        finally:
            await client.close()

    async def stream(self, prompt: str | list[dict], *, model: str | None = None, session_id: int | None = None,
                     sequence_start: bool = True, sequence_end: bool = True, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     repetition_penalty: float | None = None, random_seed: int | None = None,
                     ignore_eos: bool | None = None,
                     stop_words: list[str] | None = None) -> AsyncIterator[tuple[str, str | None]]:
        """Yield ``(text, finish_reason)`` per response: the new text, and None until the last one
        ('stop', 'length' or 'cancel'). Only the inputs given are sent; the server's defaults
        (greedy decoding, a standalone request) apply to the rest.

        ``session_id`` keeps a conversation's KV cache on the server: the first turn has
        ``sequence_end=False``, later ones ``sequence_start=False``, the last one ``sequence_end=True``.
        """
        model = model or self.model
        session = {}
        if session_id is not None:
            session = dict(session_id=session_id, sequence_start=bool(sequence_start), sequence_end=bool(sequence_end))
        elif not (sequence_start and sequence_end):
            raise ValueError('session_id is required when sequence_start or sequence_end is False')
        inputs = build_inputs(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              repetition_penalty=repetition_penalty, random_seed=random_seed, ignore_eos=ignore_eos,
                              stop_words=stop_words, **session)
        async with aclosing(self._stream(model, inputs)) as responses:  # closing this closes the stream
            async for item in responses:
                yield item

    async def _stream(self, model: str, inputs: list) -> AsyncIterator[tuple[str, str | None]]:
        import grpc
        from tritonclient.grpc.aio import InferenceServerClient
        from tritonclient.utils import InferenceServerException
        answered = asyncio.Event()

        async def requests():
            yield {'model_name': model, 'inputs': inputs}
            await answered.wait()  # the stream stays open while the answer streams: closing it cancels

        client = InferenceServerClient(self.address)
        responses = None
        try:
            responses = client.stream_infer(requests())
            async for result, error in responses:
                if error is not None:
                    raise TritonClientError(f'{self._where(model)}: {error.message()}')
                reason = _text(result, 'finish_reason') or None
                final = reason is not None or _is_final(result)
                yield _text(result, 'text'), reason or ('stop' if final else None)
                if final:
                    break
            else:
                raise TritonClientError(f'{self._where(model)} closed the stream before its final response')
            answered.set()  # a clean close: the request iterator ends and the server closes the stream
            await asyncio.wait_for(self._drain(responses), CLOSE_TIMEOUT_S)
        except (grpc.RpcError, InferenceServerException) as e:
            raise TritonClientError(self._describe(e, model)) from None
        except asyncio.TimeoutError:
            pass  # the answer is complete; closing the channel below cuts the stream
        finally:
            if responses is not None and not answered.is_set():
                responses.cancel()  # stopped early: the server aborts the request
            answered.set()
            await client.close()

    @staticmethod
    async def _drain(responses) -> None:
        async for _ in responses:
            pass

    async def end_session(self, session_id: int, model: str | None = None, wait_s: float = 10.0) -> None:
        """Free ``session_id``'s KV cache on the server: a last turn with ``sequence_end=True`` and an
        empty message, of at most one token.

        A turn just cut short may still be in flight on the server for a moment (it notices the closed
        stream within a poll interval); the engine refuses a second request for the session until it
        ends, so that refusal is retried for up to ``wait_s`` seconds.
        """
        deadline = asyncio.get_running_loop().time() + wait_s
        delay = 0.05
        while True:
            try:
                async for _ in self.stream('', model=model, session_id=session_id, sequence_start=False,
                                           sequence_end=True, max_tokens=1):
                    pass
                return
            except TritonClientError as e:
                if 'in flight' not in str(e) or asyncio.get_running_loop().time() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)


@dataclass
class Conversation:
    """A chat kept in a server session. ``messages`` is its history, OpenAI-style (the system message
    first); ``session_id`` is None before the first turn and after a turn cut short."""
    messages: list[dict] = field(default_factory=list)
    session_id: int | None = None
    stale_session: int | None = None  # a session to end before the next turn (a turn was cut short)
    fresh_id: int | None = None  # the id of the next fresh session (default: a random one)

    def restart(self) -> None:
        """Replay the history into a fresh session next turn (the kept one no longer matches it)."""
        if self.session_id is not None:
            self.stale_session, self.session_id = self.session_id, None


async def chat_turn(client: TritonChatClient, conv: Conversation, message: str,
                    **sampling) -> AsyncIterator[tuple[str, str | None]]:
    """One turn of ``conv``: the next turn of its session, or (first turn, after a cut) a fresh session
    holding the whole history. The answer joins the history when it completes, and when it is cut
    short (closed, cancelled) with what was answered; after an error the message is not part of it."""
    if conv.stale_session is not None:
        stale, conv.stale_session = conv.stale_session, None
        await end_session_quietly(client, stale)
    if conv.session_id is None:
        conv.session_id, conv.fresh_id = conv.fresh_id or random_session_id(), None
        # a lone message is sent as text: the server's chat template renders both forms alike
        prompt = conv.messages + [{'role': 'user', 'content': message}] if conv.messages else message
        start = True
    else:
        prompt, start = message, False
    answer: list[str] = []
    reason, failed = None, False
    try:
        async with aclosing(client.stream(prompt, session_id=conv.session_id, sequence_start=start,
                                          sequence_end=False, **sampling)) as pieces:
            async for text, reason in pieces:
                answer.append(text)
                yield text, reason
    except TritonClientError:
        failed = True
        raise
    finally:
        if failed or reason is None:  # cut short: the session's state is unknown; replay the history
            conv.restart()
        if answer or not failed:
            conv.messages = conv.messages + [{'role': 'user', 'content': message},
                                             {'role': 'assistant', 'content': ''.join(answer)}]


async def end_conversation(client: TritonChatClient, conv: Conversation) -> None:
    """End every session ``conv`` holds on the server; it starts afresh (with its history) next turn."""
    for sid in (conv.session_id, conv.stale_session):
        if sid is not None:
            await end_session_quietly(client, sid)
    conv.session_id = conv.stale_session = None


async def end_session_quietly(client: TritonChatClient, session_id: int) -> None:
    """End a session whose state may be unknown (its last turn was cut or failed, so the server may have
    forgotten it already); a refusal tells the user nothing they can act on."""
    try:
        await client.end_session(session_id)
    except (TritonClientError, OSError):
        pass


def run_triton_client(address: str, *, model: str | None = None, session_id: int | None = None,
                      system: str | None = None, max_tokens: int = 512, temperature: float | None = None,
                      top_p: float | None = None, top_k: int | None = None, repetition_penalty: float | None = None,
                      random_seed: int | None = None, stop_words=None) -> None:
    """Chat in the terminal with lmd's model on a Triton Inference Server (``lmd serve triton``).

    The conversation is a session on the server: it keeps the KV cache between turns, so a turn sends
    only the new message. /reset ends it and starts another, /exit (or Ctrl-D) ends it and leaves;
    Ctrl-C stops an answer (keeping its part) and, at the prompt, leaves.

    Args:
        address: the server's gRPC endpoint, HOST:PORT (e.g. 127.0.0.1:8001), or triton://HOST:PORT/MODEL.
        model: 'ensemble' (the default) or 'lmd_model'.
        session_id: the first conversation's session id, 1 to 4294967295 (default: a random one).
        system: a system prompt for the conversation.
        max_tokens: the most tokens one answer may have.
        temperature: sampling temperature (default: greedy decoding); 0 is greedy.
        top_p: nucleus sampling mass.
        top_k: sample among the k likeliest tokens; 1 is greedy.
        repetition_penalty: >1 discourages repeating tokens.
        random_seed: makes sampling reproducible.
        stop_words: strings that end an answer, separated by commas.
    """
    if session_id is not None and (not isinstance(session_id, int) or not 1 <= session_id <= MAX_SESSION_ID):
        raise ValueError(f'session_id={session_id!r} is invalid: expected 1 to {MAX_SESSION_ID}')
    if isinstance(stop_words, str):
        stop_words = [w for w in stop_words.split(',') if w]
    elif isinstance(stop_words, tuple):
        stop_words = list(stop_words)
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    repetition_penalty=repetition_penalty, random_seed=random_seed, stop_words=stop_words)
    client = TritonChatClient(address, model)
    with asyncio.Runner() as runner:  # Ctrl-C during a turn cancels it: its stream closes
        runner.run(client.check())
        out = sys.stdout
        print(f"lmd triton_client: model '{client.model}' at {client.address}. {HELP}", file=out, flush=True)
        start = [{'role': 'system', 'content': system}] if system else []
        conv = Conversation(list(start), fresh_id=session_id)

        def reset():
            nonlocal conv
            runner.run(end_conversation(client, conv))
            conv = Conversation(list(start))

        try:
            for message in read_turns(reset, out):
                runner.run(_print_turn(client, conv, message, sampling, out))
        finally:
            runner.run(end_conversation(client, conv))


async def _print_turn(client: TritonChatClient, conv: Conversation, message: str, sampling: dict, out) -> None:
    reason = None
    try:
        async with aclosing(chat_turn(client, conv, message, **sampling)) as pieces:
            async for text, reason in pieces:
                out.write(text)
                out.flush()
    except asyncio.CancelledError:  # Ctrl-C: the Runner cancelled the turn
        reason = 'interrupted'
    except TritonClientError as e:
        print(f'\nlmd: {e}', file=out, flush=True)
        return
    if reason == 'length':
        out.write(' [stopped: max_tokens reached]')
    elif reason in ('interrupted', 'cancel'):
        out.write(' [stopped]')
    out.write('\n')
    out.flush()


def main(argv: list[str] | None = None) -> int:
    """``python -m lmd.serve.triton_client ADDRESS [--model] [--session-id] [--system] [--max-tokens]
    [--temperature] [--top-p] [--top-k] [--repetition-penalty] [--random-seed] [--stop-words]``."""
    return run_command(run_triton_client, argv, 'lmd serve triton_client')


if __name__ == '__main__':
    raise SystemExit(main())
