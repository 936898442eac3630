"""Requests as OpenAI's clients and agent frameworks send them, against a default api_server (no
``--tool-call-parser``): ``tools`` without ``tool_choice`` (OpenAI's default, ``auto``) come back as
``tool_calls``; a schema or regex xgrammar cannot compile, and a ``max_tokens`` the context cannot
hold, are 400s whose ``param`` names the field. A real server on 127.0.0.1 with the embedded SmolLM2,
driven by the official ``openai`` client (and LangChain where it is installed)."""
from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from lmd.chat_template import BUILTIN_TEMPLATES, JinjaChatTemplate
from lmd.serve.tool_parser import ToolParserManager, default_tool_parser

from server_utils import api_server

SESSION_LEN = 1024
QUESTION = [{'role': 'user', 'content': 'What is the capital of France?'}]
WEATHER = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'Get the current weather in a city',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}
# SmolLM2 writes what it is asked to write: here a call in the Hermes format its template gets from lmd
COPY_CALL = [{'role': 'user', 'content': 'Write exactly this and nothing else:\n<tool_call>{"name": "get_weather", '
                                         '"arguments": {"city": "Paris"}}</tool_call>'}]


@pytest.fixture(scope='module')
def server():
    # no --backend, no --tool-call-parser: the server a newcomer starts
    with api_server('smollm2', '--session-len', str(SESSION_LEN), '--model-name', 'smollm2',
                    '--log-level', 'INFO') as s:
        yield s.wait_ready()


@pytest.fixture(scope='module')
def client(server):
    return openai.OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0)


def _bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


# ---- tools without tool_choice ------------------------------------------------------------------------

def test_tools_without_tool_choice_are_parsed_on_a_default_server(server, client):
    assert 'tool-call parser: qwen (the chat template has no tool format of its own' in server.logs()
    r = client.chat.completions.create(model='smollm2', messages=COPY_CALL, tools=[WEATHER], temperature=0,
                                       max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == 'tool_calls', choice
    (call,) = choice.message.tool_calls
    assert call.function.name == 'get_weather' and json.loads(call.function.arguments) == {'city': 'Paris'}
    assert call.id.startswith('call_') and not choice.message.content
    stream = client.chat.completions.create(model='smollm2', messages=COPY_CALL, tools=[WEATHER], temperature=0,
                                            max_tokens=48, stream=True)
    name, args, finish = None, [], None
    for ch in stream:
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                args.append(tc.function.arguments or '')
            finish = c.finish_reason or finish
    assert (name, json.loads(''.join(args)), finish) == ('get_weather', {'city': 'Paris'}, 'tool_calls')
    # the agent's second turn: its call and the tool's result go back, the model answers in text
    turn = COPY_CALL + [{'role': 'assistant', 'content': None, 'tool_calls': [call.model_dump()]},
                        {'role': 'tool', 'tool_call_id': call.id, 'content': '{"temperature_c": 21}'}]
    r2 = client.chat.completions.create(model='smollm2', messages=turn, tools=[WEATHER], temperature=0, max_tokens=24)
    # SmolLM2 repeats the tool's result (rendered Hermes-style as a <tool_response> turn)
    assert '21' in r2.choices[0].message.content and not r2.choices[0].message.tool_calls


def test_langchain_tool_call_round_trip(server):
    langchain_openai = pytest.importorskip('langchain_openai', reason='LangChain is not installed (the test extra '
                                                                       'has langchain-openai)')
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        return f'21 C and sunny in {city}'

    llm = langchain_openai.ChatOpenAI(model='smollm2', base_url=server.url + '/v1', api_key='unused', temperature=0,
                                      max_tokens=48, max_retries=0)
    agent = llm.bind_tools([get_weather])  # LangChain sends no tool_choice
    messages = [HumanMessage(COPY_CALL[0]['content'])]
    ai = agent.invoke(messages)
    assert [(c['name'], c['args']) for c in ai.tool_calls] == [('get_weather', {'city': 'Paris'})], ai
    messages += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]['args']), tool_call_id=ai.tool_calls[0]['id'])]
    answer = agent.invoke(messages)
    assert isinstance(answer.content, str) and 'sunny in Paris' in answer.content and not answer.tool_calls


