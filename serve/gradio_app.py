"""``lmd serve gradio``: a chat in the browser, on a local engine or on an OpenAI-compatible server.

One ``ChatClient`` serves every browser session; each session holds its own
conversation in a ``gr.State``. A client is where answers come from:

- ``LocalChat``: an in-process ``AsyncEngine``. A conversation is an
  interactive ``Session``, so the engine keeps its KV cache between turns and
  each turn prefills only the new message. Clear (or a closed tab) ends it.
- ``OpenAIChat``: an api_server URL, through the official ``openai`` client.
  A conversation is the message list the client resends each turn.
- ``TritonChat``: lmd's models on a Triton Inference Server
  (``triton://HOST:PORT[/MODEL]``, the gRPC port; see ``lmd serve triton``).
  A conversation is a session on the server, which keeps its KV cache between
  turns; Clear (or a closed tab) ends it.

Stop cancels the answering event: its async generator is closed, which aborts
the engine request (local) or closes the HTTP or gRPC stream (URL, Triton), and
the partial answer stays in the conversation.
"""
from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from lmd.messages import (
    ChatTemplateConfig,
    GenerationConfig,
    PytorchEngineConfig,
    TurbomindEngineConfig,
)
from lmd.runner import run_command

DEFAULT_MAX_CONCURRENT = 64


@dataclass(frozen=True)
class ChatSettings:
    """The sampling controls a user sets in the page; temperature 0 means greedy."""
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 512

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f'temperature={self.temperature} is out of range: expected 0 to 2 (0: greedy)')
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f'top_p={self.top_p} is out of range: expected more than 0, at most 1')
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f'max_new_tokens={self.max_new_tokens} is invalid: expected a whole number >= 1')

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=int(self.max_new_tokens), do_sample=self.temperature > 0,
                                temperature=self.temperature, top_p=self.top_p)


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """``messages`` with its system message set to ``system`` (removed when empty)."""
    rest = messages[1:] if messages and messages[0]['role'] == 'system' else messages
    return ([{'role': 'system', 'content': system}] if system else []) + list(rest)


class ChatClient(ABC):
    """Where answers come from; one for the app, shared by every user."""

    description: str  # shown in the page's title line
    max_new_tokens_limit: int = 8192

    @abstractmethod
    def new_conversation(self) -> Any:
        """A conversation's state; it has a ``messages`` list (OpenAI-style, the system message first)."""

    @abstractmethod
    def stream(self, conv: Any, message: str, system: str | None, settings: ChatSettings) -> AsyncIterator[str]:
        """Answer ``message`` in ``conv``, yielding pieces of text. Closing the iterator early stops the
        generation and keeps the part already answered in ``conv``."""

    @abstractmethod
    def end_conversation(self, conv: Any) -> None:
        """Free what ``conv`` holds (its KV cache); it may be used again, starting afresh."""

    def close(self) -> None:
        pass


class LocalChat(ChatClient):
    """An in-process AsyncEngine; a conversation is one of its interactive Sessions."""

    def __init__(self, engine):
        from lmd.async_engine import AsyncEngine
        if not isinstance(engine, AsyncEngine):
            raise TypeError(f'LocalChat needs an lmd AsyncEngine, got {type(engine).__name__}')
        self.engine = engine
        self.description = f'{os.path.basename(engine.model_dir.rstrip(os.sep))} ({type(engine.engine).__name__})'
        self.max_new_tokens_limit = engine.session_len
        self.sessions: dict[int, Any] = {}  # id(session) -> Session, every conversation not yet ended

    def new_conversation(self):
        s = self.engine.new_session()
        self.sessions[id(s)] = s
        return s

    async def stream(self, conv, message, system, settings):
        conv.messages = with_system(conv.messages, system)  # a changed system prompt re-prefills the history
        self.sessions[id(conv)] = conv
        answer: list[str] = []
        try:
            async with aclosing(self.engine.chat(conv, message, settings.generation_config())) as turn:
                async for r in turn:
                    answer.append(r.text)
                    yield r.text
        except (GeneratorExit, asyncio.CancelledError):
            # AsyncEngine.chat ended the engine's session (its cache no longer matches the history); the
            # next turn prefills the history again, under a fresh id so the abort still in flight for
            # the old one cannot refuse it
            conv.messages = conv.messages + [{'role': 'user', 'content': message},
                                             {'role': 'assistant', 'content': ''.join(answer)}]
            conv.session_id = self.engine.next_session_id()
            raise

    def end_conversation(self, conv):
        self.sessions.pop(id(conv), None)
        self.engine.end_session(conv)

    def close(self):
        self.engine.close()


