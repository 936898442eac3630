"""Reasoning parsers: split a thinking model's answer into ``reasoning_content`` and ``content``.

``--reasoning-parser`` names:

- ``deepseek-r1``: the answer starts in reasoning (DeepSeek-R1 may or may not write the opening
  ``<think>``); everything before ``</think>`` is reasoning, the rest content. No ``</think>`` at all:
  all of it is reasoning (the answer was cut while thinking).
- ``qwen-qwq`` (alias ``qwen3``): reasoning is the ``<think>...</think>`` that opens the answer. When the
  prompt itself ends inside an open ``<think>`` (QwQ's and Qwen3-Thinking's templates end the generation
  prompt with ``<think>\\n``), the answer starts in reasoning, as with deepseek-r1: pass that prompt as
  ``prompt=``. Without it (Qwen3 with ``enable_thinking=False`` writes no tags) the answer is content.
- ``gpt-oss``: harmony messages (``harmony.py``): the ``analysis`` channel is reasoning, ``final`` and
  preambles content; a tool call stays in the content, as a call message, for the ``gpt-oss`` tool parser.

Reasoning and content lose their leading whitespace, reasoning its trailing whitespace; content
after the reasoning is otherwise kept as written, and an answer with no reasoning is untouched.
Markers after the reasoning ended stay in the content. Empty parts are None.

``extract_reasoning(text) -> (reasoning_content, content)`` (alias ``extract``) for a whole answer;
a stream calls ``feed(delta_text) -> (reasoning, content)`` per piece and ``finish() -> (reasoning,
content)`` at the end (pieces are '' when there is nothing to send). Both run the same state machine,
so a stream, in any chunking, adds up to the whole parse; a marker cut across deltas is held back
until it is whole. One parser per answer.
"""
from __future__ import annotations

from . import harmony
from .deltas import keep_markers, partial_suffix
from .registry import Registry

THINK_START, THINK_END = '<think>', '</think>'


class _ThinkStream:
    """``start`` (does '<think>' open the answer?) -> ``reasoning`` -> ``content``; or straight to ``content``."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning   # the answer starts inside <think> even without the tag
        self.mode = 'start'
        self.buf = ''
        self.reasoned = False   # reasoning happened: the content after it loses its leading whitespace
        self.held_ws = ''       # reasoning whitespace, dropped if '</think>' follows
        self.said_reasoning = self.said_content = False
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def feed(self, text: str, final: bool = False) -> None:
        self.buf += text
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self.mode == 'start':
            stripped = self.buf.lstrip()
            if stripped.startswith(THINK_START):
                self.buf = stripped[len(THINK_START):]
                self.mode = 'reasoning'
                return True
            if not final and THINK_START.startswith(stripped):
                return False   # whitespace or a cut '<think>' so far
            self.mode = 'reasoning' if self.in_reasoning else 'content'
            return True
        if self.mode == 'reasoning':
            i = self.buf.find(THINK_END)
            if i >= 0:
                self._reason(self.buf[:i])
                self.held_ws = ''
                self.buf = self.buf[i + len(THINK_END):]
                self.mode = 'content'
                self.reasoned = True
                return True
            keep = 0 if final else partial_suffix(self.buf, THINK_END)
            self._reason(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        # content
        text = self.buf
        if self.reasoned and not self.said_content:
            text = text.lstrip()
        if text:
            self._content.append(text)
            self.said_content = True
        self.buf = ''
        return False

    def _reason(self, text: str) -> None:
        if not self.said_reasoning:   # nothing said yet: leading whitespace goes
            text = text.lstrip()
        kept = text.rstrip()
        if kept:
            self._reasoning.append(self.held_ws + kept)
            self.held_ws = ''
            self.said_reasoning = True
        self.held_ws += text[len(kept):]

    def take(self) -> tuple[str, str]:
        reasoning, content = ''.join(self._reasoning), ''.join(self._content)
        self._reasoning, self._content = [], []
        return reasoning, content


class ReasoningParser:
    """Splits ``<think>`` reasoning from the content. ``in_reasoning``: an answer starts inside it."""
    name = ''
    in_reasoning = False

    def __init__(self, tokenizer=None, prompt: str | None = None):
        self.tokenizer = tokenizer
        start_open = self.in_reasoning or (prompt is not None and prompt_opens_think(prompt))
        self._start_open = start_open
        self._stream = _ThinkStream(start_open)

    def adjust_request(self, request):
        """Keep the markers in the output text: ``skip_special_tokens=False`` when one is a special token."""
        return keep_markers(self.tokenizer, request, (THINK_START, THINK_END))

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole answer; None for an empty part."""
        stream = _ThinkStream(self._start_open)
        stream.feed(text, final=True)
        reasoning, content = stream.take()
        return reasoning or None, content or None

    extract = extract_reasoning

    def feed(self, delta_text: str) -> tuple[str, str]:
        """Feed the next piece of the answer; the (reasoning, content) pieces to send now."""
        self._stream.feed(delta_text)
        return self._stream.take()

    def finish(self) -> tuple[str, str]:
        """The answer ended: the (reasoning, content) held back (a cut marker)."""
        self._stream.feed('', final=True)
        return self._stream.take()


def prompt_opens_think(prompt: str) -> bool:
    """Does the prompt end inside an open ``<think>`` (the template started the reasoning)?"""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.find(THINK_END, start) < 0


ReasoningParserManager = Registry('reasoning parser')


@ReasoningParserManager.register('deepseek-r1')
class DeepSeekR1ReasoningParser(ReasoningParser):
    name = 'deepseek-r1'
    in_reasoning = True


@ReasoningParserManager.register('qwen-qwq', 'qwen3')
class QwenQwQReasoningParser(ReasoningParser):
    name = 'qwen-qwq'
    in_reasoning = False


@ReasoningParserManager.register('gpt-oss')
class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages (harmony.py): the ``analysis`` channel is reasoning, the rest content
    (a call kept as a call message for the tool parser)."""
    name = 'gpt-oss'

    def __init__(self, tokenizer=None, prompt: str | None = None):
        self.tokenizer = tokenizer
        self._splitter = harmony.HarmonySplitter()

    def adjust_request(self, request):
        return keep_markers(self.tokenizer, request, harmony.MARKERS)

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = harmony.reasoning_and_content(harmony.HarmonySplitter().feed(text, final=True))
        return reasoning or None, content or None

    extract = extract_reasoning

    def feed(self, delta_text: str) -> tuple[str, str]:
        return harmony.reasoning_and_content(self._splitter.feed(delta_text))

    def finish(self) -> tuple[str, str]:
        return harmony.reasoning_and_content(self._splitter.feed('', final=True))
