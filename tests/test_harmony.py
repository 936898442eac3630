"""gpt-oss's harmony format: reasoning, content and tool calls split from realistic answers, whole
and streamed (one character at a time and random chunkings), the reasoning parser first and the
tool parser on its content, as the api_server runs them."""
import json

import pytest

from serve.reasoning_parser import ReasoningParserManager
from serve.tool_parser import ToolParserManager
from test_tool_parser import chunkings

ARGS = '{"city": "Paris", "unit": "°C", "days": [1, 2]}'

# (answer, reasoning, content, [(name, arguments)])
CASES = [
    ('<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello!'
     '<|return|>', 'Simple greeting.', 'Hello!', []),
    # the stop token (<|return|>, <|call|>) is not in the text
    ('<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.', 'Think.',
     'Done.', []),
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     f'to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>', 'Need the weather.', None,
     [('get_weather', ARGS)]),
    # the recipient before the channel, right after <|start|>assistant (the prompt's end)
    (f' to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}', None, None, [('get_weather', ARGS)]),
    ('<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant<|channel|>commentary<|message|>'
     'Checking both cities.<|end|><|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}'
     '<|call|><|start|>assistant to=functions.b<|channel|>commentary json<|message|><|call|>', 'Two lookups.',
     'Checking both cities.', [('a', '{"x": 1}'), ('b', '{}')]),
    ('A plain answer with no headers.', None, 'A plain answer with no headers.', []),
    ('<|channel|>analysis<|message|>The answer was cut while thinkin', 'The answer was cut while thinkin', None, []),
    ('<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>fin', 'ok', '<|start|>assistant<|channel|>fin',
     []),
]


def reasoning_parser():
    return ReasoningParserManager.get('gpt-oss')(None)


def tool_parser():
    return ToolParserManager.get('gpt-oss')(None)


def whole(text):
    reasoning, content = reasoning_parser().extract_reasoning(text)
    calls = tool_parser().extract_tool_calls(content or '')
    return reasoning, calls.content, [(c.name, c.arguments) for c in calls.tool_calls]


def streamed(pieces):
    rp, tp = reasoning_parser(), tool_parser()
    reasoning, content, calls = '', '', {}

    def tools(delta):
        nonlocal content
        if delta is None:
            return
        content += delta.content or ''
        for t in delta.tool_calls:
            if t.index not in calls:
                assert t.index == len(calls) and t.id.startswith('call_') and t.name
                calls[t.index] = [t.name, '']
            else:
                assert t.id is None and t.name is None
            calls[t.index][1] += t.arguments
    for piece in pieces:
        r, c = rp.feed(piece)
        reasoning += r
        tools(tp.extract_tool_calls_streaming(c))
    r, c = rp.finish()
    reasoning += r
    tools(tp.extract_tool_calls_streaming(c))
    tools(tp.finish())
    return reasoning or None, content or None, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize('text, reasoning, content, calls', CASES)
def test_whole_parse(text, reasoning, content, calls):
    assert whole(text) == (reasoning, content, calls)
    for _, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize('text, reasoning, content, calls', CASES)
def test_stream_adds_up_to_the_whole_parse(text, reasoning, content, calls):
    for i, pieces in enumerate(chunkings(text, seed=len(text))):
        assert streamed(pieces) == (reasoning, content, calls), f'chunking {i}: {pieces}'


def test_the_tool_parser_alone_counts_reasoning_as_content():
    out = tool_parser().extract_tool_calls(CASES[2][0])
    assert out.content == 'Need the weather.' and [c.name for c in out.tool_calls] == ['get_weather']
    parser = tool_parser()
    parser.extract_tool_calls_streaming(CASES[2][0])
    assert parser.has_tool_calls()


def test_a_call_streams_its_name_first_then_its_arguments():
    parser = tool_parser()
    first = parser.extract_tool_calls_streaming('<|start|>assistant to=functions.get_weather<|channel|>commentary '
                                                'json<|message|>{"city": ')
    assert [(t.index, t.name, t.arguments) for t in first.tool_calls] == [(0, 'get_weather', ''), (0, None, '{"city": ')]
    later = parser.extract_tool_calls_streaming('"Paris"}<|ca')   # a cut marker is held back
    assert [t.arguments for t in later.tool_calls] == ['"Paris"}']
    assert parser.extract_tool_calls_streaming('ll|>') is None
    assert parser.finish() is None


class MarkerTokenizer:
    """The two calls keep_markers makes of a tokenizer: ``<|...|>`` markers are single special tokens
    when ``special``, else several ordinary ones."""

    def __init__(self, special: bool):
        self.special = special
        self.all_special_ids = [7]

    def encode(self, text, add_special_tokens=False):
        return [7] if self.special and text.startswith('<|') else [1, 2]


@pytest.mark.parametrize('special', [True, False])
def test_both_parsers_keep_the_markers_only_where_they_are_special_tokens(special):
    assert 'gpt-oss' in ToolParserManager.names() and 'gpt-oss' in ReasoningParserManager.names()
    for parser in (ToolParserManager.get('gpt-oss'), ReasoningParserManager.get('gpt-oss')):
        request = {'skip_special_tokens': True}
        assert parser(MarkerTokenizer(special)).adjust_request(request) == {'skip_special_tokens': not special}
        assert parser(None).adjust_request(request) is request
