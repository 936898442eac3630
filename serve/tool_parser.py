"""Tool-call parsers: model output text -> OpenAI ``tool_calls``, for whole answers and streams.

Each parser knows one model family's way of writing a call (``--tool-call-parser``):

- ``qwen`` (alias ``hermes``; Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  any number of them, possibly after some content.
- ``llama3`` (Llama 3.1/3.2 JSON tools): the answer is ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``; several calls are separated by ``;``.
- ``internlm`` (InternLM2/2.5): ``<|action_start|><|plugin|>\\n{"name": ..., "parameters": {...}}<|action_end|>``.

Every format accepts either ``arguments`` or ``parameters`` for the arguments.

What a parser returns (the api_server turns these into its response models):

- ``extract_tool_calls(text) -> ExtractedToolCalls(content, tool_calls)``; ``ToolCall(id, name, arguments)``
  with ``arguments`` a JSON text, as OpenAI sends it. ``ToolCall.to_openai()`` is OpenAI's dict.
- ``extract_tool_calls_streaming(delta_text) -> DeltaMessage | None`` then ``finish() -> DeltaMessage | None``
  once the answer ends. A ``DeltaMessage`` carries ``content`` and ``tool_calls``: ``DeltaToolCall(index, id,
  name, arguments)``. A call's first delta has its ``index``, ``id``, ``name`` and the first piece of
  ``arguments`` (maybe ''); later ones only ``index`` and the next piece, as OpenAI streams them
  (``DeltaToolCall.to_openai()``). The stream's state lives in the parser: one parser per answer;
  ``has_tool_calls()`` says whether it sent a call. ``to_dict`` is an alias of each ``to_openai``.

Rules both paths keep, so a stream adds up to the whole parse (content joined, argument pieces joined):

- ``arguments`` is the model's own JSON text of the arguments object (an arguments value written as
  a JSON string is decoded: its text is the arguments); no arguments give ``'{}'``.
- Whitespace next to a call is dropped; all other content is kept as written.
- A call block that is not a JSON object with a string ``name`` (and object or string arguments) is
  kept as content, markers included, never raised. A stream sends a call once it has seen its name and
  the start of its arguments; if the JSON breaks after that (the answer was cut by ``max_tokens``),
  the call keeps the arguments sent so far, where the whole parse would keep the block as content.

With a reasoning parser as well, the reasoning parser goes first and only its ``content`` is fed here.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .registry import Registry

# ---- what parsers return ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {'id': self.id, 'type': 'function', 'function': {'name': self.name, 'arguments': self.arguments}}

    to_dict = to_openai


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class DeltaToolCall:
    index: int
    id: str | None = None         # only in a call's first delta
    name: str | None = None       # only in a call's first delta
    arguments: str = ''           # the next piece of the arguments' JSON text

    def to_openai(self) -> dict:
        out: dict[str, Any] = {'index': self.index}
        function: dict[str, Any] = {'arguments': self.arguments}
        if self.id is not None:
            out['id'], out['type'] = self.id, 'function'
        if self.name is not None:
            function = {'name': self.name, **function}
        out['function'] = function
        return out

    to_dict = to_openai


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def to_openai(self) -> dict:
        out: dict[str, Any] = {}
        if self.content is not None:
            out['content'] = self.content
        if self.reasoning_content is not None:
            out['reasoning_content'] = self.reasoning_content
        if self.tool_calls:
            out['tool_calls'] = [t.to_openai() for t in self.tool_calls]
        return out

    to_dict = to_openai


def make_tool_call_id() -> str:
    return f'call_{uuid.uuid4().hex[:24]}'


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker`` (held back in a stream)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# ---- following a JSON object as it grows ----------------------------------------------------------

_WS = re.compile(r'[ \t\n\r]*')
_SCALAR = re.compile(r'[-+.0-9A-Za-z]+')
_STRING_STOP = re.compile(r'["\\]')
_SEPARATOR = re.compile(r'\s*(;\s*)?')


class JsonObjectScan:
    """Follows one JSON object through a text that only grows: where each top-level value lies, where
    the object closes, and whether its structure already broke. Values are not decoded (numbers and
    literals are only roughly checked); ``json.loads`` judges a finished object.

    ``fields``: ``[key, value_start, value_end]`` per top-level key in order; ``value_start`` is None
    until the value begins and ``value_end`` None until it ends.
    """

    def __init__(self):
        self.pos = 0
        self.stack: list[str] = []     # open containers, '{' or '['
        self.expect = 'object'         # what the innermost container wants next
        self.fields: list[list] = []
        self.end: int | None = None    # just past the closing brace
        self.error: str | None = None
        self._string_scan = 0          # where the search for a string's closing quote resumes

    def field(self, *keys: str) -> list | None:
        for f in self.fields:
            if f[0] in keys:
                return f
        return None

    def feed(self, text: str) -> None:
        """Scan ``text``, the object's text so far (a longer version of the last one fed)."""
        while self.end is None and self.error is None:
            self.pos = _WS.match(text, self.pos).end()
            if self.pos >= len(text):
                return
            c = text[self.pos]
            if c == '"':
                stop = self._string_end(text)
                if stop is None:
                    return
                self._token('string', text, stop)
            elif c in '{[':
                self._open(c)
            elif c in '}]':
                self._close(c)
            elif c == ':':
                self._punct('colon', 'value')
            elif c == ',':
                self._punct('comma_or_close', 'key' if self.stack[-1:] == ['{'] else 'value')
            else:
                m = _SCALAR.match(text, self.pos)
                if m is None:
                    self.error = f'unexpected {c!r} at {self.pos}'
                elif m.end() == len(text):
                    return  # the number or literal may go on
                else:
                    self._token('scalar', text, m.end())

    def _string_end(self, text: str) -> int | None:
        i = max(self._string_scan, self.pos + 1)
        while True:
            m = _STRING_STOP.search(text, i)
            if m is None or m.end() >= len(text) and m.group() == '\\':
                self._string_scan = m.start() if m else len(text)
                return None
            if m.group() == '"':
                self._string_scan = 0
                return m.end()
            i = m.end() + 1  # skip the escaped character

    def _value_starts(self) -> bool:
        if self.expect not in ('value', 'value_or_close', 'object'):
            self.error = f'unexpected value at {self.pos}'
            return False
        if len(self.stack) == 1 and self.stack[0] == '{':
            self.fields[-1][1] = self.pos
        return True

    def _value_ends(self, end: int) -> None:
        if len(self.stack) == 1 and self.stack[0] == '{':
            self.fields[-1][2] = end
        self.expect = 'comma_or_close'

    def _token(self, kind: str, text: str, end: int) -> None:
        if kind == 'string' and self.expect in ('key_or_close', 'key'):
            if len(self.stack) == 1:
                try:
                    key = json.loads(text[self.pos:end])
                except json.JSONDecodeError:
                    self.error = f'bad key at {self.pos}'
                    return
                self.fields.append([key, None, None])
            self.expect = 'colon'
        elif self.expect == 'object':
            self.error = f'expected an object at {self.pos}'
            return
        elif self._value_starts():
            self._value_ends(end)
        else:
            return
        self.pos = end

    def _open(self, c: str) -> None:
        if self.expect == 'object' and c != '{':
            self.error = f'expected an object at {self.pos}'
            return
        if not self._value_starts():
            return
        self.stack.append(c)
        self.expect = 'key_or_close' if c == '{' else 'value_or_close'
        self.pos += 1

    def _close(self, c: str) -> None:
        want = '{' if c == '}' else '['
        if self.stack[-1:] != [want] or self.expect not in ('key_or_close', 'value_or_close', 'comma_or_close'):
            self.error = f'unexpected {c!r} at {self.pos}'
            return
        self.stack.pop()
        self.pos += 1
        if not self.stack:
            self.end = self.pos
        else:
            self._value_ends(self.pos)

    def _punct(self, wanted: str, then: str) -> None:
        if self.expect != wanted:
            self.error = f'unexpected {"," if wanted == "comma_or_close" else ":"} at {self.pos}'
            return
        self.expect = then
        self.pos += 1