# the template's own tool format decides; the family only when lmd does not know the format
@pytest.mark.parametrize('template,architecture,want', [
    (BUILTIN_TEMPLATES['qwen2'], 'Qwen2ForCausalLM', 'qwen'),
    (BUILTIN_TEMPLATES['chatml'], 'LlamaForCausalLM', 'qwen'),
    (BUILTIN_TEMPLATES['llama3'], 'LlamaForCausalLM', 'llama3'),
    (BUILTIN_TEMPLATES['internlm2'], 'InternLM2ForCausalLM', 'internlm'),
    (JinjaChatTemplate('{% for m in messages %}{{ m.content }}{% endfor %}'), 'LlamaForCausalLM', 'qwen'),
    (JinjaChatTemplate('{% if tools %}<tools>{{ tools | tojson }}</tools> Reply <tool_call>{...}</tool_call>'
                       '{% endif %}'), 'LlamaForCausalLM', 'qwen'),
    (JinjaChatTemplate('{% if tools %}Given the following functions, ...{% endif %}<|python_tag|>'),
     'LlamaForCausalLM', 'llama3'),
    (JinjaChatTemplate('{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}'),
     'MistralForCausalLM', 'mistral'),
    (JinjaChatTemplate('{% if tools %}<|start|>developer<|message|>{{ tools }}<|end|>{% endif %}<|channel|>'),
     'GptOssForCausalLM', 'gpt-oss'),
    (JinjaChatTemplate('{% if tools %}TOOLS: {{ tools }}{% endif %}'), 'Qwen3ForCausalLM', 'qwen'),
    (JinjaChatTemplate('{% if tools %}TOOLS: {{ tools }}{% endif %}'), 'LlamaForCausalLM', 'llama3'),
    (JinjaChatTemplate('{% if tools %}TOOLS: {{ tools }}{% endif %}'), 'PhiForCausalLM', 'qwen'),
])
def test_default_tool_parser_follows_the_template(template, architecture, want):
    assert default_tool_parser(template, architecture)[0] == want


@pytest.mark.parametrize('name', ['qwen2', 'llama3', 'internlm2', 'smollm2'])
def test_default_parser_reads_the_calls_the_template_writes(name, smollm2_dir):
    """What a template writes as an assistant's call (and so asks the model to write) is what the parser
    chosen for it reads back."""
    if name == 'smollm2':  # the model's own Jinja template, which has no tool format
        with open(os.path.join(smollm2_dir, 'tokenizer_config.json')) as f:
            template = JinjaChatTemplate(json.load(f)['chat_template'], eos_token='<|im_end|>', name='model')
    else:
        template = BUILTIN_TEMPLATES[name]
    call = {'id': 'call_1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{"city": "Rome"}'}}
    head = template.render(QUESTION, tools=[WEATHER])
    text = template.render(QUESTION + [{'role': 'assistant', 'content': '', 'tool_calls': [call]}],
                           add_generation_prompt=False, tools=[WEATHER])
    assert text.startswith(head)
    parser = ToolParserManager.get(default_tool_parser(template)[0])()
    parsed = parser.extract_tool_calls(text[len(head):].rstrip().removesuffix(template.stop_words[0]).rstrip())
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [('get_weather', {'city': 'Rome'})]


# ---- structured output: the field at fault ---------------------------------------------------------------

