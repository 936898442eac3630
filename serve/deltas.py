"""What the parsers hand the api_server: tool calls whole (``ToolCall``, ``ExtractedToolCalls``) and
streamed (``DeltaToolCall`` in a ``DeltaMessage``), as OpenAI writes them; and ``partial_suffix``,
with which both parsers hold back a marker cut across two deltas."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


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


def keep_markers(tokenizer, request, markers):
    """``skip_special_tokens=False`` on ``request`` (anything with that attribute, or a dict) when one of
    ``markers`` is a special token of ``tokenizer`` (the parser must see it in the text); ``request``
    is returned. No tokenizer: nothing to say."""
    if tokenizer is None:
        return request
    special = set(tokenizer.all_special_ids)
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in special:
            if isinstance(request, dict):
                request['skip_special_tokens'] = False
            else:
                request.skip_special_tokens = False
            break
    return request


def whole_answer(out: DeltaMessage | None) -> ExtractedToolCalls:
    """A whole parse's one ``DeltaMessage`` (or None: nothing) as ``ExtractedToolCalls``."""
    out = out or DeltaMessage()
    calls: dict[int, dict] = {}
    for d in out.tool_calls:
        call = calls.setdefault(d.index, {'id': d.id, 'name': d.name, 'arguments': ''})
        call['arguments'] += d.arguments
    return ExtractedToolCalls(out.content, [ToolCall(**c) for c in calls.values()])
