"""Tool-call parsers on realistic answers: whole parses against expected calls, and streams (one
character at a time, and random chunkings) adding up to the whole parse."""
import json
import random

import pytest

from lmd.chat_template import BUILTIN_TEMPLATES
from lmd.tokenizer import Tokenizer
from serve.tool_parser import (DeltaMessage, DeltaToolCall, ExtractedToolCalls, JsonObjectScan, ToolCall,
                               ToolParserManager)

WEATHER_ARGS = '{"city": "Paris", "unit": "°C"}'
NESTED_ARGS = '{"query": {"filters": [{"field": "名前", "op": "=", "value": "😀 \\"quoted\\" \\\\ back"}], "limit": 3}, "flag": true, "none": null, "n": -1.5e3}'

# (parser, answer, expected content, expected [(name, arguments)])
CASES = [
    # qwen / hermes
    ('qwen', f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>',
     None, [('get_weather', WEATHER_ARGS)]),
    ('qwen', f'Let me check the weather.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}'
             '\n</tool_call>', 'Let me check the weather.', [('get_weather', WEATHER_ARGS)]),
    ('qwen', '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
             '{"name": "b", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "c"}\n</tool_call>',
     None, [('a', '{"x": 1}'), ('b', '{}'), ('c', '{}')]),
    ('qwen', f'<tool_call>\n{{"name": "search", "arguments": {NESTED_ARGS}}}\n</tool_call>',
     None, [('search', NESTED_ARGS)]),
    ('qwen', '<tool_call>\n{"arguments": {"q": "x"}, "name": "late_name"}\n</tool_call>', None,
     [('late_name', '{"q": "x"}')]),
    ('qwen', '<tool_call>\n{"name": "s", "arguments": "{\\"q\\": 1}"}\n</tool_call>', None, [('s', '{"q": 1}')]),
    ('qwen', '<tool_call>\n{"name": "f", "arguments": {"code": "if a:\n    b()"}}\n</tool_call>', None,
     [('f', '{"code": "if a:\n    b()"}')]),
    # the stop word came right after the JSON: no end marker
    ('qwen', '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}', None, [('f', '{"a": [1, 2]}')]),
    ('qwen', 'Plain answer, no tools.  \n', 'Plain answer, no tools.  \n', []),
    ('qwen', 'Tags like <tool and </tool_call> alone are content', 'Tags like <tool and </tool_call> alone are content',
     []),
    ('qwen', '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nDone.', 'Done.', [('a', '{}')]),
    ('hermes', '<tool_call>{"name": "h", "arguments": {"k": "v"}}</tool_call>', None, [('h', '{"k": "v"}')]),
    # llama3
    ('llama3', '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}', None,
     [('get_weather', WEATHER_ARGS)]),
    ('llama3', '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}', None,
     [('get_weather', WEATHER_ARGS)]),
    ('llama3', '  {"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}};{"name": "c", '
               f'"parameters": {NESTED_ARGS}}}', None, [('a', '{"x": 1}'), ('b', '{}'), ('c', NESTED_ARGS)]),
    ('llama3', 'I will look it up.<|python_tag|>{"name": "s", "parameters": {"q": "東京"}}', 'I will look it up.',
     [('s', '{"q": "東京"}')]),
    ('llama3', '{"name": "a", "parameters": {"x": 1}};', None, [('a', '{"x": 1}')]),
    ('llama3', '{"name": "a", "arguments": {"x": 1}}\nThat is the call.', 'That is the call.', [('a', '{"x": 1}')]),
    ('llama3', 'The JSON {"name": "a"} is inline, not a call.', 'The JSON {"name": "a"} is inline, not a call.', []),
    # internlm
    ('internlm', '<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}'
                 '<|action_end|>', None, [('get_weather', WEATHER_ARGS)]),
    ('internlm', 'I need to search.<|action_start|><|plugin|>\n{"name": "search", "parameters": '
                 f'{NESTED_ARGS}}}<|action_end|>\n<|action_start|><|plugin|>\n{{"name": "b", "parameters": {{}}}}'
                 '<|action_end|>', 'I need to search.', [('search', NESTED_ARGS), ('b', '{}')]),
    # '<|action_end|>' is a stop word of the internlm2 template: the answer may end without it
    ('internlm', '<|action_start|><|plugin|>\n{"name": "f", "parameters": {"a": 1}}', None, [('f', '{"a": 1}')]),
    ('internlm', '<|action_start|><|interpreter|>\nprint(1)<|action_end|>',
     '<|action_start|><|interpreter|>\nprint(1)<|action_end|>', []),
    # mistral (tokenizer v3): a JSON array of calls after [TOOL_CALLS]
    ('mistral', f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}]', None,
     [('get_weather', WEATHER_ARGS)]),
    ('mistral', f'[TOOL_CALLS][{{"name": "a", "arguments": {{"x": 1}}}}, {{"name": "b", "arguments": {NESTED_ARGS}}},'
                '{"name": "c"}]', None, [('a', '{"x": 1}'), ('b', NESTED_ARGS), ('c', '{}')]),
    ('mistral', 'Let me look.[TOOL_CALLS] [{"name": "s", "arguments": {"q": "東京"}}]\nDone.', 'Let me look.Done.',
     [('s', '{"q": "東京"}')]),
    ('mistral', '[TOOL_CALLS] {"name": "one", "arguments": {}}', None, [('one', '{}')]),
    ('mistral', '[TOOL_CALLS] [{"name": "cut", "arguments": {"a": [1, 2]}}', None, [('cut', '{"a": [1, 2]}')]),
    ('mistral', 'No tools: [1, 2] and {"name": "x"} are content.', 'No tools: [1, 2] and {"name": "x"} are content.',
     []),
]

