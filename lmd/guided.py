"""Structured output (guided decoding): a ``response_format`` becomes a per-request
``TokenConstraint`` that both engines ask, each step, which tokens may come next.

    response_format                                          grammar
    {"type": "text"} (or None)                               none
    {"type": "json_object"}                                  any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
                                                             JSON valid against the schema
    {"type": "regex_schema", "regex_schema": "<regex>"}      text the regex fully matches (LMDeploy's form)

Grammars are compiled by xgrammar (on the CPU) once per distinct format and kept in an LRU
keyed by the format's canonical JSON; every request gets a fresh matcher over the compiled
grammar. JSON comes out compact (``{"a": 1, "b": [2]}``: one space after ``:`` and ``,``,
no other whitespace), so a small model cannot spend its tokens on blank lines.

The contract with an engine (``lmd.engine.EngineRequest.constraint``), on the engine thread:

    fill_bitmask(bitmask, row)   row ``row`` of an int32 [n, num_words] tensor or array (xgrammar's
                                 layout: bit ``t % 32`` of word ``t // 32`` set when token ``t`` may
                                 come next; ``num_words = ceil(vocab_size / 32)``)
    accept(token_id) -> bool     the token the engine chose; False: the grammar cannot take it
    stop_token_ids               the tokens that end the grammar: once the text is complete only
                                 they are allowed, and before it is complete none of them is

A grammar cannot end without one of its stop tokens, which are the engine's own (the model's
EOS and the chat template's single-token stop words such as ``<|im_end|>``).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any


RESPONSE_FORMAT_TYPES = ('text', 'json_object', 'json_schema', 'regex_schema')
# compiled grammars kept (least recently used dropped first)
DEFAULT_CACHE_SIZE = 64

# xgrammar prefixes its errors with a time and a C++ source line: "[11:19:40] /project/cpp/x.cc:94: "
_XGR_PREFIX = re.compile(r'^\s*(\[[\d:]+\]\s*)?\S+\.(cc|h):\d+:\s*(Check failed: .*? is false:\s*)?')


def _xgrammar():
    """xgrammar, imported on first use (it takes seconds)."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError('response_format (structured output) needs the xgrammar package: '
                         'pip install xgrammar') from None
    return xgrammar


