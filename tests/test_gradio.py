"""``lmd serve gradio`` in a real headless browser: Playwright drives Debian's chromium.

The app runs in this process on 127.0.0.1 with the embedded SmolLM2 (so the
tests can read the engine's stats and sessions), and once on an api_server URL
started as a subprocess. Answers are greedy (temperature 0), so the browser's
text is compared with what the engine gives for the same conversation.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import server_utils

from lmd.messages import GenerationConfig, PytorchEngineConfig

CHROMIUM = '/usr/bin/chromium'


free_port = server_utils.free_port


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f'timed out after {timeout:.0f} s waiting for {what}')


def plain(text: str) -> str:
    """Text as a comparison sees it: the page renders Markdown (``**a**`` shows as ``a``) and
    collapses whitespace, so both sides drop markup characters and runs of spaces."""
    return ' '.join(re.sub(r'[*_`#>]', '', text).split())


def in_thread(coro):
    """Run a coroutine to its end outside Playwright's event loop (which owns this thread's)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def greedy_answer(engine, messages: list[dict], max_new_tokens: int) -> str:
    async def run():
        gen = GenerationConfig(max_new_tokens=max_new_tokens)
        return ''.join([r.text async for r in engine.generate(messages, gen_config=gen)])
    return in_thread(run())


class ChatPage:
    """One browser tab on the chat."""

    def __init__(self, context, url: str):
        self.page = context.new_page()
        self.page.goto(url)
        self.page.wait_for_selector('#lmd-message textarea', timeout=60_000)
        self.page.locator('#lmd-settings').get_by_text('Settings').first.click()
        self.page.wait_for_selector('#lmd-temperature input[type=number]', timeout=10_000)
        self.page.evaluate(WATCH_ANSWERS)

    def settings(self, temperature: float | None = None, max_new_tokens: int | None = None,
                 system: str | None = None):
        if system is not None:
            self.page.fill('#lmd-system textarea', system)
        for elem, value in (('#lmd-temperature', temperature), ('#lmd-max-new-tokens', max_new_tokens)):
            if value is not None:
                box = self.page.locator(f'{elem} input[type=number]')
                wait_until(lambda: self._set(box, value), 10, f'{elem} to read {value}', interval=0.5)

    @staticmethod
    def _set(box, value) -> bool:
        """Type ``value`` into a number box unless it reads so already. A freshly loaded page can
        still be hydrating and put the component's initial value back over a first fill, so the
        caller retries until the box keeps what was typed."""
        if float(box.input_value() or 'nan') == float(value):
            return True
        box.fill(str(value))
        box.press('Enter')
        return False

    def send(self, text: str):
        self.page.fill('#lmd-message textarea', text)
        self.page.evaluate('window.lmdSeen = []')
        self.page.press('#lmd-message textarea', 'Enter')

    def texts(self, who: str) -> list[str]:
        return self.page.locator(f'#lmd-chatbot [data-testid="{who}"]').all_inner_texts()

    def last_answer(self) -> str:
        bots = self.texts('bot')
        return bots[-1] if bots else ''

    def wait_answer(self, expected: str, timeout: float = 120) -> list[str]:
        """Wait until the last answer reads ``expected``; returns every text it showed since ``send``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if plain(self.last_answer()) == plain(expected):
                return self.page.evaluate('window.lmdSeen')
            time.sleep(0.1)
        raise AssertionError(f'the answer in the page reads {plain(self.last_answer())!r}, '
                             f'expected {plain(expected)!r}')


# records each text the last answer shows, from inside the page (no polling that misses a step)
WATCH_ANSWERS = """() => {
    window.lmdSeen = [];
    new MutationObserver(() => {
        const bots = document.querySelectorAll('#lmd-chatbot [data-testid="bot"]');
        const text = bots.length ? bots[bots.length - 1].innerText : '';
        const seen = window.lmdSeen;
        if (text && (!seen.length || seen[seen.length - 1] !== text)) seen.push(text);
    }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope='module')
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f'{CHROMIUM} is missing: these tests drive a real browser. Install it with '
                    '`apt-get install chromium` (Playwright cannot download its own browser here)')
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=['--no-sandbox'])
        yield b
        b.close()


@pytest.fixture(scope='module')
def local_app(smollm2_dir):
    from lmd.serve.gradio_app import build_demo, open_chat_client
    # one engine thread: the machine's cores are shared with other jobs, and a thread team waiting on
    # a descheduled member is what makes a loaded machine slow
    chat = open_chat_client(smollm2_dir, backend_config=PytorchEngineConfig(num_threads=1))
    demo = build_demo(chat, max_concurrent=8)
    port = free_port()
    demo.launch(server_name='127.0.0.1', server_port=port, prevent_thread_lock=True, quiet=True)
    yield chat, f'http://127.0.0.1:{port}/'
    demo.close()
    chat.close()


def session_of(chat, first_message: str):
    found = [s for s in chat.sessions.values()
             if any(m['role'] == 'user' and m['content'] == first_message for m in s.messages)]
    assert len(found) == 1, f'expected one session holding {first_message!r}, found {len(found)}'
    return found[0]