# Malformed JSON inside the markers is content, markers and all; broken before a stream sends the call.
MALFORMED = [
    ('qwen', '<tool_call>\nnot json at all\n</tool_call>', '<tool_call>\nnot json at all\n</tool_call>', []),
    ('qwen', 'Hi <tool_call>\n{"name": 3, "arguments": {}}\n</tool_call> there',
     'Hi <tool_call>\n{"name": 3, "arguments": {}}\n</tool_call> there', []),
    ('qwen', '<tool_call>\n{"name": "f" "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "f" "arguments": {}}\n</tool_call>', []),
    ('qwen', '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', []),
    ('qwen', '<tool_call>\n["f"]\n</tool_call>\n<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>',
     '<tool_call>\n["f"]\n</tool_call>', [('ok', '{}')]),
    ('qwen', '<tool_call>\n{"nam', '<tool_call>\n{"nam', []),
    ('qwen', '<tool_call>\n{"name": "f"} trailing\n</tool_call>', '<tool_call>\n{"name": "f"} trailing\n</tool_call>',
     []),
    ('llama3', '{"name": "a", "parameters": {"x": 1}}; {oops', '{oops', [('a', '{"x": 1}')]),
    ('llama3', '<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    ('llama3', '{"city": "Paris"}', '{"city": "Paris"}', []),
    ('internlm', '<|action_start|><|plugin|>\n{"name": }<|action_end|>ok',
     '<|action_start|><|plugin|>\n{"name": }<|action_end|>ok', []),
    ('mistral', '[TOOL_CALLS] [not json]', '[TOOL_CALLS] [not json]', []),
    ('mistral', '[TOOL_CALLS] plain words', '[TOOL_CALLS] plain words', []),
]


def whole(name, text) -> ExtractedToolCalls:
    return ToolParserManager.get(name)(None).extract_tool_calls(text)


def stream(name, pieces):
    """Feed ``pieces``; the joined content and calls, checking each delta's shape on the way."""
    parser = ToolParserManager.get(name)(None)
    content, calls = '', {}
    deltas = [parser.extract_tool_calls_streaming(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        if d is None:
            continue
        assert isinstance(d, DeltaMessage) and (d.content or d.tool_calls)
        content += d.content or ''
        for t in d.tool_calls:
            if t.index not in calls:  # a call's first delta names it, with a fresh id
                assert t.index == len(calls) and t.id.startswith('call_') and t.name
                calls[t.index] = [t.name, '']
            else:
                assert t.id is None and t.name is None
            calls[t.index][1] += t.arguments
    return content or None, [tuple(c) for c in calls.values()]


def chunkings(text, seed):
    rng = random.Random(seed)
    yield list(text)
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize('name, text, content, calls', CASES + MALFORMED)
def test_whole_parse(name, text, content, calls):
    out = whole(name, text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.tool_calls] == calls
    assert out.tools_called == bool(calls)
    for c in out.tool_calls:   # the model's own JSON text; raw newlines inside strings pass as written
        json.loads(c.arguments, strict=False)
        assert c.id.startswith('call_')
    assert len({c.id for c in out.tool_calls}) == len(calls)


@pytest.mark.parametrize('name, text, content, calls', CASES + MALFORMED)
def test_stream_adds_up_to_whole_parse(name, text, content, calls):
    for i, pieces in enumerate(chunkings(text, seed=len(text))):
        assert stream(name, pieces) == (content, calls), f'chunking {i}: {pieces}'
    assert stream(name, [text]) == (content, calls)


def test_stream_sends_arguments_as_they_come():
    parser = ToolParserManager.get('qwen')(None)
    assert parser.extract_tool_calls_streaming('Sure.\n<tool') == DeltaMessage(content='Sure.')
    assert parser.extract_tool_calls_streaming('_call>\n{"name": "get_weather", ') is None
    first = parser.extract_tool_calls_streaming('"arguments": {"ci')
    [t] = first.tool_calls
    assert first.content is None and (t.index, t.name, t.arguments) == (0, 'get_weather', '{"ci')
    assert t.to_openai() == {'index': 0, 'id': t.id, 'type': 'function',
                             'function': {'name': 'get_weather', 'arguments': '{"ci'}}
    nxt = parser.extract_tool_calls_streaming('ty": "Paris"}}\n</tool_')
    assert nxt.tool_calls == [DeltaToolCall(0, arguments='ty": "Paris"}')]
    assert nxt.to_openai() == {'tool_calls': [{'index': 0, 'function': {'arguments': 'ty": "Paris"}'}}]}
    assert parser.extract_tool_calls_streaming('call>') is None
    assert parser.finish() is None and parser.has_tool_calls()
    plain = ToolParserManager.get('qwen')(None)
    plain.extract_tool_calls_streaming('no calls')
    assert plain.finish() is None and not plain.has_tool_calls()


def test_stream_cut_after_the_call_was_sent_keeps_the_call():
    # Documented difference: once sent, a call stays a call; the whole parse keeps the broken block as content.
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "unfinish'
    assert stream('qwen', list(text)) == (None, [('f', '{"a": "unfinish')])
    assert whole('qwen', text).content == text and not whole('qwen', text).tool_calls
    broken = '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call> after'
    assert stream('qwen', list(broken)) == ('after', [('f', '{"a": ')])


def test_to_openai_shapes():
    call = ToolCall('call_1', 'f', '{}')
    assert call.to_openai() == call.to_dict() == {'id': 'call_1', 'type': 'function',
                                                  'function': {'name': 'f', 'arguments': '{}'}}
    assert DeltaMessage(content='x').to_openai() == {'content': 'x'}
    assert DeltaMessage(reasoning_content='r').to_openai() == {'reasoning_content': 'r'}


def test_manager_names_and_unknown_name():
    assert ToolParserManager.get('hermes') is ToolParserManager.get('qwen')
    assert {'qwen', 'hermes', 'llama3', 'internlm', 'mistral'} <= set(ToolParserManager.names())
    with pytest.raises(ValueError, match="'harmony' is unknown: available are .*internlm.*llama3.*mistral.*qwen"):
        ToolParserManager.get('harmony')


def test_json_object_scan_spans_and_errors():
    text = '{"name": "f", "arguments": {"a": [1, "}"]}, "n": 12}'
    scan = JsonObjectScan()
    for i in range(1, len(text) + 1):   # grows one character at a time
        scan.feed(text[:i])
    assert scan.error is None and scan.end == len(text)
    spans = {k: text[a:b] for k, a, b in scan.fields}
    assert spans == {'name': '"f"', 'arguments': '{"a": [1, "}"]}', 'n': '12'}
    for bad in ('[1]', '{"a" 1}', '{"a": 1]', '{,}', '{"a": 1,,}', '{"a": }'):
        scan = JsonObjectScan()
        scan.feed(bad)
        assert scan.error is not None, bad


# -- against the prompt side: calls the chat templates write are read back by the matching parser ----

CALLS = [{'id': 'c1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': WEATHER_ARGS}},
         {'id': 'c2', 'type': 'function', 'function': {'name': 'search', 'arguments': json.loads(NESTED_ARGS)}}]


@pytest.mark.parametrize('template, parser', [('qwen2', 'qwen'), ('chatml', 'hermes'), ('llama3', 'llama3'),
                                              ('internlm2', 'internlm')])
def test_template_calls_read_back_by_parser(template, parser):
    t = BUILTIN_TEMPLATES[template]
    prompt = t.render([{'role': 'user', 'content': 'q'}], add_generation_prompt=True)
    full = t.render([{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': '', 'tool_calls': CALLS}],
                    add_generation_prompt=False)
    assert full.startswith(prompt)
    answer = full[len(prompt):]
    for stop in t.stop_words:   # the engine stops at the template's stop words
        answer = answer.split(stop)[0]
    out = whole(parser, answer)
    expected = [('get_weather', json.loads(WEATHER_ARGS)), ('search', json.loads(NESTED_ARGS))]
    if '<|action_end|>' in t.stop_words:   # internlm2 stops after each call: one call per answer
        expected = expected[:1]
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == expected
    assert stream(parser, list(answer))[1] == [(c.name, c.arguments) for c in out.tool_calls]


@pytest.fixture(scope='module')
def smol(smollm2_dir):
    return Tokenizer(smollm2_dir)


def test_adjust_request_keeps_special_markers(smol):
    class Request:
        skip_special_tokens = True
    # SmolLM2 has no tool tokens: the markers are plain text and the request stays as it is
    assert ToolParserManager.get('qwen')(smol).adjust_request(Request()).skip_special_tokens is True
    # a tokenizer where '<|im_end|>' is special: a parser with it as a marker must keep special tokens
    parser = ToolParserManager.get('qwen')(smol)
    parser.end_marker = '<|im_end|>'
    assert parser.adjust_request(Request()).skip_special_tokens is False
    assert parser.adjust_request({'skip_special_tokens': True}) == {'skip_special_tokens': False}
