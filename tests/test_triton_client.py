"""lmd's Triton clients against a real tritonserver serving SmolLM2 on 127.0.0.1.

The repository is the one ``lmd serve triton`` writes (TurboMind, the default
backend). Answers are greedy, so what the clients show is compared with what
``pipeline()`` on the same backend answers for the same conversation:

- the terminal client (``python -m lmd.serve.triton_client``) as a subprocess:
  two turns of one server session, /reset, /exit; Ctrl-C stops an answer on
  the server and the chat goes on;
- ``TritonChatClient``: a consumer cancelled mid-answer closes its gRPC stream,
  the server aborts the request, and it keeps serving;
- the Gradio page on ``triton://HOST:PORT/lmd_model`` in a real browser: two
  turns of one session, Stop, Clear.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import server_utils
from test_gradio import CHROMIUM, ChatPage, in_thread, plain, wait_until
from triton_utils import ENGINE_FIELDS

from lmd.messages import GenerationConfig, TurbomindEngineConfig

LONG_PROMPT = 'Write a very long story about a dragon who learns to fly.'


@pytest.fixture(scope='module')
def triton(triton_server):
    """The session's tritonserver (conftest): lmd's repository for SmolLM2, ``ensemble`` and ``lmd_model``."""
    return triton_server


@pytest.fixture(scope='module')
def pipe(smollm2_dir):
    """The engine the served models run, in this process: the reference for greedy answers."""
    from lmd.api import pipeline
    p = pipeline(smollm2_dir, backend='turbomind', backend_config=TurbomindEngineConfig(**ENGINE_FIELDS))
    yield p
    p.close()


def greedy(pipe, messages: list[dict], max_tokens: int) -> str:
    return pipe(messages, GenerationConfig(max_new_tokens=max_tokens)).text


def replies(stdout: str) -> list[str]:
    """What followed each '>>> ' prompt, up to the next one."""
    return [part.strip() for part in stdout.split('\n>>> ')[1:]]


def run_client(*args: str, stdin: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-m', 'lmd.serve.triton_client', *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def wait_running(triton, n: int, model: str = 'lmd_model', timeout: float = 10) -> float:
    """The requests an engine-hosting model (``lmd_model``, ``engine``) runs, as the server's metrics
    tell, once they are ``n`` (or at the timeout)."""
    base = triton.metrics_url.removesuffix('/metrics')
    deadline = time.monotonic() + timeout
    while True:
        v = server_utils.metric(base, 'lmd_num_requests_running', model=model)
        if v == n or time.monotonic() > deadline:
            return v
        time.sleep(0.2)


def test_terminal_client_streams_greedy_answers_in_one_session(triton, pipe):
    from lmd.serve.triton_client import TritonChatClient, TritonClientError
    q1, q2 = 'What is the capital of France?', 'And of Germany?'
    a1 = greedy(pipe, [{'role': 'user', 'content': q1}], 24)
    a2 = greedy(pipe, [{'role': 'user', 'content': q1}, {'role': 'assistant', 'content': a1},
                       {'role': 'user', 'content': q2}], 24)
    session = 31337
    r = run_client(triton.grpc_url, '--max-tokens', '24', '--session-id', str(session),
                   stdin=f'{q1}\n{q2}\n/reset\n{q1}\n/exit\nnever read\n')
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'Traceback' not in r.stdout + r.stderr, r.stderr
    assert r.stdout.startswith(f"lmd triton_client: model 'ensemble' at {triton.grpc_url}."), r.stdout
    cut = ' [stopped: max_tokens reached]'
    got = [g.removesuffix(cut).strip() for g in replies(r.stdout)]
    assert got == [a1.strip(), a2.strip(), '(new conversation)', a1.strip(), ''], got

    async def continue_session():
        return [t async for t, _ in TritonChatClient(triton.grpc_url).stream(
            'Hi.', session_id=session, sequence_start=False, max_tokens=2)]
    with pytest.raises(TritonClientError, match=f'session {session} is unknown'):
        in_thread(continue_session())  # /reset ended it


def test_terminal_ctrl_c_stops_the_answer_on_the_server_and_the_chat_goes_on(triton):
    proc = subprocess.Popen([sys.executable, '-m', 'lmd.serve.triton_client', triton.grpc_url, '--max-tokens', '2000'],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=server_utils.interruptible)
    out = bytearray()

    def read():
        while chunk := proc.stdout.read1(4096):
            out.extend(chunk)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.stdin.write(f'{LONG_PROMPT}\n'.encode())
        proc.stdin.flush()
        wait_until(lambda: len(out.decode(errors='replace').split('>>> ')[-1]) > 60, 120, 'the answer to stream')
        assert wait_running(triton, 1, 'engine') == 1
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: out.decode(errors='replace').rstrip().endswith('[stopped]\n\n>>>'), 15,
                   'the client to print [stopped] and prompt again')
        assert wait_running(triton, 0, 'engine') == 0, 'the server still generates the stopped answer'
        # the next turn replays the conversation, the stopped part included, into a fresh session
        proc.stdin.write(b'Answer in one word: who is the hero?\n/exit\n')
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    replies_ = replies(out.decode())
    assert len(replies_) == 3 and replies_[0].endswith('[stopped]') and replies_[1] and not replies_[2], replies_
    assert b'Traceback' not in out + proc.stderr.read()


@pytest.mark.parametrize('model', ['ensemble', 'lmd_model'])
def test_cancelled_stream_is_aborted_and_the_server_keeps_serving(triton, pipe, model):
    from lmd.serve.triton_client import TritonChatClient, TritonClientError
    client = TritonChatClient(triton.grpc_url, model)
    session = 4242 if model == 'ensemble' else 4243

    async def scenario():
        pieces: list[str] = []
        started = asyncio.Event()

        async def consume():
            async for text, reason in client.stream(LONG_PROMPT, session_id=session, sequence_start=True,
                                                    sequence_end=False, max_tokens=2000):
                assert reason is None, f'the long answer ended ({reason}) before it was cancelled'
                pieces.append(text)
                if len(''.join(pieces)) > 40:
                    started.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(started.wait(), 120)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled_at = time.monotonic()
        # the engine refuses a second request of a session while one is in flight: once the server
        # has aborted the cancelled one (not 2000 tokens later), the session takes a new request
        while True:
            try:
                return ''.join([t async for t, _ in client.stream('Hi.', session_id=session, max_tokens=4)])
            except TritonClientError as e:
                assert 'in flight' in str(e), e
                assert time.monotonic() - cancelled_at < 10, 'the server still generates for the closed stream'
                await asyncio.sleep(0.1)

    assert in_thread(scenario())
    # and it answers as the engine does
    q = 'Name a color.'

    async def ask():
        return ''.join([t async for t, _ in client.stream(q, max_tokens=12)])
    assert in_thread(ask()) == greedy(pipe, [{'role': 'user', 'content': q}], 12)


def test_errors_name_the_server_and_the_input(triton):
    from lmd.serve.triton_client import TritonChatClient, TritonClientError

    async def collect(client, prompt, **kw):
        return [t async for t, _ in client.stream(prompt, **kw)]

    with pytest.raises(TritonClientError, match="model 'ensemble' at .*temperature"):
        in_thread(collect(TritonChatClient(triton.grpc_url), 'Hi', temperature=-1.0))
    with pytest.raises(TritonClientError, match="model 'nope' at .*"):
        in_thread(collect(TritonChatClient(triton.grpc_url, 'nope'), 'Hi'))
    port = server_utils.free_port()  # nothing listens there
    with pytest.raises(TritonClientError, match=f'cannot reach the Triton server at 127.0.0.1:{port}'):
        in_thread(collect(TritonChatClient(f'127.0.0.1:{port}'), 'Hi'))
    r = run_client(f'127.0.0.1:{port}', stdin='Hi\n', timeout=60)
    assert r.returncode == 2 and f'cannot reach the Triton server at 127.0.0.1:{port}' in r.stderr, r.stderr
    r = run_client(f'http://{triton.http_url}', stdin='Hi\n', timeout=60)
    assert r.returncode == 2 and 'not a Triton address' in r.stderr, r.stderr
    r = run_client(triton.grpc_url, '--model', 'nope', stdin='Hi\n', timeout=60)
    assert r.returncode == 2 and "model 'nope' is not ready" in r.stderr and 'lmd_model' in r.stderr, r.stderr

    from lmd.serve.gradio_app import open_chat_client
    with pytest.raises(ValueError, match='not to the Triton server'):
        open_chat_client(f'triton://{triton.grpc_url}', backend='pytorch')
    with pytest.raises(ValueError, match='api_key applies to an api_server URL'):
        open_chat_client(f'triton://{triton.grpc_url}', api_key='k')
    with pytest.raises(ValueError, match='not a Triton address'):
        open_chat_client('triton://127.0.0.1')


@pytest.fixture(scope='module')
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f'{CHROMIUM} is missing: this test drives a real browser. Install it with '
                    '`apt-get install chromium` (Playwright cannot download its own browser here)')
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=['--no-sandbox'])
        yield b
        b.close()


def conversation_of(chat, first_message: str, turns: int):
    """The conversation whose first message is ``first_message``, once it holds ``turns`` answers (the
    stream joins the answer to it after its last piece reached the page)."""
    def find():
        return [c for c in list(chat.conversations.values())
                if any(m['role'] == 'user' and m['content'] == first_message for m in c.messages)]
    wait_until(lambda: [c for c in find() if len(c.messages) == 2 * turns], 10,
               f'a conversation to hold {first_message!r} and {turns} answers')
    found = find()
    assert len(found) == 1, f'expected one conversation holding {first_message!r}, found {len(found)}'
    return found[0]


def test_gradio_page_on_triton_streams_the_greedy_answer_in_one_session(triton, pipe, browser):
    from lmd.serve.gradio_app import TritonChat, build_demo, open_chat_client
    chat = open_chat_client(f'triton://{triton.grpc_url}/lmd_model')
    assert isinstance(chat, TritonChat) and chat.client.model == 'lmd_model'
    demo = build_demo(chat, max_concurrent=4)
    port = server_utils.free_port()
    demo.launch(server_name='127.0.0.1', server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        page = ChatPage(browser.new_context(), f'http://127.0.0.1:{port}/')
        page.settings(temperature=0, max_new_tokens=32)
        q1 = 'What is the capital of France?'
        a1 = greedy(pipe, [{'role': 'user', 'content': q1}], 32)
        page.send(q1)
        grew = [plain(s) for s in page.wait_answer(a1)]
        assert len(grew) >= 3, f'the answer appeared in {len(grew)} steps, not streamed: {grew}'
        conv = conversation_of(chat, q1, 1)
        session = conv.session_id
        assert session is not None, 'the first answer ended its session'
        # the second turn continues the server's session with only the new message
        q2 = 'What is it famous for?'
        a2 = greedy(pipe, [{'role': 'user', 'content': q1}, {'role': 'assistant', 'content': a1},
                           {'role': 'user', 'content': q2}], 32)
        page.send(q2)
        page.wait_answer(a2)
        assert page.texts('user') == [q1, q2]
        assert conversation_of(chat, q1, 2) is conv and conv.session_id == session
        assert conv.messages[-1] == {'role': 'assistant', 'content': a2}

        # Stop closes the stream: the server aborts the answer; the next turn replays the history
        # (the stopped answer's part included) into a fresh session
        page.settings(max_new_tokens=2000)
        page.send(LONG_PROMPT)
        wait_until(lambda: len(page.texts('bot')) == 3 and len(page.last_answer()) > 60, 120,
                   'the long answer to stream')
        assert wait_running(triton, 1) == 1
        page.page.click('#lmd-stop')
        assert wait_running(triton, 0) == 0, 'the server still generates the stopped answer'
        stopped = conversation_of(chat, q1, 3).messages[-1]['content']
        assert plain(stopped).startswith(plain(page.last_answer()))
        q4 = 'Thank you.'
        a4 = greedy(pipe, conv.messages + [{'role': 'user', 'content': q4}], 8)
        page.settings(max_new_tokens=8)
        page.send(q4)
        page.wait_answer(a4)
        assert conversation_of(chat, q1, 4) is conv and conv.session_id not in (None, session)
        page.page.click('#lmd-clear')
        wait_until(lambda: not page.texts('user'), 10, 'Clear to empty the chat')
        assert id(conv) not in chat.conversations and conv.session_id is None
        page.page.context.close()
    finally:
        demo.close()
        chat.close()