def test_streamed_answer_equals_the_engine_and_keeps_its_cache(browser, local_app):
    chat, url = local_app
    engine = chat.engine
    page = ChatPage(browser.new_context(), url)
    page.settings(temperature=0, max_new_tokens=32)
    q1 = 'Tell me about Paris.'
    a1 = greedy_answer(engine, [{'role': 'user', 'content': q1}], 32)
    page.send(q1)
    grew = [plain(s) for s in page.wait_answer(a1)]
    assert len(grew) >= 3, f'the answer appeared in {len(grew)} steps, not streamed: {grew}'
    assert all(len(a) < len(b) for a, b in zip(grew, grew[1:])), f'the streamed text did not only grow: {grew}'
    assert page.texts('user') == [q1]

    session = session_of(chat, q1)
    assert session.started and session.messages[-1] == {'role': 'assistant', 'content': a1}
    # the second turn continues the kept KV cache: only its new tokens are prefilled, and the
    # answer equals a fresh run over the whole conversation
    q2 = 'What is it famous for?'
    conversation = [{'role': 'user', 'content': q1}, {'role': 'assistant', 'content': a1},
                    {'role': 'user', 'content': q2}]
    a2 = greedy_answer(engine, conversation, 32)
    held, session_id = len(session.token_ids), session.session_id
    prompt_before = engine.engine.stats().num_prompt_tokens
    page.send(q2)
    page.wait_answer(a2)
    wait_until(lambda: engine.engine.stats().num_running == 0, 10, 'the engine to finish')
    prefilled = engine.engine.stats().num_prompt_tokens - prompt_before
    assert session.session_id == session_id and session.started
    assert prefilled == len(engine.encode(conversation)) - held, \
        f'turn 2 prefilled {prefilled} tokens although the session held {held}'
    assert page.texts('user') == [q1, q2] and len(page.texts('bot')) == 2
    page.page.context.close()


def test_stop_aborts_the_generation_and_the_chat_goes_on(browser, local_app):
    chat, url = local_app
    engine = chat.engine
    page = ChatPage(browser.new_context(), url)
    page.settings(temperature=0, max_new_tokens=2000)
    q = 'Write a very long story about a dragon who learns to fly.'
    page.send(q)
    wait_until(lambda: len(page.last_answer()) > 60, 120, 'the long answer to start streaming')
    assert engine.engine.stats().num_running == 1
    page.page.click('#lmd-stop')
    wait_until(lambda: engine.engine.stats().num_running == 0, 15, 'the engine to drop the stopped request')
    stopped = page.last_answer()
    time.sleep(1.5)
    assert page.last_answer() == stopped, 'the answer kept growing after Stop'
    generated = engine.engine.stats().num_generated_tokens
    time.sleep(0.5)
    assert engine.engine.stats().num_generated_tokens == generated, 'the engine still generates after Stop'

    # the partial answer stays in the conversation, which goes on with a fresh prefill
    session = session_of(chat, q)
    assert session.messages[-2:] == [{'role': 'user', 'content': q},
                                     {'role': 'assistant', 'content': session.messages[-1]['content']}]
    # Stop races the last streamed piece: the conversation keeps what was generated, which is what the
    # page showed or, when the page's last update was cancelled, that and the piece after it
    kept = plain(session.messages[-1]['content'])
    assert kept.startswith(plain(stopped)) and len(kept) - len(plain(stopped)) < 40, (kept, stopped)
    assert not session.started
    page.settings(max_new_tokens=16)
    q2 = 'Thank you.'
    a2 = greedy_answer(engine, session.messages + [{'role': 'user', 'content': q2}], 16)
    page.send(q2)
    page.wait_answer(a2)
    assert page.texts('user') == [q, q2]
    page.page.context.close()


def test_clear_empties_the_chat_and_ends_the_session(browser, local_app):
    chat, url = local_app
    page = ChatPage(browser.new_context(), url)
    system = 'Answer in one word.'
    page.settings(temperature=0, max_new_tokens=8, system=system)
    q = 'Say hello.'
    page.send(q)
    page.wait_answer(greedy_answer(chat.engine, [{'role': 'system', 'content': system},
                                                 {'role': 'user', 'content': q}], 8))
    session = session_of(chat, q)
    assert session.started
    page.page.click('#lmd-clear')
    wait_until(lambda: not page.texts('user') and not page.texts('bot'), 10, 'Clear to empty the chat')
    assert not session.started and all(s is not session for s in chat.sessions.values())
    page.settings(system='')
    page.send('Hi.')
    page.wait_answer(greedy_answer(chat.engine, [{'role': 'user', 'content': 'Hi.'}], 8))
    assert page.texts('user') == ['Hi.']
    page.page.context.close()


