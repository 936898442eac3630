"""gpt-oss's harmony format: an answer split into reasoning, content and tool calls, for the
parsers named ``gpt-oss`` (``--reasoning-parser gpt-oss --tool-call-parser gpt-oss``; their classes
are in reasoning_parser.py and tool_parser.py).

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

from .deltas import DeltaMessage, DeltaToolCall, make_tool_call_id, partial_suffix

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


def call_message(recipient: str) -> str:
    """The header of a call message, as the reasoning parser hands calls on to the tool parser."""
    return f'{START}assistant to={recipient}{CHANNEL}commentary{MESSAGE}'


def reasoning_and_content(events: list[tuple[str, str]]) -> tuple[str, str]:
    """The reasoning parser's split of ``events``: analysis as reasoning; the rest content, a call as a
    canonical call message (``call_message``, its arguments, ``<|call|>``) for the tool parser after it."""
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


class HarmonyCalls:
    """The tool parser's view: text fed in pieces -> ``DeltaMessage`` (content, and calls named by their
    recipient less ``functions.``, arguments ``'{}'`` when the body is empty); reasoning counts as content."""

    def __init__(self):
        self._splitter = HarmonySplitter()
        self.num_calls = 0
        self._args_sent = False

    def feed(self, text: str, final: bool = False) -> DeltaMessage | None:
        content, calls = [], []
        for kind, piece in self._splitter.feed(text, final):
            if kind in ('content', 'reasoning'):
                content.append(piece)
            elif kind == 'call':
                calls.append(DeltaToolCall(self.num_calls, id=make_tool_call_id(), name=piece.removeprefix('functions.')))
                self.num_calls += 1
                self._args_sent = False
            elif kind == 'args':
                calls.append(DeltaToolCall(self.num_calls - 1, arguments=piece))
                self._args_sent = self._args_sent or bool(piece.strip())
            elif not self._args_sent:   # end_call of a call without arguments
                calls.append(DeltaToolCall(self.num_calls - 1, arguments='{}'))
        joined = ''.join(content)
        return DeltaMessage(content=joined or None, tool_calls=calls) if joined or calls else None
