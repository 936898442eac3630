"""The api_server on the PyTorch engine, with a tool-call parser and a reasoning parser: what the
parsers and structured output give through the real server and the official ``openai`` client."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from lmd import GenerationConfig, PytorchEngineConfig, pipeline

from server_utils import api_server

QUESTION = [{'role': 'user', 'content': 'What is the capital of France?'}]
WEATHER = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'Get the current weather in a city',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'},
                                                    'unit': {'type': 'string', 'enum': ['C', 'F']}},
                   'required': ['city', 'unit']}}}
TIME = {'type': 'function', 'function': {
    'name': 'get_time', 'description': 'Get the local time in a city',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}
# SmolLM2 writes what it is asked to write: here a tool call in Hermes format
COPY_CALL = [{'role': 'user', 'content': 'Write exactly this and nothing else:\n<tool_call>{"name": "get_weather", '
                                         '"arguments": {"city": "Paris"}}</tool_call>'}]


@pytest.fixture(scope='module')
def server():
    with api_server('smollm2', '--backend', 'pytorch', '--session-len', '1024', '--tool-call-parser', 'qwen',
                    '--reasoning-parser', 'qwen3', '--log-level', 'WARNING') as s:
        yield s.wait_ready()


@pytest.fixture(scope='module')
def client(server):
    return openai.OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0)


def test_greedy_equals_pipeline_stream_and_logprobs(client):
    with pipeline('smollm2', backend_config=PytorchEngineConfig(session_len=1024)) as pipe:
        want = pipe(QUESTION, GenerationConfig(max_new_tokens=32, logprobs=2))
    whole = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=32,
                                           logprobs=True, top_logprobs=2)
    assert whole.choices[0].message.content == want.text
    assert [t.logprob for t in whole.choices[0].logprobs.content] == pytest.approx(
        [lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-5)
    stream = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True)
    assert ''.join(c.delta.content or '' for ch in stream for c in ch.choices) == want.text


def test_auto_tool_call_parsed_whole_and_streamed(client):
    r = client.chat.completions.create(model='smollm2', messages=COPY_CALL, tools=[WEATHER], temperature=0,
                                       max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == 'tool_calls', choice
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].type == 'function' and calls[0].id.startswith('call_')
    assert calls[0].function.name == 'get_weather'
    assert json.loads(calls[0].function.arguments) == {'city': 'Paris'}
    assert not choice.message.content
    stream = client.chat.completions.create(model='smollm2', messages=COPY_CALL, tools=[WEATHER], temperature=0,
                                            max_tokens=48, stream=True)
    name, args, finish, content = None, [], None, []
    for ch in stream:
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                name = tc.function.name or name
                args.append(tc.function.arguments or '')
            content.append(c.delta.content or '')
            finish = c.finish_reason or finish
    assert (name, json.loads(''.join(args)), finish) == ('get_weather', {'city': 'Paris'}, 'tool_calls')
    assert not ''.join(content).strip()


def test_named_and_required_tool_choice_are_forced_by_grammar(client):
    ask = [{'role': 'user', 'content': 'What is the weather like in Rome?'}]
    named = {'type': 'function', 'function': {'name': 'get_weather'}}
    r = client.chat.completions.create(model='smollm2', messages=ask, tools=[WEATHER, TIME], tool_choice=named,
                                       temperature=0, max_tokens=64)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == 'get_weather' and r.choices[0].finish_reason == 'tool_calls'
    jsonschema.validate(json.loads(call.function.arguments), WEATHER['function']['parameters'])
    stream = client.chat.completions.create(model='smollm2', messages=ask, tools=[WEATHER, TIME],
                                            tool_choice=named, temperature=0, max_tokens=64, stream=True)
    args = ''.join(tc.function.arguments or '' for ch in stream for c in ch.choices
                   for tc in c.delta.tool_calls or [])
    assert args == call.function.arguments
    r = client.chat.completions.create(model='smollm2', messages=ask, tools=[WEATHER, TIME], tool_choice='required',
                                       temperature=0, max_tokens=96)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == 'tool_calls'
    schemas = {t['function']['name']: t['function']['parameters'] for t in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def test_tools_without_a_parser_are_refused_clearly(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model='smollm2', messages=QUESTION, tools=[WEATHER],
                                       tool_choice={'type': 'function', 'function': {'name': 'nope'}})
    assert 'nope' in str(e.value)


def test_reasoning_content_split(client):
    """SmolLM2 never writes <think> on its own; a regex makes it, and the parser splits what came."""
    import re
    ask = [{'role': 'user', 'content': 'Think about how to greet me, then greet me.'}]
    pattern = r'<think>[A-Za-z ]{5,40}</think>[A-Za-z !]{3,30}'
    kw = dict(model='smollm2', messages=ask, temperature=0, max_tokens=60,
              extra_body={'response_format': {'type': 'regex_schema', 'regex_schema': pattern}})
    msg = client.chat.completions.create(**kw).choices[0].message
    reasoning = msg.model_extra.get('reasoning_content')
    assert re.fullmatch(r'[A-Za-z ]{5,40}', reasoning or '') and reasoning == reasoning.strip(), msg
    assert msg.content and re.fullmatch(r'[A-Za-z !]{3,30}', msg.content) and '<think>' not in msg.content
    pieces_r, pieces_c = [], []
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            pieces_r.append((c.delta.model_extra or {}).get('reasoning_content') or '')
            pieces_c.append(c.delta.content or '')
    assert ''.join(pieces_r) == reasoning and ''.join(pieces_c) == msg.content


@pytest.mark.parametrize('fmt', ['json_object', 'json_schema', 'regex'])
def test_structured_output(client, fmt):
    schema = {'type': 'object', 'properties': {'name': {'type': 'string', 'maxLength': 20},
                                               'age': {'type': 'integer', 'minimum': 0, 'maximum': 150},
                                               'colour': {'enum': ['red', 'green', 'blue']}},
              'required': ['name', 'age', 'colour'], 'additionalProperties': False}
    ask = [{'role': 'user', 'content': 'Describe a person as JSON with a name, an age and a favourite colour.'}]
    kw = dict(model='smollm2', messages=ask, temperature=0, max_tokens=80)
    if fmt == 'json_object':
        r = client.chat.completions.create(response_format={'type': 'json_object'}, **kw)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    elif fmt == 'json_schema':
        rf = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': schema}}
        r = client.chat.completions.create(response_format=rf, **kw)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        sampled = client.chat.completions.create(response_format=rf, n=2, seed=3, **dict(kw, temperature=1.0))
        for c in sampled.choices:
            jsonschema.validate(json.loads(c.message.content), schema)
    else:
        import re
        r = client.chat.completions.create(extra_body={'response_format': {
            'type': 'regex_schema', 'regex_schema': r'\d{3}-[a-z]{4}'}}, **kw)
        assert re.fullmatch(r'\d{3}-[a-z]{4}', r.choices[0].message.content)


def test_bad_response_format_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model='smollm2', messages=QUESTION, response_format={
            'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 'no-such-type'}}})
    assert 'schema' in str(e.value)