def test_two_users_chat_at_once_each_with_their_own_history(browser, local_app):
    chat, url = local_app
    engine = chat.engine
    a = ChatPage(browser.new_context(), url)
    b = ChatPage(browser.new_context(), url)
    for p in (a, b):
        p.settings(temperature=0, max_new_tokens=24)
    qa, qb = 'Describe the sea.', 'Describe a forest.'
    a.send(qa)
    b.send(qb)
    wait_until(lambda: engine.engine.stats().num_running == 2, 60, 'both answers to run together', interval=0.01)
    wait_until(lambda: engine.engine.stats().num_running == 0 and a.last_answer() and b.last_answer(), 120,
               'both answers to finish')
    time.sleep(0.5)  # the last streamed piece reaches the pages
    assert a.texts('user') == [qa] and b.texts('user') == [qb]
    sa, sb = session_of(chat, qa), session_of(chat, qb)
    assert sa is not sb and sa.session_id != sb.session_id
    assert plain(sa.messages[-1]['content']) == plain(a.last_answer())
    assert plain(sb.messages[-1]['content']) == plain(b.last_answer())
    a.send('Shorter, please.')
    wait_until(lambda: len(sa.messages) == 4, 120, "the first user's second turn to finish")
    a.wait_answer(sa.messages[-1]['content'], timeout=10)
    assert a.texts('user') == [qa, 'Shorter, please.'] and b.texts('user') == [qb]
    assert len(sb.messages) == 2 and sb.started
    a.page.context.close()
    b.page.context.close()


# ---- on an api_server URL ----------------------------------------------------------------------------

def metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(f'{base}/metrics', timeout=10).read().decode()
    m = re.search(rf'^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$', text, re.M)
    assert m, f'{name} is missing from {base}/metrics'
    return float(m.group(1))


@pytest.fixture(scope='module')
def api_server():
    with server_utils.api_server('smollm2', '--num-threads', '1') as s:
        yield s.wait_ready().url


def test_url_mode_streams_from_an_api_server_and_stop_closes_the_stream(browser, api_server):
    import openai
    from lmd.serve.gradio_app import build_demo, open_chat_client
    chat = open_chat_client(api_server)
    demo = build_demo(chat)
    port = free_port()
    demo.launch(server_name='127.0.0.1', server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        page = ChatPage(browser.new_context(), f'http://127.0.0.1:{port}/')
        page.settings(temperature=0, max_new_tokens=32)
        q = 'What is the capital of France?'
        client = openai.OpenAI(base_url=f'{api_server}/v1', api_key='none')
        expected = client.chat.completions.create(model='smollm2', messages=[{'role': 'user', 'content': q}],
                                                  temperature=0, max_tokens=32).choices[0].message.content
        page.send(q)
        page.wait_answer(expected)

        page.settings(max_new_tokens=2000)
        page.send('Write a very long story about a dragon who learns to fly.')
        wait_until(lambda: len(page.texts('bot')) == 2 and len(page.last_answer()) > 60, 120,
                   'the long answer to stream')
        assert metric(api_server, 'lmd:num_requests_running') == 1
        page.page.click('#lmd-stop')
        wait_until(lambda: metric(api_server, 'lmd:num_requests_running') == 0, 15,
                   'the api_server to abort the request whose stream closed', interval=0.2)
        stopped = page.last_answer()
        time.sleep(1.0)
        assert page.last_answer() == stopped
        page.page.context.close()
    finally:
        demo.close()


def test_bad_arguments_are_named():
    from lmd.serve.gradio_app import (
        ChatSettings,
        build_demo,
        open_chat_client,
        run_gradio,
    )
    with pytest.raises(ValueError, match='temperature'):
        ChatSettings(temperature=3.0)
    with pytest.raises(ValueError, match='top_p'):
        ChatSettings(top_p=0.0)
    with pytest.raises(ValueError, match='max_new_tokens'):
        ChatSettings(max_new_tokens=0)
    with pytest.raises(ValueError, match='api_key applies to an api_server URL'):
        open_chat_client('smollm2', api_key='k')
    with pytest.raises(ValueError, match='not to the api_server'):
        open_chat_client('http://127.0.0.1:1', backend='pytorch')
    with pytest.raises(TypeError, match='ChatClient'):
        build_demo('smollm2')
    with pytest.raises(ValueError, match='server_port'):
        run_gradio('http://127.0.0.1:1', server_port=70000)


def test_run_gradio_as_a_command_shows_a_down_server_as_an_error(browser):
    down, port = free_port(), free_port()  # nothing listens on `down`
    proc = subprocess.Popen([sys.executable, '-m', 'lmd.serve.gradio_app', f'http://127.0.0.1:{down}',
                             '--server-name', '127.0.0.1', '--server-port', str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up():
            assert proc.poll() is None, f'the gradio app exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}'
            try:
                return urllib.request.urlopen(f'http://127.0.0.1:{port}/', timeout=2).status == 200
            except OSError:
                return False
        wait_until(up, 120, 'the gradio app to serve its page', interval=0.5)
        page = ChatPage(browser.new_context(), f'http://127.0.0.1:{port}/')
        assert f'lmd chat · http://127.0.0.1:{down}' in page.page.inner_text('body')
        page.send('Hello?')
        error = page.page.get_by_text(f'cannot reach the api_server at http://127.0.0.1:{down}')
        error.first.wait_for(timeout=30_000)
        assert page.texts('user') == ['Hello?'] and page.texts('bot') == []
        page.page.fill('#lmd-message textarea', 'the box is unlocked after the error')
        page.page.context.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
