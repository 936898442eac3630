"""``ToolCallStream``: the machine every tool parser runs, splitting an answer fed in pieces into
content and calls for one format (its start and end markers, a bare ``{`` opening the answer, a
separator between calls). The rules it keeps are in ``tool_parser.py``'s docstring."""
from __future__ import annotations

import json
import re
from typing import Protocol

from .deltas import DeltaMessage, DeltaToolCall, make_tool_call_id, partial_suffix
from .json_scan import JsonObjectScan, call_of

_SEPARATORS = {';': re.compile(r'\s*(;\s*)?'), ',': re.compile(r'\s*(,\s*)?')}


class ToolCallFormat(Protocol):
    """How one model family writes its calls (a ``ToolParser`` class is one)."""
    start_marker: str
    end_marker: str | None
    bare_json_start: bool      # a '{' opening the answer is a call (llama3)
    separator: str | None      # between calls (llama3: ';', mistral: ',')
    array: bool                # the calls after the start marker are a JSON array's items (mistral)


class ToolCallStream:
    """Splits an answer, fed in pieces, into content and calls, for one format.

    ``eager`` (streaming) sends a call as soon as its name and the start of its arguments are known;
    otherwise (a whole answer) a call is judged once its block is complete.
    """

    def __init__(self, fmt: ToolCallFormat, eager: bool):
        self.p = fmt
        self.eager = eager
        self.buf = ''              # received, not yet consumed
        self.mode = 'content'      # 'content' | 'call' | 'bad_block' | 'between' (llama3, mistral: after a call)
        #                            | 'open' (mistral: after the marker, before its '[') | 'rest'
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
        if self.mode == 'open':
            return self._step_open(final)
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
            self.mode = 'open' if self.p.array else 'call'
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
            parsed = call_of(body, self.scan)
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

    def _step_open(self, final: bool) -> bool:
        """mistral after its marker: ``[`` opens the array of calls (a lone ``{`` is one call too);
        anything else makes the marker content."""
        stripped = self.buf.lstrip()
        if not stripped and not final:
            return False
        if stripped.startswith(('[', '{')):
            body = stripped[1:].lstrip() if stripped[0] == '[' else stripped
            self.opener += self.buf[:len(self.buf) - len(body)]   # content again if the call is bad
            self.buf = body
            self.mode = 'call'
            return True
        return self._bad_block()

    def _step_between(self, final: bool) -> bool:
        """After a call: the separator and another ``{`` continue the calls (a JSON array's ``]`` ends
        them, mistral); anything else is content (llama3: the rest of the answer)."""
        m = _SEPARATORS[self.p.separator].match(self.buf)
        rest = self.buf[m.end():]
        if not rest and not final:
            return False
        if (m.group(1) is not None or self.p.array) and rest.startswith('{'):
            self.buf = rest
            self._new_block('')
            self.mode = 'call'
            return True
        if self.p.array and rest.startswith(']'):
            self.buf = rest[1:]
            self.mode = 'content'
            return True
        if not rest:   # a trailing separator ends the calls
            self.buf = ''
        self.mode = 'rest'
        return True
