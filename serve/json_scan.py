"""``JsonObjectScan``: one JSON object followed through a text that only grows (a tool call being
streamed), and ``call_of``: a finished call body as (name, arguments JSON text)."""
from __future__ import annotations

import json
import re

_WS = re.compile(r'[ \t\n\r]*')
_SCALAR = re.compile(r'[-+.0-9A-Za-z]+')
_STRING_STOP = re.compile(r'["\\]')


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


def call_of(body: str, scan: JsonObjectScan) -> tuple[str, str] | None:
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
