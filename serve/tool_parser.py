"""Tool-call parsers: model output text -> OpenAI ``tool_calls``, for whole answers and streams.

Each parser knows one model family's way of writing a call (``--tool-call-parser``):

- ``qwen`` (alias ``hermes``; Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  any number of them, possibly after some content.
- ``llama3`` (Llama 3.1/3.2 JSON tools): the answer is ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``; several calls are separated by ``;``.
- ``internlm`` (InternLM2/2.5): ``<|action_start|><|plugin|>\\n{"name": ..., "parameters": {...}}<|action_end|>``.
- ``gpt-oss``: harmony messages (``harmony.py``); a message with a recipient ``to=functions.NAME`` is a call,
  its body the arguments.
- ``mistral`` (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo / Small; tokenizer v3): ``[TOOL_CALLS]``
  then a JSON array of calls, ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``. (The v11
  tokenizer's ``[TOOL_CALLS]name[ARGS]{...}`` is not read yet.)

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

Without ``--tool-call-parser`` the api_server picks one (``default_tool_parser``) from how the chat
template writes tools: a template with a tool format of its own gets that format's parser; a built-in
template its ``tool_style``'s; a template that never mentions tools gets ``qwen`` (Hermes), since
``lmd.chat_template`` then writes the tools and calls Hermes-style itself.

This module holds the formats; what they return is in ``deltas.py``, the machine they all run in
``tool_call_stream.py`` (over ``json_scan.py``, which follows a call's JSON as it grows).
"""
from __future__ import annotations

from .deltas import (DeltaMessage, DeltaToolCall, ExtractedToolCalls, ToolCall, keep_markers, make_tool_call_id,
                     partial_suffix, whole_answer)
from . import harmony
from .json_scan import JsonObjectScan
from .registry import Registry
from .tool_call_stream import ToolCallStream

__all__ = ['DeltaMessage', 'DeltaToolCall', 'ExtractedToolCalls', 'JsonObjectScan', 'ToolCall', 'ToolParser',
           'ToolParserManager', 'default_tool_parser', 'make_tool_call_id', 'partial_suffix']


class ToolParser:
    """One model family's tool-call format. Create one per answer: the streaming state lives here."""
    name = ''
    start_marker = ''
    end_marker: str | None = None
    bare_json_start = False    # a '{' opening the answer is a call (llama3)
    separator: str | None = None
    array = False              # the calls are a JSON array's items after the start marker (mistral)

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._stream = ToolCallStream(self, eager=True)

    @property
    def markers(self) -> list[str]:
        return [m for m in (self.start_marker, self.end_marker) if m]

    def adjust_request(self, request):
        """Keep the markers in the output text: ``skip_special_tokens=False`` when one is a special token.

        ``request`` is anything with a ``skip_special_tokens`` attribute (or key); it is returned."""
        return keep_markers(self.tokenizer, request, self.markers)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole answer, and the content around them (None when there is none)."""
        stream = ToolCallStream(self, eager=False)
        stream.feed(text)
        stream.finish()
        return whole_answer(stream.take())

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


@ToolParserManager.register('mistral')
class MistralToolParser(ToolParser):
    name = 'mistral'
    start_marker = '[TOOL_CALLS]'
    end_marker = None
    separator = ','
    array = True


@ToolParserManager.register('gpt-oss')
class GptOssToolParser(ToolParser):
    """gpt-oss's harmony messages (harmony.py): a message with a recipient is a call."""
    name = 'gpt-oss'
    start_marker = harmony.START

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._calls = harmony.HarmonyCalls()

    @property
    def markers(self) -> list[str]:
        return list(harmony.MARKERS)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        return whole_answer(harmony.HarmonyCalls().feed(text, final=True))

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        return self._calls.feed(delta_text)

    def finish(self) -> DeltaMessage | None:
        return self._calls.feed('', final=True)

    def has_tool_calls(self) -> bool:
        return self._calls.num_calls > 0


# ---- the parser a server without --tool-call-parser uses --------------------------------------------------

# a built-in template's tool_style (lmd.chat_template.TOOL_STYLES) -> the parser reading what it asks for
_STYLE_PARSERS = {'hermes': 'qwen', 'llama3': 'llama3', 'internlm2': 'internlm'}
# what a Jinja template's own tool format says of itself, most specific first
_TEMPLATE_MARKERS = (
    ('gpt-oss', ('<|channel|>', 'to=functions')),
    ('mistral', ('[TOOL_CALLS]', '[AVAILABLE_TOOLS]')),
    ('internlm', ('<|action_start|>', '<|plugin|>')),
    ('qwen', ('<tool_call>',)),
    ('llama3', ('<|python_tag|>', 'Given the following functions')),
)
# a template with an unknown tool format: the family (HF architecture prefix) decides
_FAMILY_PARSERS = (('GptOss', 'gpt-oss'), ('Mistral', 'mistral'), ('Mixtral', 'mistral'), ('InternLM', 'internlm'),
                   ('Qwen', 'qwen'), ('Llama', 'llama3'))


def default_tool_parser(chat_template, architecture: str = '') -> tuple[str, str]:
    """(parser name, why) for a server started without ``--tool-call-parser``.

    ``chat_template``: the engine's ``lmd.chat_template.ChatTemplate``; ``architecture``: the HF
    architecture (``ModelInfo.architecture``). The template decides first, as it is what tells the
    model how to write a call; the family only when the template has a tool format lmd does not know,
    and Hermes (``qwen``) when nothing says more."""
    style = getattr(chat_template, 'tool_style', None)
    if style in _STYLE_PARSERS:
        return _STYLE_PARSERS[style], f'the built-in template writes tools in the {style} style'
    text = getattr(chat_template, 'template_str', None)
    if text is None or not getattr(chat_template, 'knows_tools', False):
        return 'qwen', 'the chat template has no tool format of its own: lmd writes tools Hermes-style'
    for name, markers in _TEMPLATE_MARKERS:
        found = next((m for m in markers if m in text), None)
        if found is not None:
            return name, f'the chat template writes tools with {found}'
    for prefix, name in _FAMILY_PARSERS:
        if architecture.startswith(prefix):
            return name, f'the model family ({architecture}); the template\'s tool format is not one lmd knows'
    return 'qwen', (f'neither the chat template\'s tool format nor the model family ({architecture or "unknown"}) '
                    'is one lmd knows: Hermes-style, the most common; set --tool-call-parser if calls come '
                    'back as content')