@dataclass
class Conversation:
    messages: list[dict] = field(default_factory=list)


def openai_base_url(url: str) -> str:
    """An api_server address as the openai client wants it: ending in /v1."""
    if not isinstance(url, str) or not url.startswith(('http://', 'https://')):
        raise ValueError(f'{url!r} is not an api_server URL: expected http://HOST:PORT')
    url = url.rstrip('/')
    return url if url.endswith('/v1') else url + '/v1'


def describe_openai_error(e: Exception, url: str) -> str:
    """One line for a user about a failed request to an OpenAI-compatible server."""
    import openai
    if isinstance(e, openai.APIConnectionError):
        return f'cannot reach the api_server at {url}: {e.__cause__ or e}'
    if isinstance(e, openai.AuthenticationError):
        return f'the api_server at {url} refused the API key (401); pass the right one with --api-key'
    if isinstance(e, openai.APIStatusError):
        body = e.body if isinstance(e.body, dict) else {}
        detail = body.get('message') or (body.get('error') or {}).get('message') if body else None
        return f'the api_server at {url} answered {e.status_code}: {detail or e.message}'
    return f'{type(e).__name__}: {e}'


class OpenAIChat(ChatClient):
    """An OpenAI-compatible server, through the official client's streaming chat.completions."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None):
        from openai import AsyncOpenAI
        self.url = url
        self.base_url = openai_base_url(url)
        # the client insists on a key; servers without --api-keys ignore it
        self.client = AsyncOpenAI(base_url=self.base_url, api_key=api_key or 'none', max_retries=0)
        self.model = model
        self.description = url

    async def model_name(self) -> str:
        if self.model is None:
            models = (await self.client.models.list()).data
            if not models:
                raise ValueError(f'the api_server at {self.url} serves no model (/v1/models is empty)')
            self.model = models[0].id
        return self.model

    def new_conversation(self):
        return Conversation()

    async def stream(self, conv, message, system, settings):
        import openai
        messages = with_system(conv.messages, system) + [{'role': 'user', 'content': message}]
        answer: list[str] = []
        try:
            try:
                stream = await self.client.chat.completions.create(
                    model=await self.model_name(), messages=messages, stream=True,
                    temperature=settings.temperature, top_p=settings.top_p, max_tokens=int(settings.max_new_tokens))
                async with stream:  # leaving it (Stop, an error) closes the HTTP stream: the server aborts
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            answer.append(chunk.choices[0].delta.content)
                            yield answer[-1]
            except openai.OpenAIError as e:
                raise ConnectionError(describe_openai_error(e, self.url)) from e
        except (GeneratorExit, asyncio.CancelledError):
            conv.messages = messages + [{'role': 'assistant', 'content': ''.join(answer)}]
            raise
        conv.messages = messages + [{'role': 'assistant', 'content': ''.join(answer)}]

    def end_conversation(self, conv):
        conv.messages = []

    def close(self):
        pass  # the AsyncOpenAI client's connections belong to the event loop that is gone by now


class TritonChat(ChatClient):
    """lmd's ``ensemble`` or ``lmd_model`` on a Triton server; a conversation is one of its sessions.

    A turn sends only the new message into the session. A changed system prompt, or a turn cut short
    (Stop, an error), leaves the session out of step with the history: the next turn ends it and
    replays the history into a fresh one.
    """

    def __init__(self, address: str):
        from .triton_client import TritonChatClient
        self.client = TritonChatClient(address)
        self.description = f'{self.client.model} on Triton at {self.client.address}'
        self.conversations: dict[int, Any] = {}  # id(conv) -> conv, every conversation not yet ended
        self._ending: set = set()  # end_conversation's requests still on their way

    def new_conversation(self):
        from .triton_client import Conversation
        conv = Conversation()
        self.conversations[id(conv)] = conv
        return conv

    async def stream(self, conv, message, system, settings):
        from .triton_client import TritonClientError, chat_turn
        self.conversations[id(conv)] = conv
        messages = with_system(conv.messages, system)
        if messages != conv.messages:  # the server's session holds the old system prompt
            conv.messages = messages
            conv.restart()
        turn = chat_turn(self.client, conv, message, max_tokens=int(settings.max_new_tokens),
                         temperature=float(settings.temperature), top_p=float(settings.top_p))
        try:
            async with aclosing(turn) as pieces:  # Stop closes this generator, and so the gRPC stream
                async for text, _ in pieces:
                    if text:
                        yield text
        except TritonClientError as e:
            raise ConnectionError(str(e)) from None

    def end_conversation(self, conv):
        """Ends the conversation's sessions in the background: Gradio calls this from its event loop
        (Clear) or from a thread (a closed tab), and neither should wait for the server."""
        import concurrent.futures
        self.conversations.pop(id(conv), None)
        held = self._take_sessions(conv)
        if held is None:
            return
        try:
            fut = asyncio.get_running_loop().create_task(self._end(held))
        except RuntimeError:  # no event loop in this thread
            pool = concurrent.futures.ThreadPoolExecutor(1)
            fut = pool.submit(asyncio.run, self._end(held))
            pool.shutdown(wait=False)
        self._ending.add(fut)
        fut.add_done_callback(self._ending.discard)

    @staticmethod
    def _take_sessions(conv):
        """A copy holding ``conv``'s server sessions (None if it has none); ``conv`` starts afresh."""
        from .triton_client import Conversation
        held = Conversation(session_id=conv.session_id, stale_session=conv.stale_session)
        conv.messages, conv.session_id, conv.stale_session = [], None, None
        return held if held.session_id is not None or held.stale_session is not None else None

    async def _end(self, *convs) -> None:
        from .triton_client import end_conversation
        await asyncio.gather(*(end_conversation(self.client, c) for c in convs))

    def close(self):
        """End the sessions of conversations still open, so the server frees their KV cache."""
        import concurrent.futures
        held = [h for h in map(self._take_sessions, self.conversations.values()) if h is not None]
        self.conversations.clear()
        if held:  # in a thread of its own: the caller's thread may run an event loop (Playwright, Gradio)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, self._end(*held)).result()


