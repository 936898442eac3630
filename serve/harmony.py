"""gpt-oss's harmony format: an answer split into reasoning, content and tool calls
(``--reasoning-parser gpt-oss --tool-call-parser gpt-oss``).

gpt-oss writes its answer as messages, each a header, ``<|message|>`` and a body closed by
``<|end|>``, ``<|call|>`` or ``<|return|>``; the next one opens with ``<|start|>assistant``. The
generation prompt ends with ``<|start|>assistant``, so the first header follows at once::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    <|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

A header names the channel (``<|channel|>NAME``) and maybe a recipient (``to=functions.NAME``,
before or after the channel) and a content type. What each message becomes:

- channel ``analysis``: reasoning;
- channel ``final``, or ``commentary`` without a recipient (a preamble the user may see): content;
- a message with a recipient: a tool call named by the recipient less its ``functions.`` namespace,
  its body the arguments' JSON text (``'{}'`` when empty).

Text outside any message (an answer written without headers) is content. ``<|call|>`` and
``<|return|>`` end generation (they are gpt-oss's stop tokens), so an answer may stop at the body's
end without them. The markers are special tokens: both parsers ask for ``skip_special_tokens=False``.

The two parsers share one splitter. The reasoning parser keeps a call in its content, as a canonical
call message, so that the tool parser after it (the api_server runs the reasoning parser first)
still finds it; used alone, the tool parser counts reasoning as content. A stream, in any chunking,
adds up to the whole parse; a marker cut across deltas is held back until it is whole.
"""
from __future__ import annotations

import re

from .deltas import DeltaMessage, DeltaToolCall, ExtractedToolCalls, ToolCall, make_tool_call_id, partial_suffix
from .reasoning_parser import ReasoningParser, ReasoningParserManager
from .tool_parser import ToolParser, ToolParserManager

START, CHANNEL, MESSAGE = '<|start|>', '<|channel|>', '<|message|>'
BODY_ENDS = ('<|end|>', '<|call|>', '<|return|>')
MARKERS = (START, CHANNEL, MESSAGE, '<|constrain|>') + BODY_ENDS
_OPENERS = (START, CHANNEL)   # a header begins with one of these, or (first thing in the answer) with ' to='
_RECIPIENT = re.compile(r'\bto=([^\s<]+)')
_CHANNEL = re.compile(re.escape(CHANNEL) + r'\s*([^\s<]+)')


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of ``markers`` in ``text``: (index, marker), or (-1, '')."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, '')


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How much of ``text``'s end may be the beginning of one of ``markers`` (held back)."""
    return max(partial_suffix(text, m) for m in markers)


