"""``lmd serve api_client``: a subprocess with piped stdin, against a real api_server on 127.0.0.1.

The server runs the embedded SmolLM2 with an API key; answers are greedy, so
the terminal's streamed text must equal the server's non-streamed answer for
the same conversation.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import server_utils

KEY = 'test-key'


free_port = server_utils.free_port


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f'timed out after {timeout:.0f} s waiting for {what}')


@pytest.fixture(scope='module')
def api_server():
    with server_utils.api_server('smollm2', '--api-keys', KEY, '--num-threads', '1') as s:
        yield s.wait_ready().url


def client_cmd(*args: str) -> list[str]:
    return [sys.executable, '-m', 'lmd.serve.api_client', *args]


def run_client(*args: str, stdin: str = '', timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(client_cmd(*args), input=stdin, capture_output=True, text=True, timeout=timeout)


def answer(base: str, messages: list[dict], max_tokens: int) -> str:
    import openai
    client = openai.OpenAI(base_url=f'{base}/v1', api_key=KEY)
    return client.chat.completions.create(model='smollm2', messages=messages, temperature=0,
                                          max_tokens=max_tokens).choices[0].message.content


def replies(stdout: str) -> list[str]:
    """What followed each '>>> ' prompt, up to the next one."""
    return [part.strip() for part in stdout.split('\n>>> ')[1:]]


def test_streams_answers_keeps_history_and_resets(api_server):
    q1, q2, q3 = 'What is 2+2?', 'And what is that times 3?', 'Hello!'
    a1 = answer(api_server, [{'role': 'user', 'content': q1}], 24)
    a2 = answer(api_server, [{'role': 'user', 'content': q1}, {'role': 'assistant', 'content': a1},
                             {'role': 'user', 'content': q2}], 24)
    a3 = answer(api_server, [{'role': 'user', 'content': q3}], 24)
    r = run_client(api_server, '--api-key', KEY, '--temperature', '0', '--max-tokens', '24',
                   stdin=f'{q1}\n{q2}\n\n/reset\n{q3}\n')  # ends with Ctrl-D (EOF)
    assert r.returncode == 0, r.stderr
    assert 'Traceback' not in r.stdout + r.stderr
    assert r.stdout.startswith('lmd api_client: smollm2 at ')
    got = replies(r.stdout)
    # a reply cut by max_tokens carries a note after the text
    cut = ' [stopped: max_tokens reached]'
    assert [g.removesuffix(cut).strip() for g in got] == [a1.strip(), a2.strip(), '', '(new conversation)',
                                                        a3.strip(), ''], got


def test_system_prompt_and_exit(api_server):
    system = 'You are a pirate. Answer like a pirate.'
    q = 'Who are you?'
    expected = answer(api_server, [{'role': 'system', 'content': system}, {'role': 'user', 'content': q}], 16)
    r = run_client(api_server, '--api-key', KEY, '--system', system, '--temperature', '0', '--max-tokens', '16',
                   stdin=f'{q}\n/exit\nnever read\n')
    assert r.returncode == 0, r.stderr
    got = replies(r.stdout)
    assert len(got) == 2 and got[0].startswith(expected.strip()), got


def test_ctrl_c_stops_the_answer_and_the_server_aborts_it(api_server):
    proc = subprocess.Popen(client_cmd(api_server, '--api-key', KEY, '--temperature', '0', '--max-tokens', '2000'),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=server_utils.interruptible)
    out = bytearray()

    def read():
        while chunk := proc.stdout.read1(4096):
            out.extend(chunk)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.stdin.write(b'Write a very long story about a dragon who learns to fly.\n')
        proc.stdin.flush()
        wait_until(lambda: len(out.decode(errors='replace').split('>>> ')[-1]) > 60, 120, 'the answer to stream')
        assert running(api_server) == 1
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: out.decode(errors='replace').rstrip().endswith('[stopped]\n\n>>>'.rstrip()), 15,
                   'the client to print [stopped] and prompt again')
        wait_until(lambda: running(api_server) == 0, 15, 'the server to abort the closed stream')
        proc.stdin.write(b'/exit\n')
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    assert b'Traceback' not in out + proc.stderr.read()


def running(base: str) -> float:
    text = urllib.request.urlopen(f'{base}/metrics', timeout=10).read().decode()
    m = re.search(r'^lmd:num_requests_running(?:\{[^}]*\})? (\S+)$', text, re.M)
    assert m, f'lmd:num_requests_running is missing from {base}/metrics'
    return float(m.group(1))


def test_wrong_api_key_is_one_clear_line(api_server):
    r = run_client(api_server, '--api-key', 'wrong', stdin='Hi\n')
    assert r.returncode == 2
    assert 'refused the API key (401)' in r.stderr and 'Traceback' not in r.stderr, r.stderr
    r = run_client(api_server, stdin='Hi\n')  # no key at all
    assert r.returncode == 2 and '401' in r.stderr, r.stderr


def test_unknown_model_names_the_served_ones(api_server):
    r = run_client(api_server, '--api-key', KEY, '--model', 'nope', stdin='Hi\n')
    assert r.returncode == 2
    assert "model 'nope' is not served" in r.stderr and 'smollm2' in r.stderr, r.stderr


def test_closed_port_and_bad_flags_are_clear_errors():
    port = free_port()  # nothing listens on it
    r = run_client(f'http://127.0.0.1:{port}', stdin='Hi\n', timeout=60)
    assert r.returncode == 2
    assert f'cannot reach the api_server at http://127.0.0.1:{port}' in r.stderr, r.stderr
    assert 'Traceback' not in r.stderr
    r = run_client('127.0.0.1:23333', timeout=60)
    assert r.returncode == 2 and 'not an api_server URL' in r.stderr, r.stderr
    r = run_client(f'http://127.0.0.1:{port}', '--temperature', '5', timeout=60)
    assert r.returncode == 2 and 'temperature=5' in r.stderr, r.stderr