def open_chat_client(model_or_url: str | None = None, backend: str | None = None,
                     backend_config: PytorchEngineConfig | TurbomindEngineConfig | None = None,
                     chat_template_config: ChatTemplateConfig | None = None,
                     api_key: str | None = None) -> ChatClient:
    """``http(s)://...`` -> OpenAIChat; ``triton://HOST:PORT[/MODEL]`` -> TritonChat; anything else
    (a model path, 'smollm2', None) -> LocalChat."""
    if isinstance(model_or_url, str) and model_or_url.startswith('triton://'):
        if backend is not None or backend_config is not None or chat_template_config is not None:
            raise ValueError('backend, engine options and chat_template apply to a local model, '
                             f'not to the Triton server at {model_or_url}')
        if api_key is not None:
            raise ValueError(f'api_key applies to an api_server URL (http://...), not to {model_or_url}')
        return TritonChat(model_or_url)
    if isinstance(model_or_url, str) and model_or_url.startswith(('http://', 'https://')):
        if backend is not None or backend_config is not None or chat_template_config is not None:
            raise ValueError('backend, engine options and chat_template apply to a local model, '
                             f'not to the api_server at {model_or_url}')
        return OpenAIChat(model_or_url, api_key=api_key)
    if api_key is not None:
        raise ValueError('api_key applies to an api_server URL (http://...), not to a local model')
    from lmd.async_engine import AsyncEngine
    return LocalChat(AsyncEngine(model_or_url, backend=backend, backend_config=backend_config,
                                 chat_template_config=chat_template_config))


