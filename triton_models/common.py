"""What lmd's Triton models share, free of Triton itself (so it is testable without a server).

- reading the request's tensors into Python values, with errors that name the input;
- the sampling inputs -> ``GenerationConfig``;
- the prompt -> token ids, for a new conversation or for the next turn of a kept session;
- the stateless text increment ``postprocessing`` computes from the ids generated so far.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from lmd.chat_template import ChatTemplate, get_chat_template, to_messages
from lmd.messages import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig
from lmd.tokenizer import StopStringMatcher, Tokenizer

# Session ids a client may use; AsyncEngine numbers its own requests above them.
MAX_SESSION_ID = (1 << 32) - 1


class InputError(ValueError):
    """A request input is missing, has the wrong shape, or holds a value out of range."""


# ---- model parameters (config.pbtxt) ---------------------------------------------------------

def parameters(model_config: dict) -> dict[str, str]:
    """``parameters { key: ... value: { string_value: ... } }`` of a model's config as a plain dict."""
    return {k: v.get('string_value', '') for k, v in model_config.get('parameters', {}).items()}


@dataclass(frozen=True)
class EngineSettings:
    """What an engine-hosting model's config.pbtxt parameters say: the model and how to run it."""
    model_path: str
    backend: str
    engine_config: dict
    chat_template: str | None = None

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> 'EngineSettings':
        model_path = params.get('model_path', '')
        if not model_path:
            raise ValueError("config.pbtxt has no 'model_path' parameter")
        backend = params.get('backend') or 'turbomind'
        if backend not in ('turbomind', 'pytorch'):
            raise ValueError(f"config.pbtxt parameter backend={backend!r} is invalid: "
                             "allowed values are 'turbomind', 'pytorch'")
        try:
            engine_config = json.loads(params.get('engine_config') or '{}')
        except json.JSONDecodeError as e:
            raise ValueError(f"config.pbtxt parameter engine_config is not JSON: {e}") from None
        return cls(model_path, backend, engine_config, params.get('chat_template') or None)

    def backend_config(self) -> TurbomindEngineConfig | PytorchEngineConfig:
        cls = TurbomindEngineConfig if self.backend == 'turbomind' else PytorchEngineConfig
        return cls(**self.engine_config)

    def chat_template_config(self) -> ChatTemplateConfig | None:
        return ChatTemplateConfig(model_name=self.chat_template) if self.chat_template else None


def load_text_side(params: dict[str, str]) -> tuple[Tokenizer, ChatTemplate]:
    """The tokenizer and chat template of the model a pre/postprocessing model's config points at."""
    from lmd.model_path import prepare_model_dir
    model_path = params.get('model_path', '')
    if not model_path:
        raise ValueError("config.pbtxt has no 'model_path' parameter")
    tokenizer = Tokenizer(prepare_model_dir(model_path))
    name = params.get('chat_template') or None
    template = get_chat_template(tokenizer, ChatTemplateConfig(model_name=name) if name else None)
    return tokenizer, template


# ---- request inputs ----------------------------------------------------------------------------

# name -> (kind, what it is); kind: 'text', 'texts', 'int', 'uint', 'float', 'bool', 'ids'
SAMPLING_INPUTS = {
    'max_tokens': 'int', 'temperature': 'float', 'top_p': 'float', 'top_k': 'int',
    'repetition_penalty': 'float', 'random_seed': 'uint', 'ignore_eos': 'bool', 'stop_words': 'texts',
}
SESSION_INPUTS = {'session_id': 'uint', 'sequence_start': 'bool', 'sequence_end': 'bool'}

_NUMPY_KINDS = {'int': 'iu', 'uint': 'u', 'float': 'f', 'bool': 'b', 'ids': 'iu', 'text': 'OSU', 'texts': 'OSU'}


def _as_text(name: str, v: Any) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode('utf-8')
        except UnicodeDecodeError:
            raise InputError(f"input '{name}' is not valid UTF-8") from None
    return str(v)


