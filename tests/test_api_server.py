"""The api_server end to end: a real server on 127.0.0.1 with the embedded SmolLM2, driven by the
official ``openai`` client (and httpx where the client hides what is under test)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from lmd import GenerationConfig, TurbomindEngineConfig, pipeline

from server_utils import api_server, metric

KEY = 'sk-lmd-test'
SESSION_LEN = 1024
QUESTION = [{'role': 'user', 'content': 'What is the capital of France?'}]


@pytest.fixture(scope='module')
def server():
    with api_server('smollm2', '--backend', 'turbomind', '--session-len', str(SESSION_LEN),
                    '--api-keys', f'{KEY},second-key', '--enable-prefix-caching', '--model-name', 'smollm2',
                    '--log-level', 'WARNING') as s:
        yield s.wait_ready()


@pytest.fixture(scope='module')
def client(server):
    return openai.OpenAI(base_url=server.url + '/v1', api_key=KEY, max_retries=0)


@pytest.fixture(scope='module')
def pipe():
    with pipeline('smollm2', backend_config=TurbomindEngineConfig(session_len=SESSION_LEN)) as p:
        yield p


def _stream_text(stream) -> tuple[str, list, object]:
    text, chunks, usage = [], [], None
    for ch in stream:
        chunks.append(ch)
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text.append(c.delta.content or '')
    return ''.join(text), chunks, usage


# ---- the basics --------------------------------------------------------------------------------------

def test_models_health_and_metrics(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ['smollm2']
    assert httpx.get(server.url + '/health').status_code == 200
    text = httpx.get(server.url + '/metrics').text
    for name in ('lmd:num_requests_running', 'lmd:num_requests_waiting', 'lmd:kv_cache_usage_perc',
                 'lmd:prefix_cache_hit_rate', 'lmd:prompt_tokens_total', 'lmd:generation_tokens_total',
                 'lmd:time_to_first_token_seconds', 'lmd:time_per_output_token_seconds',
                 'lmd:e2e_request_latency_seconds', 'lmd:request_queue_time_seconds', 'lmd:num_preemptions_total'):
        assert name in text, name


def test_greedy_chat_equals_pipeline_and_stream_equals_whole(client, pipe):
    want = pipe(QUESTION, GenerationConfig(max_new_tokens=40)).text
    whole = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=40)
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == 'assistant'
    text, chunks, usage = _stream_text(client.chat.completions.create(
        model='smollm2', messages=QUESTION, temperature=0, max_tokens=40, stream=True,
        stream_options={'include_usage': True}))
    assert text == want
    assert chunks[0].choices[0].delta.role == 'assistant'
    assert chunks[-1].choices == [] and usage is not None  # the usage chunk comes last, alone
    assert all(ch.usage is None for ch in chunks[:-1])
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    finishes = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert len({ch.id for ch in chunks}) == 1


def test_sampling_parameters_reach_the_engine(client, pipe):
    """Every sampling field the server takes gives what the pipeline gives with the same settings."""
    extra = {'top_k': 20, 'min_p': 0.05, 'repetition_penalty': 1.3}
    r = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0.9, top_p=0.9, seed=11,
                                       presence_penalty=0.5, frequency_penalty=0.3, max_tokens=24, extra_body=extra)
    gen = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=0.9, top_p=0.9, top_k=20, min_p=0.05,
                           repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, random_seed=11)
    assert r.choices[0].message.content == pipe(QUESTION, gen).text


def test_same_seed_same_text_and_n(client):
    kw = dict(model='smollm2', messages=[{'role': 'user', 'content': 'Write a sentence about the sea.'}],
              temperature=1.0, max_tokens=24, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.message.content for c in many.choices]
    assert texts[0] == a.choices[0].message.content  # sample i uses seed + i
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens <= many.usage.completion_tokens <= 3 * 24
    assert many.usage.prompt_tokens == a.usage.prompt_tokens  # the prompt counts once


def test_max_tokens_stop_and_stop_token_ids(client):
    r = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == 'length' and r.usage.completion_tokens == 3
    r = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_completion_tokens=4)
    assert r.choices[0].finish_reason == 'length' and r.usage.completion_tokens == 4
    full = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=40)
    text = full.choices[0].message.content
    word = text.split()[2]
    cut = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=40,
                                         stop=[word])
    assert cut.choices[0].finish_reason == 'stop'
    assert cut.choices[0].message.content == text[:text.index(word)]
    streamed, _, _ = _stream_text(client.chat.completions.create(
        model='smollm2', messages=QUESTION, temperature=0, max_tokens=40, stop=word, stream=True))
    assert streamed == cut.choices[0].message.content
    ids = client.post('/encode', cast_to=object, body={'input': ' capital'})['input_ids']
    r = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=40,
                                       extra_body={'stop_token_ids': ids[-1:]})
    assert r.choices[0].finish_reason == 'stop' and 'capital' not in r.choices[0].message.content


def test_chat_logprobs_schema(client):
    r = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=12,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    joined = b''.join(bytes(t.bytes) for t in content).decode('utf-8')
    assert joined == r.choices[0].message.content
    for t in content:
        assert isinstance(t.token, str) and t.logprob <= 0
        assert len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the chosen token is the best
        assert bytes(t.top_logprobs[0].bytes) == bytes(t.bytes)
    # the raw JSON has exactly OpenAI's keys
    raw = httpx.post(f'{client.base_url}chat/completions', headers={'Authorization': f'Bearer {KEY}'}, timeout=120,
                     json={'messages': QUESTION, 'temperature': 0, 'max_tokens': 2, 'logprobs': True,
                           'top_logprobs': 1}).json()
    entry = raw['choices'][0]['logprobs']['content'][0]
    assert set(entry) == {'token', 'logprob', 'bytes', 'top_logprobs'}
    assert set(entry['top_logprobs'][0]) == {'token', 'logprob', 'bytes'}
    streamed = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=12,
                                              logprobs=True, top_logprobs=3, stream=True)
    tokens = [t.token for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert tokens == [t.token for t in content]


def test_completions(client, pipe):
    prompt = 'The three primary colours are'
    want = pipe(prompt, GenerationConfig(max_new_tokens=16), do_preprocess=False).text
    r = client.completions.create(model='smollm2', prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == want
    assert r.object == 'text_completion'
    echoed = client.completions.create(model='smollm2', prompt=prompt, max_tokens=16, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + want
    lp = client.completions.create(model='smollm2', prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert ''.join(logprobs.tokens) == lp.choices[0].text
    assert len(logprobs.token_logprobs) == 6 and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    ids = client.post('/encode', cast_to=object, body={'input': prompt})['input_ids']
    by_ids = client.completions.create(model='smollm2', prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == want
    batch = client.completions.create(model='smollm2', prompt=[prompt, 'One, two, three,'], max_tokens=8,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == want[:len(batch.choices[0].text)]
    stream = client.completions.create(model='smollm2', prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                       stream_options={'include_usage': True})
    chunks = list(stream)
    assert ''.join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_generate_endpoint_and_interactive_session(server, pipe):
    h = {'Authorization': f'Bearer {KEY}'}
    one = httpx.post(server.url + '/generate', headers=h, timeout=120, json={
        'prompt': 'Once upon a time', 'max_tokens': 8, 'temperature': 0}).json()
    assert one['tokens'] == 8 and one['finish_reason'] == 'length'
    assert one['text'] == pipe('Once upon a time', GenerationConfig(max_new_tokens=8), do_preprocess=False).text
    # an interactive session keeps its KV cache: the second turn sends only its new text
    sid = 4242
    t1 = httpx.post(server.url + '/generate', headers=h, timeout=120, json={
        'prompt': 'My name is Ada. ', 'session_id': sid, 'interactive_mode': True, 'max_tokens': 6,
        'temperature': 0}).json()
    lines = httpx.post(server.url + '/generate', headers=h, timeout=120, json={
        'prompt': ' And yours?', 'session_id': sid, 'interactive_mode': True, 'max_tokens': 6, 'temperature': 0,
        'stream': True}).text.strip().split('\n')
    pieces = [json.loads(x) for x in lines]
    t2 = pieces[-1]
    assert t2['history_tokens'] > 0 and t2['input_tokens'] > t2['history_tokens']
    assert t2['finish_reason'] == 'length'
    text2 = ''.join(p['text'] for p in pieces)
    # the same turns as one prompt (ids of turn 1 + what it generated + turn 2) give the same answer
    assert t1['tokens'] == 6 and isinstance(text2, str) and text2
    cancel = httpx.post(server.url + '/generate', headers=h, timeout=120, json={'session_id': sid, 'cancel': True}).json()
    assert cancel['finish_reason'] == 'abort'
    again = httpx.post(server.url + '/generate', headers=h, timeout=120, json={
        'prompt': ' And yours?', 'session_id': sid, 'max_tokens': 2, 'temperature': 0}).json()
    assert again['history_tokens'] == 0  # the session was ended: a fresh start


def test_encode_decode(server):
    h = {'Authorization': f'Bearer {KEY}'}
    enc = httpx.post(server.url + '/v1/encode', headers=h, timeout=60, json={'input': ['Hello world', 'Paris']}).json()
    assert enc['length'] == [len(x) for x in enc['input_ids']]
    dec = httpx.post(server.url + '/v1/decode', headers=h, timeout=60, json={'input_ids': enc['input_ids']}).json()
    assert dec['text'] == ['Hello world', 'Paris']
    bad = httpx.post(server.url + '/v1/decode', headers=h, json={'input_ids': [10**9]})
    assert bad.status_code == 400 and bad.json()['error']['param'] == 'input_ids'


def test_prefix_cache_reported_in_usage(client):
    system = {'role': 'system', 'content': 'You are a helpful assistant. ' * 30}
    msgs = [system, {'role': 'user', 'content': 'Say hi.'}]
    client.chat.completions.create(model='smollm2', messages=msgs, temperature=0, max_tokens=2)
    again = client.chat.completions.create(model='smollm2', messages=msgs, temperature=0, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64


# ---- bad input -----------------------------------------------------------------------------------------

def _post(server, path, body=None, key=KEY, content=None, headers=None):
    h = {'Authorization': f'Bearer {key}'} if key else {}
    h.update(headers or {})
    return httpx.post(server.url + path, headers=h, json=body, content=content, timeout=60)


def test_auth(server):
    for key in (None, 'wrong'):
        r = _post(server, '/v1/chat/completions', {'messages': QUESTION, 'max_tokens': 1}, key=key)
        assert r.status_code == 401
        assert r.json()['error']['type'] == 'authentication_error'
    assert _post(server, '/v1/chat/completions', {'messages': QUESTION, 'max_tokens': 1},
                 key='second-key').status_code == 200
    bad = openai.OpenAI(base_url=server.url + '/v1', api_key='nope', max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize('body,param', [
    ({'messages': QUESTION, 'temperature': 3}, 'temperature'),
    ({'messages': QUESTION, 'top_p': 0}, 'top_p'),
    ({'messages': QUESTION, 'n': 'two'}, 'n'),
    ({'messages': QUESTION, 'max_tokens': 0}, 'max_tokens'),
    ({'messages': QUESTION, 'top_logprobs': 50, 'logprobs': True}, 'top_logprobs'),
    ({'messages': QUESTION, 'presence_penalty': 9}, 'presence_penalty'),
    ({'messages': QUESTION, 'stop': [1, 2]}, 'stop'),
    ({'messages': [], 'max_tokens': 1}, 'messages'),
    ({'messages': [{'role': 'wizard', 'content': 'hi'}]}, 'messages'),
    ({'messages': QUESTION, 'unknown_field': 1}, 'unknown_field'),
    ({'messages': QUESTION, 'response_format': {'type': 'xml'}}, 'response_format.type'),
])
def test_bad_fields_are_400_naming_the_field(server, body, param):
    r = _post(server, '/v1/chat/completions', body)
    assert r.status_code == 400, r.text
    err = r.json()['error']
    assert err['type'] == 'invalid_request_error'
    assert err['param'] == param, err
    assert param.split('.')[0] in err['message'] or param == 'messages'


def test_malformed_json_unknown_model_and_long_prompt(server, client):
    r = _post(server, '/v1/chat/completions', content=b'{"messages": [', headers={'Content-Type': 'application/json'})
    assert r.status_code == 400 and 'JSON' in r.json()['error']['message']
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model='gpt-4', messages=QUESTION)
    assert 'gpt-4' in str(e.value)
    long = [{'role': 'user', 'content': 'word ' * (SESSION_LEN + 10)}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model='smollm2', messages=long, max_tokens=4)
    assert 'session_len' in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model='smollm2', prompt=[10**9], max_tokens=4)
    # and the server keeps serving
    assert client.chat.completions.create(model='smollm2', messages=QUESTION, max_tokens=2).choices


# ---- load and disconnects ------------------------------------------------------------------------------

def _idle(server, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(server.url, 'lmd:num_requests_running') == 0
                and metric(server.url, 'lmd:kv_cache_usage_perc') == 0):
            return True
        time.sleep(0.1)
    return False


def test_client_disconnect_aborts_and_frees_blocks(server):
    assert _idle(server)
    body = {'messages': QUESTION, 'max_tokens': 900, 'ignore_eos': True, 'stream': True, 'temperature': 0}
    with httpx.stream('POST', server.url + '/v1/chat/completions', json=body,
                      headers={'Authorization': f'Bearer {KEY}'}, timeout=60) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(8)]
        assert any(x.startswith('data: ') for x in got)
        assert metric(server.url, 'lmd:num_requests_running') == 1
        assert metric(server.url, 'lmd:kv_cache_usage_perc') > 0
    assert _idle(server), 'the disconnected request still holds the engine'
    # a non-streamed request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + '/v1/chat/completions', json=dict(body, stream=False),
                   headers={'Authorization': f'Bearer {KEY}'}, timeout=1.5)
    assert _idle(server), 'the abandoned non-streamed request still holds the engine'
    aborted = metric(server.url, 'lmd:request_success_total', finished_reason='abort')
    assert aborted >= 2


def test_64_concurrent_streams(server, client):
    prompts = [f'Count from {i} to {i + 5}, separated by commas.' for i in range(64)]
    solo = {p: client.completions.create(model='smollm2', prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in prompts[:6]}

    async def one(aclient, p):
        text, ids = [], set()
        stream = await aclient.completions.create(model='smollm2', prompt=p, max_tokens=12, temperature=0,
                                                  stream=True)
        finish = None
        async for ch in stream:
            ids.add(ch.id)
            for c in ch.choices:
                text.append(c.text)
                finish = c.finish_reason or finish
        return ''.join(text), ids, finish

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + '/v1', api_key=KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run())
    assert len({i for _, ids, _ in results for i in ids}) == 64  # one id per request, none shared
    assert all(len(ids) == 1 and finish in ('length', 'stop') for _, ids, finish in results)
    for p, (text, _, _) in zip(prompts, results):
        if p in solo:
            assert text == solo[p]  # TurboMind is batch-invariant: alone or with 63 others, the same
        assert text
    assert _idle(server)


# ---- loading ---------------------------------------------------------------------------------------------

def test_health_is_503_while_loading_and_after_a_failed_load(smollm2_dir):
    import threading

    from fastapi.testclient import TestClient

    from lmd.async_engine import AsyncEngine
    from lmd.serve.api_server import Server, ServerConfig, build_app

    gate = threading.Event()

    def slow_engine():
        gate.wait(30)
        return AsyncEngine(smollm2_dir)

    server = Server(ServerConfig(model_name='m'), engine_factory=slow_engine)
    with TestClient(build_app(server)) as c:
        assert c.get('/health').status_code == 503
        r = c.post('/v1/chat/completions', json={'messages': QUESTION, 'max_tokens': 1})
        assert r.status_code == 503 and 'loading' in r.json()['error']['message']
        gate.set()
        deadline = time.monotonic() + 60
        while c.get('/health').status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get('/health').status_code == 200
        assert c.post('/v1/chat/completions', json={'messages': QUESTION, 'max_tokens': 1}).status_code == 200

    def broken():
        raise FileNotFoundError('no such model: /nowhere')

    server = Server(ServerConfig(model_name='m'), engine_factory=broken)
    with TestClient(build_app(server)) as c:
        deadline = time.monotonic() + 10
        while server.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.get('/health')
        assert r.status_code == 503 and '/nowhere' in r.json()['error']['message']


@pytest.mark.parametrize('backend', ['pytorch', 'turbomind'])
def test_context_length_error_and_health_after_the_engine_stops(smollm2_dir, tmp_path, backend):
    """The engines' one length check reaches a client as 400 context_length_exceeded naming the
    field; /health asks the engine (AsyncEngine.is_alive) and turns 503 once its thread has ended."""
    from fastapi.testclient import TestClient

    from lmd import PytorchEngineConfig
    from lmd.async_engine import AsyncEngine
    from lmd.serve.api_server import Server, ServerConfig, build_app
    from server_utils import tiny_model_dir

    config = (PytorchEngineConfig if backend == 'pytorch' else TurbomindEngineConfig)(session_len=64)
    engine = AsyncEngine(tiny_model_dir(str(tmp_path), smollm2_dir), backend_config=config)
    server = Server(ServerConfig(model_name='m'), engine=engine)
    with TestClient(build_app(server)) as c:
        assert c.get('/health').status_code == 200 and engine.is_alive()
        for path, body, param in [
                ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'word ' * 80}]}, 'messages'),
                ('/v1/completions', {'prompt': 'word ' * 80}, 'prompt'),
                ('/v1/completions', {'prompt': ['hi', 'word ' * 80], 'stream': True}, 'prompt.1'),
                ('/generate', {'prompt': 'word ' * 80}, 'prompt'),
                ('/generate', {'input_ids': list(range(1, 70))}, 'input_ids')]:
            r = c.post(path, json={**body, 'max_tokens': 2})
            assert r.status_code == 400, (path, r.text)
            err = r.json()['error']
            assert err['code'] == 'context_length_exceeded' and err['param'] == param, (path, err)
            assert 'session_len=64' in err['message'], err
        assert c.post('/v1/completions', json={'prompt': 'hi', 'max_tokens': 2}).status_code == 200
        engine.close()  # the engine's thread ends under the running server
        assert not engine.is_alive()
        r = c.get('/health')
        assert r.status_code == 503 and 'stopped' in r.json()['error']['message'], r.text
        assert c.post('/v1/completions', json={'prompt': 'hi', 'max_tokens': 2}).status_code == 503
