"""Reasoning parsers: <think> split whole and streamed, markers cut across deltas, with a tool parser after."""
import random

import pytest

from serve.reasoning_parser import ReasoningParserManager, prompt_opens_think
from serve.tool_parser import ToolParserManager

QWQ_PROMPT = '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n'

# (parser, constructor kwargs, answer, expected reasoning, expected content)
CASES = [
    ('deepseek-r1', {}, '<think>\nThe user greets me. 你好 😀\n\n</think>\n\nHello! How can I help?',
     'The user greets me. 你好 😀', 'Hello! How can I help?'),
    ('deepseek-r1', {}, 'No opening tag here.\nStill thinking.</think>The answer is 4.',
     'No opening tag here.\nStill thinking.', 'The answer is 4.'),
    ('deepseek-r1', {}, 'cut while thinking <', 'cut while thinking <', None),
    ('deepseek-r1', {}, '<think></think>', None, None),
    ('deepseek-r1', {}, '<think>a</think>b</think>c <think>d', 'a', 'b</think>c <think>d'),
    ('deepseek-r1', {}, '  <think>  x  </think>  y  ', 'x', 'y  '),
    ('qwen-qwq', {}, '<think>\nLet me add: 2+2=4.\n</think>\n\n2+2 is **4**.', 'Let me add: 2+2=4.', '2+2 is **4**.'),
    ('qwen3', {}, '<think>\n\n</think>\n\nHi there!', None, 'Hi there!'),   # Qwen3 thinking off, tags echoed
    ('qwen3', {}, '  Just an answer, no tags.', None, '  Just an answer, no tags.'),
    ('qwen3', {}, 'An answer that mentions </think> is content', None, 'An answer that mentions </think> is content'),
    ('qwen3', {}, '<thi', None, '<thi'),
    ('qwen3', {}, '<think>\nunfinished thought', 'unfinished thought', None),
    ('qwen-qwq', {'prompt': QWQ_PROMPT}, 'Okay, so 2+2.\n</think>\n\nIt is 4.', 'Okay, so 2+2.', 'It is 4.'),
    ('qwen-qwq', {'prompt': QWQ_PROMPT + 'x</think>\n\n'}, 'Plain.', None, 'Plain.'),
]


def stream(parser, pieces):
    reasoning, content = '', ''
    for r, c in [parser.feed(p) for p in pieces] + [parser.finish()]:
        assert isinstance(r, str) and isinstance(c, str)
        reasoning += r
        content += c
    return reasoning or None, content or None


def chunkings(text, seed):
    rng = random.Random(seed)
    yield list(text)
    for _ in range(8):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 10))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize('name, kwargs, text, reasoning, content', CASES)
def test_whole_and_stream(name, kwargs, text, reasoning, content):
    cls = ReasoningParserManager.get(name)
    assert cls(None, **kwargs).extract_reasoning(text) == (reasoning, content)
    for i, pieces in enumerate(chunkings(text, seed=len(text))):
        assert stream(cls(None, **kwargs), pieces) == (reasoning, content), f'chunking {i}: {pieces}'


def test_markers_cut_across_deltas_are_held_back():
    parser = ReasoningParserManager.get('deepseek-r1')(None)
    assert parser.feed('<thi') == ('', '')
    assert parser.feed('nk>\nStep one.') == ('Step one.', '')
    assert parser.feed(' Two.\n</th') == (' Two.', '')
    assert parser.feed('ink>') == ('', '')
    assert parser.feed('\n\nAnswer') == ('', 'Answer')
    assert parser.feed(' </think>') == ('', ' </think>')
    assert parser.finish() == ('', '')
    assert parser.extract('<think>r</think>c') == parser.extract_reasoning('<think>r</think>c') == ('r', 'c')


def test_prompt_opens_think():
    assert prompt_opens_think(QWQ_PROMPT)
    assert not prompt_opens_think(QWQ_PROMPT + 'x</think>')
    assert not prompt_opens_think('<|im_start|>assistant\n')


def test_manager():
    assert ReasoningParserManager.get('qwen3') is ReasoningParserManager.get('qwen-qwq')
    with pytest.raises(ValueError, match="'o1' is unknown: available are deepseek-r1, gpt-oss, qwen-qwq, qwen3"):
        ReasoningParserManager.get('o1')


def test_reasoning_then_tool_calls_streamed():
    # the server's order: the reasoning parser first, its content into the tool parser
    text = ('<think>\nI should call get_weather.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning_parser = ReasoningParserManager.get('qwen3')(None)
    assert reasoning_parser.extract_reasoning(text)[0] == 'I should call get_weather.'
    for pieces in chunkings(text, seed=1):
        rp, tp = ReasoningParserManager.get('qwen3')(None), ToolParserManager.get('qwen')(None)
        reasoning, content, calls = '', '', {}
        for piece in pieces + [None]:
            r, c = rp.feed(piece) if piece is not None else rp.finish()
            deltas = []
            reasoning += r
            if c:
                deltas.append(tp.extract_tool_calls_streaming(c))
            if piece is None:
                deltas.append(tp.finish())
            for d in filter(None, deltas):
                content += d.content or ''
                for t in d.tool_calls:
                    calls.setdefault(t.index, [t.name, ''])[1] += t.arguments
        assert reasoning == 'I should call get_weather.' and content == '' and tp.has_tool_calls()
        assert list(calls.values()) == [['get_weather', '{"city": "Paris"}']]