def _call_of(body: str, scan: JsonObjectScan) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a finished call body, or None when it is not a valid call."""
    if scan.error is not None or scan.end is None or body[scan.end:].strip():
        return None
    try:
        if not isinstance(json.loads(body, strict=False), dict):
            return None
        name_field = scan.field('name')
        if name_field is None or body[name_field[1]] != '"':
            return None
        name = json.loads(body[name_field[1]:name_field[2]], strict=False)
        args_field = scan.field('arguments', 'parameters')
        if args_field is None:
            return name, '{}'
        raw = body[args_field[1]:args_field[2]]
        if raw[0] == '{':
            return name, raw
        if raw[0] == '"':
            return name, json.loads(raw, strict=False)
    except json.JSONDecodeError:
        pass
    return None


# ---- the stream machine ----------------------------------------------------------------------------

class _CallStream:
    """Splits an answer, fed in pieces, into content and calls, for one parser's format.

    ``eager`` (streaming) sends a call as soon as its name and the start of its arguments are known;
    otherwise (a whole answer) a call is judged once its block is complete.
    """

    def __init__(self, parser: 'ToolParser', eager: bool):
        self.p = parser
        self.eager = eager
        self.buf = ''              # received, not yet consumed
        self.mode = 'content'      # 'content' | 'call' | 'bad_block' | 'between' (llama3, after a call) | 'rest'
        self.held_ws = ''          # content whitespace that a following call would drop
        self.after_call = False    # drop the whitespace right after a call
        self.seen_text = False     # non-space content seen (llama3: a bare '{' opens a call only at the start)
        self.num_calls = 0
        self._new_block('')
        self._content: list[str] = []
        self._deltas: list[DeltaToolCall] = []

    def _new_block(self, opener: str) -> None:
        self.opener = opener       # the marker text that opened the block (content again if it is bad)
        self.scan = JsonObjectScan()
        self.call: DeltaToolCall | None = None   # the committed call: index, and what was sent
        self.args_sent = 0

    # -- output --

    def _emit_content(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        kept = text.rstrip()
        if kept:
            self._content.append(self.held_ws + kept)
            self.held_ws = ''
            self.seen_text = True
        self.held_ws += text[len(kept):]

    def _send(self, delta: DeltaToolCall) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == delta.index and delta.id is None:
            last.arguments += delta.arguments
        else:
            self._deltas.append(delta)

    def take(self) -> DeltaMessage | None:
        content = ''.join(self._content)
        if not content and not self._deltas:
            return None
        out = DeltaMessage(content=content or None, tool_calls=self._deltas)
        self._content, self._deltas = [], []
        return out

    # -- input --

    def feed(self, text: str) -> None:
        self.buf += text
        while self._step(final=False):
            pass

    def finish(self) -> None:
        while self._step(final=True):
            pass
        if self.buf:  # content mode holds only an unfinished marker
            self._emit_content(self.buf)
            self.buf = ''
        if self.held_ws and not self.after_call:
            self._content.append(self.held_ws)
        self.held_ws = ''

    def _step(self, final: bool) -> bool:
        """Consume what can be decided from ``buf``; True when the mode changed (go again)."""
        if self.mode == 'content':
            return self._step_content(final)
        if self.mode == 'call':
            return self._step_call(final)
        if self.mode == 'between':
            return self._step_between(final)
        if self.mode == 'bad_block':
            return self._step_bad_block(final)
        # 'rest': everything is content
        self._emit_content(self.buf)
        self.buf = ''
        return False

    def _step_bad_block(self, final: bool) -> bool:
        """A block that is no call: content up to and with its end marker (llama3: all the rest)."""
        end = self.p.end_marker
        i = self.buf.find(end) if end else -1
        if i >= 0:
            self._emit_content(self.buf[:i + len(end)])
            self.buf = self.buf[i + len(end):]
            self.mode = 'content'
            return True
        if end is None:
            self.mode = 'rest'
            return True
        keep = 0 if final else partial_suffix(self.buf, end)
        self._emit_content(self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _step_content(self, final: bool) -> bool:
        start = self.p.start_marker
        if self.p.bare_json_start and not self.seen_text and not self.num_calls:
            stripped = self.buf.lstrip()
            if stripped.startswith('{'):
                self._emit_content(self.buf[:len(self.buf) - len(stripped)])
                self.buf = stripped
                self._new_block('')
                self.mode = 'call'
                return True
        i = self.buf.find(start)
        if i >= 0:
            self._emit_content(self.buf[:i])
            self.buf = self.buf[i + len(start):]
            self._new_block(start)
            self.mode = 'call'
            return True
        keep = 0 if final else partial_suffix(self.buf, start)
        if self.p.bare_json_start and not self.seen_text and not self.num_calls and not self.buf.strip():
            keep = len(self.buf)  # only whitespace yet: a '{' may still open a call
        self._emit_content(self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _step_call(self, final: bool) -> bool:
        end = self.p.end_marker
        found = self.buf.find(end) if end else -1
        if found >= 0:
            body, complete = self.buf[:found], True
        elif final:
            body, complete = self.buf, True
        else:
            keep = partial_suffix(self.buf, end) if end else 0
            body, complete = self.buf[:len(self.buf) - keep], False
        self.scan.feed(body)
        if end is None and self.scan.end is not None:
            body, complete = body[:self.scan.end], True   # llama3: the object's end ends the call
        if self.scan.error is not None and self.call is None:
            return self._bad_block()
        if self.eager and self.call is None:
            if not self._try_commit(body):
                return self._bad_block()
        if self.call is not None:
            self._send_args(body, complete)
        if not complete:
            return False
        if self.call is None:
            parsed = _call_of(body, self.scan)
            if parsed is None:
                return self._bad_block()
            name, arguments = parsed
            self._commit(name)
            self._send(DeltaToolCall(self.call.index, arguments=arguments))
        elif self.args_sent == 0 and self.scan.field('arguments', 'parameters') is None:
            self._send(DeltaToolCall(self.call.index, arguments='{}'))
        consumed = len(body) + (len(end) if found >= 0 else 0)
        self.buf = self.buf[consumed:]
        self.after_call = True
        self.mode = 'between' if self.p.separator else 'content'
        return True

    def _try_commit(self, body: str) -> bool:
        """Eager: commit once the name and the start of the arguments are known; False if the call is bad."""
        name_field = self.scan.field('name')
        args_field = self.scan.field('arguments', 'parameters')
        if name_field is None or name_field[1] is None:
            return True
        if body[name_field[1]] != '"':
            return False
        if name_field[2] is None or args_field is None or args_field[1] is None:
            return True   # wait: the block may still end without arguments, judged whole then
        if body[args_field[1]] not in '{"':
            return False
        try:
            self._commit(json.loads(body[name_field[1]:name_field[2]], strict=False))
        except json.JSONDecodeError:
            return False
        return True

    def _commit(self, name: str) -> None:
        self.call = DeltaToolCall(self.num_calls)
        self.num_calls += 1
        self.held_ws = ''   # whitespace before a call is dropped
        self._send(DeltaToolCall(self.call.index, id=make_tool_call_id(), name=name))

    def _send_args(self, body: str, complete: bool) -> None:
        f = self.scan.field('arguments', 'parameters')
        if f is None or f[1] is None:
            return
        start, stop = f[1], f[2]
        if body[start] == '"':   # arguments written as a JSON string: sent decoded, once whole
            if stop is not None and self.args_sent == 0:
                try:
                    piece = json.loads(body[start:stop], strict=False)
                except json.JSONDecodeError:
                    return
                self.args_sent = len(piece) or 1
                self._send(DeltaToolCall(self.call.index, arguments=piece))
            return
        stop = stop if stop is not None else len(body)
        if self.scan.error is not None and f[2] is None:
            stop = min(stop, self.scan.pos)   # broken JSON: send no further than the scan got
        piece = body[start + self.args_sent:stop]
        if piece:
            self.args_sent += len(piece)
            self._send(DeltaToolCall(self.call.index, arguments=piece))

    def _bad_block(self) -> bool:
        self._emit_content(self.opener)
        self.mode = 'bad_block'
        return True

    def _step_between(self, final: bool) -> bool:
        """llama3 after a call: ``;`` and another ``{`` continue the calls; anything else is content."""
        m = _SEPARATOR.match(self.buf)
        rest = self.buf[m.end():]
        if not rest and not final:
            return False
        if m.group(1) is not None and rest.startswith('{'):
            self.buf = rest
            self._new_block('')
            self.mode = 'call'
            return True
        if not rest:   # a trailing ';' ends the calls
            self.buf = ''
        self.mode = 'rest'
        return True


# ---- parsers -------------------------------------------------------------------------------------

class ToolParser:
    """One model family's tool-call format. Create one per answer: the streaming state lives here."""
    name = ''
    start_marker = ''
    end_marker: str | None = None
    bare_json_start = False    # a '{' opening the answer is a call (llama3)
    separator: str | None = None

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._stream = _CallStream(self, eager=True)

    @property
    def markers(self) -> list[str]:
        return [m for m in (self.start_marker, self.end_marker) if m]

    def adjust_request(self, request):
        """Keep the markers in the output text: ``skip_special_tokens=False`` when one is a special token.

        ``request`` is anything with a ``skip_special_tokens`` attribute (or key); it is returned."""
        if self.tokenizer is not None and any(self._is_special(m) for m in self.markers):
            if isinstance(request, dict):
                request['skip_special_tokens'] = False
            else:
                request.skip_special_tokens = False
        return request

    def _is_special(self, marker: str) -> bool:
        ids = self.tokenizer.encode(marker, add_special_tokens=False)
        return len(ids) == 1 and ids[0] in set(self.tokenizer.all_special_ids)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole answer, and the content around them (None when there is none)."""
        stream = _CallStream(self, eager=False)
        stream.feed(text)
        stream.finish()
        out = stream.take() or DeltaMessage()
        calls: dict[int, dict] = {}
        for d in out.tool_calls:
            call = calls.setdefault(d.index, {'id': d.id, 'name': d.name, 'arguments': ''})
            call['arguments'] += d.arguments
        return ExtractedToolCalls(out.content, [ToolCall(**c) for c in calls.values()])

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        """Feed the next piece of the answer; what can be sent now, or None."""
        self._stream.feed(delta_text)
        return self._stream.take()

    def finish(self) -> DeltaMessage | None:
        """The answer ended: send what was held back (an unfinished marker, a call without its end)."""
        self._stream.finish()
        return self._stream.take()

    def has_tool_calls(self) -> bool:
        """Has the stream sent a call (the answer's finish_reason is then 'tool_calls')?"""
        return self._stream.num_calls > 0


ToolParserManager = Registry('tool call parser')


@ToolParserManager.register('qwen', 'hermes')
class QwenToolParser(ToolParser):
    name = 'qwen'
    start_marker = '<tool_call>'
    end_marker = '</tool_call>'


@ToolParserManager.register('llama3')
class Llama3JsonToolParser(ToolParser):
    name = 'llama3'
    start_marker = '<|python_tag|>'
    end_marker = None
    bare_json_start = True
    separator = ';'


@ToolParserManager.register('internlm')
class InternLMToolParser(ToolParser):
    name = 'internlm'
    start_marker = '<|action_start|><|plugin|>'
    end_marker = '<|action_end|>'

    @property
    def markers(self) -> list[str]:
        return ['<|action_start|>', '<|plugin|>', '<|action_end|>']