def read_inputs(get: Callable[[str], np.ndarray | None], spec: dict[str, str],
                required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The inputs of ``spec`` the request carries, as Python values; absent ones are left out.

    ``get(name)`` returns the input's array or None. Triton has already checked each tensor's
    datatype against config.pbtxt; this checks shapes and turns them into values. ``required``
    inputs are checked here: Triton lets a request without them through to a Python model, and an
    ensemble without its first step's input answers with nothing at all, so configs declare
    ``prompt`` optional and the model names it when it is missing.
    """
    out: dict[str, Any] = {}
    for name, kind in spec.items():
        arr = get(name)
        if arr is None:
            if name in required:
                raise InputError(f"input '{name}' is required")
            continue
        arr = np.asarray(arr)
        if arr.dtype.kind not in _NUMPY_KINDS[kind]:
            raise InputError(f"input '{name}' has datatype {arr.dtype}, expected {kind}")
        flat = arr.reshape(-1)
        if kind == 'texts':
            out[name] = [_as_text(name, v) for v in flat]
        elif kind == 'ids':
            out[name] = [int(v) for v in flat]
        else:
            if flat.size != 1:
                raise InputError(f"input '{name}' must hold one value, got shape {list(arr.shape)}")
            v = flat[0]
            out[name] = (_as_text(name, v) if kind == 'text' else bool(v) if kind == 'bool'
                         else float(v) if kind == 'float' else int(v))
    return out


def generation_config(values: dict[str, Any]) -> GenerationConfig:
    """The sampling inputs as a GenerationConfig. Greedy unless temperature, top_p or top_k asks to
    sample; temperature 0 or top_k 1 is greedy."""
    fields: dict[str, Any] = {}
    if 'max_tokens' in values:
        if values['max_tokens'] < 1:
            raise InputError(f"input 'max_tokens' is {values['max_tokens']}: expected 1 or more")
        fields['max_new_tokens'] = values['max_tokens']
    for name in ('temperature', 'top_p', 'top_k', 'repetition_penalty', 'random_seed', 'ignore_eos'):
        if name in values:
            fields[name] = values[name]
    if values.get('stop_words'):
        fields['stop_words'] = [w for w in values['stop_words'] if w]
    sampling = any(k in values for k in ('temperature', 'top_p', 'top_k'))
    greedy = values.get('temperature') == 0 or values.get('top_k') == 1
    fields['do_sample'] = sampling and not greedy
    if values.get('temperature') == 0:
        del fields['temperature']
    try:
        return GenerationConfig(**fields)
    except ValueError as e:
        raise InputError(_input_names(str(e))) from None


def _input_names(message: str) -> str:
    """GenerationConfig's messages name its fields; the client knows the inputs' names."""
    return (message.replace('GenerationConfig.max_new_tokens', "input 'max_tokens'")
            .replace('max_new_tokens', 'max_tokens').replace('GenerationConfig.', 'input '))


def session_of(values: dict[str, Any]) -> tuple[int | None, bool, bool]:
    """(session_id, sequence_start, sequence_end); a request without them is a standalone one."""
    sid = values.get('session_id')
    start = values.get('sequence_start', True)
    end = values.get('sequence_end', True)
    if sid is not None and not 1 <= sid <= MAX_SESSION_ID:
        raise InputError(f"input 'session_id' is {sid}: expected 1..{MAX_SESSION_ID}")
    if sid is None and not (start and end):
        raise InputError("input 'session_id' is required when sequence_start or sequence_end is false "
                         '(a session that keeps its KV cache between requests needs an id)')
    return sid, start, end


# ---- prompts -------------------------------------------------------------------------------------

def parse_prompt(text: str) -> str | list[dict]:
    """A JSON list of OpenAI-style messages, or else a user message."""
    if text.lstrip().startswith('['):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text
        if isinstance(value, list) and value and all(isinstance(m, dict) and 'role' in m for m in value):
            return value
    return text


# Stand-ins for a past exchange, to see what a template writes between turns.
_PAST_USER, _PAST_ANSWER = '\x00user\x00', '\x00answer\x00'


def continuation_text(template: ChatTemplate, messages: list[dict]) -> str:
    """The text that continues a kept session with ``messages``: what the template writes after an
    assistant answer up to the next generation prompt. It starts with the answer's end (``<|im_end|>``),
    which the engine already holds when the answer stopped on it; the engine model drops it then.
    """
    past = [{'role': 'user', 'content': _PAST_USER}, {'role': 'assistant', 'content': _PAST_ANSWER}]
    full = template.render(past + messages, add_generation_prompt=True)
    at = full.find(_PAST_ANSWER)
    if at < 0:
        raise ValueError('the chat template does not write past answers; it cannot continue a session')
    return full[at + len(_PAST_ANSWER):]


def prompt_ids(tokenizer: Tokenizer, template: ChatTemplate, prompt: str, sequence_start: bool = True) -> list[int]:
    """Token ids for ``prompt`` (see ``parse_prompt``): the whole chat template for a new conversation,
    the text between turns for the next turn of a kept session."""
    if not sequence_start and not prompt:
        return []  # ends a session without a turn (see the engine models)
    messages = to_messages(parse_prompt(prompt))
    if sequence_start:
        return tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
    return tokenizer.encode(continuation_text(template, messages), add_special_tokens=False)


# ---- stateless detokenization -----------------------------------------------------------------------

def shown_text(tokenizer: Tokenizer, ids: Sequence[int], final: bool, stop_words: Sequence[str] = ()) -> str:
    """What a stream that generated ``ids`` has shown: cut before the first stop word; unless ``final``,
    without a trailing incomplete character or a tail that may still grow into a stop word."""
    text = tokenizer.decode_prefix(ids, final=final)
    stops = StopStringMatcher(stop_words)
    shown, hit = stops.feed(text)
    return shown + stops.flush() if final and not hit else shown


def text_increment(tokenizer: Tokenizer, ids: Sequence[int], prev_length: int, final: bool,
                   stop_words: Sequence[str] = ()) -> str:
    """The text response ``ids[prev_length:]`` adds to what the earlier responses showed."""
    if not 0 <= prev_length <= len(ids):
        raise InputError(f"input 'prev_length' is {prev_length}, outside 0..{len(ids)} (the length of output_ids)")
    before = shown_text(tokenizer, ids[:prev_length], False, stop_words) if prev_length else ''
    now = shown_text(tokenizer, ids, final, stop_words)
    if not now.startswith(before):  # a tokenizer whose decode is not prefix-stable: show the change
        i = os.path.commonprefix([before, now])
        return now[len(i):]
    return now[len(before):]