class HarmonySplitter:
    """Harmony text, fed in pieces, as events: ('reasoning', text), ('content', text),
    ('call', recipient), ('args', text), ('end_call', '')."""

    def __init__(self):
        self.buf = ''
        self.mode = 'start'   # 'start' | 'content' | 'header' | 'body'
        self.kind = ''        # the body's: 'reasoning', 'content' or 'call'
        self.events: list[tuple[str, str]] = []

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += text
        while self._step(final):
            pass
        if final and self.mode == 'body' and self.kind == 'call':
            self.events.append(('end_call', ''))   # stopped at <|call|>, the stop token, unwritten
            self.mode = 'content'
        events, self.events = self.events, []
        return events

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.events and self.events[-1][0] == kind and kind != 'call':
            self.events[-1] = (kind, self.events[-1][1] + text)
        else:
            self.events.append((kind, text))

    def _step(self, final: bool) -> bool:
        if self.mode == 'start':   # a header first (the prompt ended with <|start|>assistant), or plain text
            head = self.buf.lstrip(' ')
            if head.startswith(_OPENERS + ('to=',)):
                self.mode = 'header'
                return True
            if not final and any(m.startswith(head) for m in _OPENERS + ('to=',)):
                return False
            self.mode = 'content'
            return True
        if self.mode == 'content':
            i, _ = _first(self.buf, _OPENERS)
            cut = i if i >= 0 else len(self.buf) - (0 if final else _held(self.buf, _OPENERS))
            self._emit('content', self.buf[:cut])
            self.buf = self.buf[cut:]
            if i < 0:
                return False
            self.mode = 'header'
            return True
        if self.mode == 'header':
            i = self.buf.find(MESSAGE)
            if i < 0:
                if final:   # a header never finished: its text is content
                    self._emit('content', self.buf)
                    self.buf = ''
                return False
            self._open_body(self.buf[:i])
            self.buf = self.buf[i + len(MESSAGE):]
            self.mode = 'body'
            return True
        # body
        i, end = _first(self.buf, BODY_ENDS)
        cut = i if i >= 0 else len(self.buf) - (0 if final else _held(self.buf, BODY_ENDS))
        self._emit('args' if self.kind == 'call' else self.kind, self.buf[:cut])
        self.buf = self.buf[cut:]
        if i < 0:
            return False
        self.buf = self.buf[len(end):]
        if self.kind == 'call':
            self.events.append(('end_call', ''))
        self.mode = 'content'
        return True

    def _open_body(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient:
            self.kind = 'call'
            self.events.append(('call', recipient.group(1)))
        else:
            self.kind = 'reasoning' if channel and channel.group(1) == 'analysis' else 'content'


def _keep_markers(tokenizer, request):
    """``skip_special_tokens=False`` when the harmony markers are special tokens of ``tokenizer``."""
    if tokenizer is None:
        return request
    special = set(tokenizer.all_special_ids)
    for marker in MARKERS:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in special:
            if isinstance(request, dict):
                request['skip_special_tokens'] = False
            else:
                request.skip_special_tokens = False
            break
    return request


def call_message(recipient: str) -> str:
    """The header of a call message, as the reasoning parser hands calls on to the tool parser."""
    return f'{START}assistant to={recipient}{CHANNEL}commentary{MESSAGE}'


@ReasoningParserManager.register('gpt-oss')
class GptOssReasoningParser(ReasoningParser):
    """Reasoning: the ``analysis`` messages; content: the rest, calls as canonical call messages."""
    name = 'gpt-oss'

    def __init__(self, tokenizer=None, prompt: str | None = None):
        self.tokenizer = tokenizer
        self._splitter = HarmonySplitter()

    def adjust_request(self, request):
        return _keep_markers(self.tokenizer, request)

    @staticmethod
    def _split(events) -> tuple[str, str]:
        reasoning, content = [], []
        for kind, text in events:
            if kind == 'reasoning':
                reasoning.append(text)
            elif kind in ('content', 'args'):
                content.append(text)
            elif kind == 'call':
                content.append(call_message(text))
            else:   # end_call
                content.append('<|call|>')
        return ''.join(reasoning), ''.join(content)

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self._split(HarmonySplitter().feed(text, final=True))
        return reasoning or None, content or None

    extract = extract_reasoning

    def feed(self, delta_text: str) -> tuple[str, str]:
        return self._split(self._splitter.feed(delta_text))

    def finish(self) -> tuple[str, str]:
        return self._split(self._splitter.feed('', final=True))


@ToolParserManager.register('gpt-oss')
class GptOssToolParser(ToolParser):
    """Tool calls: the messages with a recipient; everything else is content."""
    name = 'gpt-oss'
    start_marker = START

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._splitter = HarmonySplitter()
        self._calls = 0
        self._args_sent = False

    @property
    def markers(self) -> list[str]:
        return list(MARKERS)

    def adjust_request(self, request):
        return _keep_markers(self.tokenizer, request)

    def _deltas(self, events) -> DeltaMessage | None:
        content, calls = [], []
        for kind, text in events:
            if kind in ('content', 'reasoning'):
                content.append(text)
            elif kind == 'call':
                name = text.removeprefix('functions.')
                calls.append(DeltaToolCall(self._calls, id=make_tool_call_id(), name=name))
                self._calls += 1
                self._args_sent = False
            elif kind == 'args':
                calls.append(DeltaToolCall(self._calls - 1, arguments=text))
                self._args_sent = self._args_sent or bool(text.strip())
            elif not self._args_sent:   # end_call of a call without arguments
                calls.append(DeltaToolCall(self._calls - 1, arguments='{}'))
        text = ''.join(content)
        return DeltaMessage(content=text or None, tool_calls=calls) if text or calls else None

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        parser = GptOssToolParser()
        out = parser._deltas(parser._splitter.feed(text, final=True)) or DeltaMessage()
        calls: dict[int, dict] = {}
        for d in out.tool_calls:
            call = calls.setdefault(d.index, {'id': d.id, 'name': d.name, 'arguments': ''})
            call['arguments'] += d.arguments
        return ExtractedToolCalls(out.content, [ToolCall(**c) for c in calls.values()])

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        return self._deltas(self._splitter.feed(delta_text))

    def finish(self) -> DeltaMessage | None:
        return self._deltas(self._splitter.feed('', final=True))

    def has_tool_calls(self) -> bool:
        return self._calls > 0
