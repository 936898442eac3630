"""Tokenizer wrapper, incremental detokenizer and stop-string matcher.

Everything that turns token ids into text lives here, once, above both engines.

Incremental detokenization keeps two offsets into the ids a stream has produced
(vLLM's scheme): ``ids[prefix_offset:read_offset]`` is a little already-emitted
context and ``ids[read_offset:]`` is not emitted yet. Each call decodes the
window ``ids[prefix_offset:]`` and the context alone and emits the difference.
The context is what makes a window decode like the whole sequence: SentencePiece
decoders strip the leading space of a sequence's first token, and byte-level
tokens need their neighbours to form a character. A window whose text ends in
U+FFFD holds an incomplete UTF-8 character, so nothing is emitted until a later
token completes it. Each call decodes a few tokens, never the whole sequence.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

from .errors import ModelFormatError

_REPLACEMENT_CHAR = '\ufffd'
# Tokens of prompt context a DetokenizeState.for_prompt keeps before the first generated token.
_PROMPT_CONTEXT_TOKENS = 5


@dataclass
class DetokenizeState:
    """Where one stream's incremental detokenization stands; updated in place and returned.

    ``ids`` are the ids the window draws from: the stream's ids (minus skipped
    special tokens) after any prompt context. ``num_consumed`` counts the entries
    of the caller's ``all_ids`` already taken in, skipped ones included.
    """
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    num_consumed: int = 0

    @classmethod
    def for_prompt(cls, tokenizer: 'Tokenizer', prompt_ids: Sequence[int],
                   skip_special_tokens: bool = True) -> 'DetokenizeState':
        """A state whose context is the end of ``prompt_ids``: the generated ids then decode
        as they read after the prompt (a first token ``'▁Hello'`` gives ``' Hello'``).

        ``all_ids`` passed to ``detokenize_incrementally`` afterwards are the generated ids only.
        """
        ids = [i for i in prompt_ids if not (skip_special_tokens and i in tokenizer._skip_ids)]
        start = max(0, len(ids) - _PROMPT_CONTEXT_TOKENS)
        # Start the context on a character boundary: step back over tokens that are only
        # the tail bytes of a character (at most 3 for UTF-8).
        for _ in range(3):
            if start == 0 or not tokenizer._decode_window(ids[start:]).startswith(_REPLACEMENT_CHAR):
                break
            start -= 1
        context = ids[start:]
        return cls(ids=context, prefix_offset=0, read_offset=len(context), num_consumed=0)


class Tokenizer:
    """A model's tokenizer: ``transformers.AutoTokenizer`` (fast) plus what lmd needs on top."""

    def __init__(self, model_dir: str, trust_remote_code: bool = False):
        from transformers import AutoTokenizer
        self.model_dir = model_dir
        try:
            self._hf = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ModelFormatError(f'cannot load a tokenizer from {model_dir!r}: {e}') from e
        if not getattr(self._hf, 'is_fast', False) or getattr(self._hf, 'backend_tokenizer', None) is None:
            raise ModelFormatError(f'{model_dir!r}: lmd needs a fast tokenizer (tokenizer.json), '
                                   f'got {type(self._hf).__name__}')
        self._backend = self._hf.backend_tokenizer
        added = self._backend.get_added_tokens_decoder()
        # The backend's decode(skip_special_tokens=True) drops added tokens marked special;
        # HF's all_special_ids can name fewer. Skip the union so both paths agree.
        self._skip_ids = frozenset(i for i, tok in added.items() if tok.special) | frozenset(self._hf.all_special_ids)
        self._eos_token_ids = self._read_eos_ids(model_dir)
        self._ids_by_text: dict[str, list[int]] | None = None
        self._add_bos: bool | None = None

    def _read_eos_ids(self, model_dir: str) -> tuple[int, ...]:
        ids = []
        if self._hf.eos_token_id is not None:
            ids.append(self._hf.eos_token_id)
        path = os.path.join(model_dir, 'generation_config.json')
        if os.path.isfile(path):
            try:
                with open(path, encoding='utf-8') as f:
                    gen_eos = json.load(f).get('eos_token_id')
            except (OSError, ValueError) as e:
                raise ModelFormatError(f'{path}: cannot read it as JSON: {e}') from e
            if isinstance(gen_eos, int):
                gen_eos = [gen_eos]
            ids.extend(i for i in gen_eos or [] if isinstance(i, int))
        return tuple(dict.fromkeys(ids))

    # -- what the model's tokenizer says ---------------------------------------------------------

    @property
    def hf_tokenizer(self):
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        return len(self._hf)

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def bos_token(self) -> str | None:
        return self._hf.bos_token

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def eos_token(self) -> str | None:
        return self._hf.eos_token

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's eos and generation_config.json's eos ids, in that order, deduplicated."""
        return self._eos_token_ids

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(text)`` puts BOS first (the tokenizer's post-processor decides)."""
        if self._add_bos is None:
            bos_id = self._hf.bos_token_id
            self._add_bos = bos_id is not None and self._hf.encode('a')[:1] == [bos_id]
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._hf, 'chat_template', None)
        if isinstance(template, dict):  # named templates: the default one is what chat uses
            template = template.get('default')
        return template or None

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._hf.all_special_ids)

    # -- text <-> ids ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is added only where the tokenizer is configured to add it.

        A text that already starts with the BOS token (a rendered chat template) does not
        get a second one.
        """
        # verbose=False: no warning past model_max_length; the engines check prompt lengths themselves
        ids = self._hf.encode(text, add_special_tokens=add_special_tokens, verbose=False)
        bos, bos_id = self._hf.bos_token, self._hf.bos_token_id
        if (add_special_tokens and bos and bos_id is not None and len(ids) >= 2 and ids[0] == ids[1] == bos_id
                and text.startswith(bos)):
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``: the backend tokenizer's decode, without WordPiece-style space cleanup
        (which cannot be done incrementally)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_prefix(self, ids: Sequence[int], skip_special_tokens: bool = True, final: bool = False) -> str:
        """The text a stream whose generated ids so far are ``ids`` has shown: ``decode`` with a
        trailing incomplete UTF-8 character held back unless ``final``.

        A function of ``ids`` alone, so a stateless process (Triton's ``postprocessing``) can turn
        each response into a text increment: ``decode_prefix(ids)[len(decode_prefix(prev_ids)):]``.
        The increments join to what ``detokenize_incrementally`` gives for the same stream.
        """
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skip_ids]
        text = self._decode_window(ids)
        return text if final else text.rstrip(_REPLACEMENT_CHAR)

    def _decode_window(self, ids: Sequence[int]) -> str:
        # ids here were already filtered of skipped tokens
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def token_ids_of_words(self, words: Sequence[str]) -> list[int]:
        """Ids whose single-token text is exactly one of ``words`` (for ``bad_words`` and
        single-token stop words). A word no single token spells contributes nothing."""
        if self._ids_by_text is None:
            texts = self._backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
            by_text: dict[str, list[int]] = {}
            for i, text in enumerate(texts):
                by_text.setdefault(text, []).append(i)
            self._ids_by_text = by_text
        out: list[int] = []
        for word in words:
            for i in self._ids_by_text.get(word, ()):
                if i not in out:
                    out.append(i)
        return out

    # -- incremental detokenization ------------------------------------------------------------

    def detokenize_incrementally(self, all_ids: Sequence[int], state: DetokenizeState,
                                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                                 final: bool = False) -> tuple[str, DetokenizeState]:
        """The text ``all_ids`` adds since the last call with this ``state``.

        ``all_ids`` is every id the stream has produced so far (a growing list); a call
        reads only the ids it has not seen. Text ending in an incomplete UTF-8 character
        is held back until a later token completes it; ``final=True`` (the stream has
        ended) flushes whatever is held. The increments of a stream concatenate to
        ``decode(all_ids, skip_special_tokens)``.

        ``spaces_between_special_tokens`` only matters to slow (Python) tokenizers; a
        fast tokenizer's decode joins special tokens without spaces, and so does this.
        """
        del spaces_between_special_tokens
        if len(all_ids) < state.num_consumed:
            raise ValueError(f'all_ids has {len(all_ids)} ids but this state already consumed '
                             f'{state.num_consumed}: pass the same growing list each call')
        new_ids = all_ids[state.num_consumed:]
        state.num_consumed = len(all_ids)
        if skip_special_tokens:
            new_ids = [i for i in new_ids if i not in self._skip_ids]
        state.ids.extend(new_ids)
        if state.read_offset >= len(state.ids):
            return '', state
        prefix_text = self._decode_window(state.ids[state.prefix_offset:state.read_offset])
        full_text = self._decode_window(state.ids[state.prefix_offset:])
        if not final and (full_text.endswith(_REPLACEMENT_CHAR) or not full_text.startswith(prefix_text)):
            return '', state
        state.prefix_offset = state.read_offset
        state.read_offset = len(state.ids)
        return full_text[len(prefix_text):], state

    def __repr__(self):
        return f'Tokenizer({self.model_dir!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})'


class StopStringMatcher:
    """Finds stop strings in streamed text, across token boundaries.

    ``feed(text)`` returns the text safe to emit and whether a stop string was
    hit. A tail that could still grow into a stop string is held back; ``flush()``
    returns it when the stream ends without one. On a hit the output is cut
    before the stop string (or after it with ``include_stop_str_in_output``), and
    every later ``feed`` returns ``('', True)``.
    """

    def __init__(self, stop_words: Sequence[str] | None, include_stop_str_in_output: bool = False, *,
                 include_stop_str: bool | None = None):
        self.stop_words = [w for w in (stop_words or []) if w]
        # include_stop_str: the short name GenerationConfig's field is also known by
        self.include_stop_str_in_output = include_stop_str if include_stop_str is not None \
            else include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream
        self._held = ''
        self._max_hold = max((len(w) for w in self.stop_words), default=1) - 1

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return '', True
        if not self.stop_words:
            return text, False
        buf = self._held + text
        hit_at, hit_word = -1, None
        for word in self.stop_words:
            i = buf.find(word)
            if i != -1 and (hit_at == -1 or i < hit_at):
                hit_at, hit_word = i, word
        if hit_word is not None:
            self.stopped, self.matched, self._held = True, hit_word, ''
            end = hit_at + len(hit_word) if self.include_stop_str_in_output else hit_at
            return buf[:end], True
        hold = self._partial_match_len(buf)
        self._held = buf[len(buf) - hold:] if hold else ''
        return buf[:len(buf) - hold], False

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(w.startswith(tail) for w in self.stop_words):
                return n
        return 0

    def flush(self) -> str:
        """The held-back tail, once the stream has ended without a stop string."""
        held, self._held = self._held, ''
        return '' if self.stopped else held