def test_invalid_schema_or_regex_is_400_naming_the_field(server, client):
    chat = dict(model='smollm2', messages=QUESTION, max_tokens=4)
    cases = [
        (lambda: client.chat.completions.create(**chat, response_format={
            'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 'integr'}}}),
         'response_format.json_schema.schema.type', 'is not a valid JSON schema'),
        (lambda: client.chat.completions.create(**chat, response_format={  # xgrammar's refusal, no path
            'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {
                'type': 'integer', 'minimum': 5, 'maximum': 1}}}),
         'response_format.json_schema.schema', 'minimum greater than maximum'),
        (lambda: client.chat.completions.create(**chat, extra_body={'response_format': {
            'type': 'regex_schema', 'regex_schema': '(ab'}}),
         'response_format.regex_schema', 'is not a valid regex'),
        (lambda: client.chat.completions.create(**chat, stream=True, extra_body={'regex': '[z-a]'}),
         'regex', 'is not a valid regex'),
        (lambda: client.chat.completions.create(**chat, extra_body={'guided_json': {
            'type': 'object', 'properties': {'a': {'type': 'integer', 'minimum': 'five'}}}}),
         'guided_json.properties.a.minimum', 'is not a valid JSON schema'),
        (lambda: client.chat.completions.create(**chat, tools=[WEATHER, {'type': 'function', 'function': {
            'name': 'f', 'parameters': {'type': 'object', 'properties': {'n': {'type': 'nope'}}}}}],
            tool_choice={'type': 'function', 'function': {'name': 'f'}}),
         'tools.1.function.parameters.properties.n.type', 'is not a valid JSON schema'),
        (lambda: client.completions.create(model='smollm2', prompt='Hi', max_tokens=4, extra_body={
            'response_format': {'type': 'regex_schema', 'regex_schema': '(?=a)b'}}),
         'response_format.regex_schema', 'Lookahead is not supported'),
    ]
    for call, param, why in cases:
        err = _bad_request(call)
        assert err['param'] == param, err
        assert err['message'].startswith(f'{param}: ') and why in err['message'], err
    assert client.chat.completions.create(**chat).choices  # and the server keeps serving


# ---- max_tokens larger than the context leaves ---------------------------------------------------------

def test_max_tokens_past_the_context_is_400_naming_both_numbers(server, client):
    prompt = client.chat.completions.create(model='smollm2', messages=QUESTION, max_tokens=1).usage.prompt_tokens
    room = SESSION_LEN - prompt
    for field in ('max_tokens', 'max_completion_tokens'):
        for stream in (False, True):
            err = _bad_request(lambda: client.chat.completions.create(
                model='smollm2', messages=QUESTION, stream=stream, **{field: room + 1}))
            assert err['param'] == field and err['code'] == 'context_length_exceeded', err
            assert err['message'] == (
                f"'{field}' is too large: {room + 1}. This model's maximum context length is {SESSION_LEN} tokens "
                f'and your request has {prompt} input tokens ({room + 1} > {SESSION_LEN} - {prompt}): '
                f'send at most {room}'), err
    # what fits exactly runs, and no max_tokens still means "up to the end of the context"
    for kw in ({'max_tokens': room}, {}):
        r = client.chat.completions.create(model='smollm2', messages=QUESTION, temperature=0, stop=['.'], **kw)
        assert r.choices[0].finish_reason == 'stop' and r.usage.prompt_tokens == prompt
    # the request that once held a server for the whole context
    err = _bad_request(lambda: client.completions.create(model='smollm2', prompt='Hello', max_tokens=2**31))
    assert err['param'] == 'max_tokens' and f'is too large: {2**31}.' in err['message'], err
    assert f'maximum context length is {SESSION_LEN} tokens' in err['message']
    # /v1/completions' default max_tokens (16) is not the client's: it is cut to what the context leaves
    long = [7] * (SESSION_LEN - 4)
    r = client.completions.create(model='smollm2', prompt=long, temperature=0, extra_body={'ignore_eos': True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == 'length'
    # LMDeploy's /generate, under both of its names for the field
    for field in ('max_tokens', 'request_output_len'):
        g = httpx.post(server.url + '/generate', json={'prompt': 'Hello', field: SESSION_LEN}, timeout=30)
        assert g.status_code == 400 and g.json()['error']['param'] == field, g.text
        assert f'({SESSION_LEN} > {SESSION_LEN} - ' in g.json()['error']['message']