def _text_of(content) -> str:
    """A chatbot message's content as Gradio hands it back: a string or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get('text') or ''
    return ''.join(_text_of(c) for c in content or [])


def build_demo(chat: ChatClient, max_concurrent: int = DEFAULT_MAX_CONCURRENT):
    """The page: chat, message box, Send / Stop / Clear, system prompt and sampling controls."""
    import gradio as gr
    if not isinstance(chat, ChatClient):
        raise TypeError(f'build_demo needs a ChatClient (see open_chat_client), got {type(chat).__name__}')
    if not isinstance(max_concurrent, int) or max_concurrent < 1:
        raise ValueError(f'max_concurrent={max_concurrent!r} is invalid: expected a whole number >= 1')

    def forget(conv):  # the browser session went away
        if conv is not None:
            chat.end_conversation(conv)

    # while an answer streams, the message box and Send are locked: a second message would race the
    # first for the conversation (and the chat it redraws). The answer's last update unlocks them,
    # after an error too; Stop and Clear unlock them when they cut it short.
    keep, unlocked = gr.update(), gr.update(interactive=True)

    async def take_message(message, history):
        if not message or not message.strip():
            return keep, history, None, keep
        return (gr.update(value='', interactive=False), history + [{'role': 'user', 'content': message}], message,
                gr.update(interactive=False))

    async def answer(message, history, conv, system, temperature, top_p, max_new_tokens):
        if message is None:
            return
        text = ''
        try:
            settings = ChatSettings(float(temperature), float(top_p), int(max_new_tokens))
            if conv is None:
                conv = chat.new_conversation()
            history = history + [{'role': 'assistant', 'content': ''}]
            yield history, conv, keep, keep
            async with aclosing(chat.stream(conv, message, (system or '').strip() or None, settings)) as pieces:
                async for piece in pieces:
                    text += piece
                    history[-1] = {'role': 'assistant', 'content': text}
                    yield history, conv, keep, keep
        except (ValueError, ConnectionError, RuntimeError) as e:  # too long for session_len, server down, ...
            if history and history[-1] == {'role': 'assistant', 'content': ''}:
                history = history[:-1]  # no empty answer bubble under the error
            yield history, conv, unlocked, unlocked
            raise gr.Error(str(e))
        yield history, conv, unlocked, unlocked

    async def unlock():
        return unlocked, unlocked

    async def clear(conv):
        forget(conv)
        return [], None, None, unlocked, unlocked

    with gr.Blocks(title='lmd chat', analytics_enabled=False) as demo:
        gr.Markdown(f'### lmd chat · {chat.description}')
        conv = gr.State(None, delete_callback=forget)
        pending = gr.State(None)
        chatbot = gr.Chatbot(elem_id='lmd-chatbot', height=480, label='conversation', show_label=False,
                             feedback_options=None)
        with gr.Row():
            box = gr.Textbox(placeholder='Type a message and press Enter', show_label=False, scale=8,
                             elem_id='lmd-message', autofocus=True)
            send = gr.Button('Send', variant='primary', scale=1, elem_id='lmd-send')
            stop = gr.Button('Stop', variant='stop', scale=1, elem_id='lmd-stop')
            reset = gr.Button('Clear', scale=1, elem_id='lmd-clear')
        with gr.Accordion('Settings', open=False, elem_id='lmd-settings'):
            system = gr.Textbox(label='System prompt', lines=2, elem_id='lmd-system')
            with gr.Row():
                temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label='temperature (0: greedy)',
                                        elem_id='lmd-temperature')
                top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label='top-p', elem_id='lmd-top-p')
                max_new_tokens = gr.Slider(1, chat.max_new_tokens_limit, value=min(512, chat.max_new_tokens_limit),
                                           step=1, label='max new tokens', elem_id='lmd-max-new-tokens')

        answering = []
        for trigger in (box.submit, send.click):
            answering.append(
                trigger(take_message, [box, chatbot], [box, chatbot, pending, send], queue=False)
                .then(answer, [pending, chatbot, conv, system, temperature, top_p, max_new_tokens],
                      [chatbot, conv, box, send], concurrency_limit=max_concurrent, show_progress='hidden'))
        stop.click(unlock, None, [box, send], cancels=answering, queue=False)
        reset.click(clear, [conv], [chatbot, conv, pending, box, send], cancels=answering, queue=False)
    demo.queue(default_concurrency_limit=max_concurrent)
    return demo


def run_gradio(model_or_url: str | None = None, server_name: str = '0.0.0.0', server_port: int = 6006,
               backend: str | None = None,
               backend_config: PytorchEngineConfig | TurbomindEngineConfig | None = None,
               chat_template_config: ChatTemplateConfig | None = None, api_key: str | None = None,
               share: bool = False, max_concurrent: int = DEFAULT_MAX_CONCURRENT) -> None:
    """Serve the chat page until interrupted.

    Args:
        model_or_url: a model path or 'smollm2' (None: the embedded default) to run here, an
            api_server URL (``http://HOST:PORT``) to chat through, or a Triton server running
            ``lmd serve triton``'s models (``triton://HOST:PORT`` with its gRPC port; add ``/lmd_model``
            for that model instead of ``ensemble``).
        server_name, server_port: where the page listens.
        backend, backend_config, chat_template_config: the local engine's, as for ``pipeline()``.
        api_key: the api_server's key, for a URL.
        share: ask Gradio for a public link (needs the internet).
        max_concurrent: answers generated at once, across all users.
    """
    if not isinstance(server_port, int) or not 0 < server_port < 65536:
        raise ValueError(f'server_port={server_port!r} is invalid: expected 1 to 65535')
    chat = open_chat_client(model_or_url, backend, backend_config, chat_template_config, api_key)
    try:
        demo = build_demo(chat, max_concurrent)
        demo.launch(server_name=server_name, server_port=server_port, share=share, max_threads=max_concurrent)
    finally:
        chat.close()


def serve_gradio(model_or_url: str | None = None, *, server_name: str = '0.0.0.0', server_port: int = 6006,
                 backend: str = 'auto', api_key: str | None = None, chat_template: str | None = None,
                 session_len: int | None = None, cache_max_entry_count: float | None = None,
                 enable_prefix_caching: bool | None = None, quant_policy: int | None = None, dtype: str | None = None,
                 num_threads: int | None = None, tp: int | None = None, dp: int | None = None, pp: int | None = None,
                 distributed_executor_backend: str | None = None, ray_address: str | None = None,
                 max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                 share: bool = False, speculative_algorithm: str | None = None,
                 speculative_num_draft_tokens: int | None = None, speculative_draft_model: str | None = None) -> None:
    """A web chat (Gradio) on a model run here, on an api_server or on Triton: streamed answers, Stop, Clear,
    a system prompt, temperature / top-p / max-new-tokens; each browser session is its own conversation.

    Args:
        model_or_url: a model path or 'smollm2' (the default) to run here, an api_server URL http://HOST:PORT,
            or lmd's models on a Triton Inference Server, triton://HOST:PORT[/MODEL] (its gRPC port).
        server_name: the address the page listens on.
        server_port: the port the page listens on.
        backend: 'auto' (TurboMind where it runs the model, else PyTorch), 'turbomind' or 'pytorch', for a
            local model.
        api_key: the api_server's key, for a URL.
        chat_template: a built-in template name instead of the model's, for a local model.
        session_len: the longest conversation in tokens, for a local model.
        cache_max_entry_count: the fraction of free memory the KV cache may take, for a local model.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes, for a local model.
        quant_policy: KV cache quantization (0, 8, 4), for a local model.
        dtype: auto, float32, bfloat16 or float16, for a local model.
        num_threads: CPU threads for a local engine (default: all cores).
        tp: tensor parallel degree, for a local model.
        dp: data-parallel replicas of a local engine, each with NUM_THREADS // DP threads.
        pp: pipeline parallel stages, for a local model (PyTorch engine).
        distributed_executor_backend: how a local PyTorch engine starts its tp x pp ranks: mp (local
            processes, the default) or ray.
        ray_address: the Ray cluster for the ranks (default: RAY_ADDRESS, else a local one); implies
            --distributed-executor-backend ray.
        max_concurrent: answers generated at once, across all users.
        share: ask Gradio for a public link (needs the internet).
        speculative_algorithm: speculative decoding, for a local model: ngram (drafts by prompt lookup) or
            draft_target.
        speculative_num_draft_tokens: tokens drafted per step (default 4), for a local model.
        speculative_draft_model: the draft model, with draft_target.
    """
    from lmd.backend import check_backend, command_engine_config, command_speculative_config
    check_backend(backend)
    local = not (isinstance(model_or_url, str) and model_or_url.startswith(('http://', 'https://', 'triton://')))
    fields = dict(session_len=session_len, cache_max_entry_count=cache_max_entry_count,
                  enable_prefix_caching=enable_prefix_caching, quant_policy=quant_policy, dtype=dtype,
                  num_threads=num_threads, tp=tp, dp=dp, pp=pp,
                  distributed_executor_backend=distributed_executor_backend, ray_address=ray_address,
                  speculative_config=command_speculative_config(
                      speculative_algorithm, speculative_num_draft_tokens, speculative_draft_model))
    fields = {k: v for k, v in fields.items() if v is not None}
    # given for a URL, the engine flags, the backend and the template are an error open_chat_client names
    config = command_engine_config(fields, backend) if fields else None
    template = ChatTemplateConfig(model_name=chat_template) if chat_template else None
    run_gradio(model_or_url, server_name=server_name, server_port=server_port,
               backend=backend if local or backend != 'auto' else None, backend_config=config,
               chat_template_config=template, api_key=api_key, share=share, max_concurrent=max_concurrent)


def main(argv: list[str] | None = None) -> int:
    """``python -m lmd.serve.gradio_app [MODEL_OR_URL] [flags]``, as ``lmd serve gradio``."""
    return run_command(serve_gradio, argv, 'lmd serve gradio')


if __name__ == '__main__':
    raise SystemExit(main())