def _xgr_message(e: Exception) -> str:
    return _XGR_PREFIX.sub('', str(e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class ResponseFormatError(ValueError):
    """A response format that cannot be used; ``param`` is the field at fault
    (``response_format.json_schema.schema.properties.a.minimum``), which the api_server puts in its 400."""

    def __init__(self, param: str, why: str):
        super().__init__(f'{param}: {why}')
        self.param = param


def _fail(field: str, why: str) -> None:
    raise ResponseFormatError(field, why)


def normalize_response_format(response_format: Any) -> tuple[str, Any] | None:
    """(kind, payload) of a valid format, or None when it asks for plain text; ValueError naming
    the field otherwise. kind: 'json_object' (payload None), 'json_schema' (a dict), 'regex_schema'
    (a str)."""
    if response_format is None:
        return None
    if hasattr(response_format, 'model_dump'):  # a pydantic model from the server's protocol
        response_format = response_format.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(response_format, dict):
        _fail('response_format', f'expected a dict like {{"type": "json_object"}}, got {response_format!r}')
    kind = response_format.get('type')
    if kind not in RESPONSE_FORMAT_TYPES:
        _fail('response_format.type', f'{kind!r} is not supported; allowed values are '
              + ', '.join(repr(t) for t in RESPONSE_FORMAT_TYPES))
    if kind == 'text':
        return None
    if kind == 'json_object':
        return kind, None
    if kind == 'regex_schema':
        regex = response_format.get('regex_schema')
        if not isinstance(regex, str) or not regex:
            _fail('response_format.regex_schema', f'expected a non-empty regex string, got {regex!r}')
        return kind, regex
    spec = response_format.get('json_schema')
    if not isinstance(spec, dict):
        _fail('response_format.json_schema', 'expected an object like {"name": ..., "schema": {...}}, '
              f'got {spec!r}')
    if spec.get('name') is not None and not isinstance(spec['name'], str):
        _fail('response_format.json_schema.name', f'expected a string, got {spec["name"]!r}')
    if spec.get('strict') is not None and not isinstance(spec['strict'], bool):
        _fail('response_format.json_schema.strict', f'expected true or false, got {spec["strict"]!r}')
    schema = spec.get('schema')
    if schema is None:
        _fail('response_format.json_schema.schema', 'is missing; give the JSON schema the output must follow')
    if isinstance(schema, str):  # a schema sent as JSON text
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            _fail('response_format.json_schema.schema', f'is not valid JSON: {e}')
    if not isinstance(schema, dict):
        _fail('response_format.json_schema.schema', f'expected a JSON schema object, got {schema!r}')
    return kind, schema


class TokenConstraint:
    """One request's grammar state: a fresh xgrammar matcher. Used by one engine thread only.

    ``accept`` advances it; the engine keeps it in the request's sampling state, so a request
    preempted and recomputed goes on where it was (its generated tokens are never re-accepted).
    """
    __slots__ = ('_matcher', 'vocab_size', 'num_words', 'stop_token_ids', 'format_kind')

    def __init__(self, compiled, vocab_size: int, stop_token_ids: tuple[int, ...], format_kind: str):
        self._matcher = _xgrammar().GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.stop_token_ids = frozenset(stop_token_ids)
        self.format_kind = format_kind

    def fill_bitmask(self, bitmask, row: int = 0) -> None:
        """Row ``row`` of ``bitmask`` (int32 [n, num_words], a CPU torch tensor or a numpy array)."""
        if self._matcher.is_terminated():  # only an engine that went on past a stop token gets here
            bitmask[row] = 0
            for t in self.stop_token_ids:
                bit = 1 << (t % 32)
                bitmask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # as int32
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the chosen token; False (state unchanged) if the grammar cannot take it."""
        if self._matcher.is_terminated():
            return False
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """Whether a stop token ended the grammar."""
        return self._matcher.is_terminated()

    def __repr__(self):
        return f'TokenConstraint({self.format_kind}, terminated={self.is_terminated()})'


class GuidedDecoding:
    """Compiles response formats for one model and tokenizer; thread-safe.

    ``vocab_size``: the model's (its logits' width), which may exceed the tokenizer's; ids the
    tokenizer lacks are never allowed. ``stop_token_ids``: the engine's stop tokens (EOS and the
    template's stop words), the only tokens allowed once the output is complete.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_size: int = DEFAULT_CACHE_SIZE):
        if not stop_token_ids:
            raise ValueError('GuidedDecoding needs the engine\'s stop token ids (EOS); got none')
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(self.stop_token_ids))
        # xgrammar's own cache is off: ours is keyed by the whole format and bounded in entries
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()  # canonical JSON -> xgrammar CompiledGrammar
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses), all time

    def matcher(self, response_format) -> TokenConstraint | None:
        """A fresh constraint for one request; None for plain text. ValueError names a bad field."""
        fmt = normalize_response_format(response_format)
        if fmt is None:
            return None
        kind, payload = fmt
        return TokenConstraint(self.compiled(kind, payload), self.vocab_size, self.stop_token_ids, kind)

    def compiled(self, kind: str, payload):
        """The xgrammar CompiledGrammar of a normalized format, from the cache when it is there."""
        key = json.dumps([kind, payload], sort_keys=True, separators=(',', ':'), ensure_ascii=False)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(kind, payload)  # outside the lock: a slow schema does not stall the rest
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, kind: str, payload):
        c = self._compiler
        if kind == 'json_object':
            return c.compile_json_schema({'type': 'object'}, any_whitespace=False)
        if kind == 'regex_schema':
            try:
                return c.compile_regex(payload)
            except RuntimeError as e:
                _fail('response_format.regex_schema', f'is not a valid regex: {_xgr_message(e)}')
        _check_json_schema(payload)
        try:
            return c.compile_json_schema(payload, any_whitespace=False)
        except RuntimeError as e:
            _fail('response_format.json_schema.schema', f'is not a valid JSON schema: {_xgr_message(e)}')


def _check_json_schema(schema: dict) -> None:
    """The JSON Schema meta-schema's verdict, when the ``jsonschema`` package is installed
    (xgrammar itself catches only what it cannot translate)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = ''.join(f'[{p!r}]' if isinstance(p, int) else f'.{p}' for p in e.absolute_path)
        _fail(f'response_format.json_schema.schema{where}', f'is not a valid JSON schema: {e.message}')


def constraint_for(engine, response_format) -> TokenConstraint | None:
    """The constraint for one request of an ``AsyncEngine`` (its ``GuidedDecoding`` made on first use)."""
    if response_format is None:
        return None
    guided = getattr(engine, '_guided_decoding', None)
    if guided is None:
        with _init_lock:
            guided = getattr(engine, '_guided_decoding', None)
            if guided is None:
                guided = GuidedDecoding(engine.tokenizer.hf_tokenizer, engine.model_info.vocab_size,
                                        engine.eos_token_ids)
                engine._guided_decoding = guided
    return guided.matcher(response_format)


_init_lock = threading.Lock()
