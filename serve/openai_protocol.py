"""The request bodies the api_server accepts, as pydantic models (OpenAI's field names and ranges).

Every field is checked here, so a wrong type or an out-of-range value is a 400 that
names the field before anything reaches an engine. Fields OpenAI's clients and
gateways send that change nothing here (``user``, ``store``, ``metadata``...) are
accepted; any other unknown field is an error, as in OpenAI's own API, rather than
silently dropped. Responses are built as plain dicts in ``api_server`` (streaming
builds one per token; pydantic would only add cost there).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_U64 = 2**64


class _Strict(BaseModel):
    model_config = ConfigDict(extra='forbid')


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal['function'] = 'function'
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class ToolChoiceFunction(_Strict):
    type: Literal['function'] = 'function'
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = 'response'
    description: str | None = None
    schema_: dict[str, Any] = Field(alias='schema')
    strict: bool | None = None
    model_config = ConfigDict(extra='forbid', populate_by_name=True)


class ResponseFormat(_Strict):
    """``text``, ``json_object``, ``json_schema`` (OpenAI) or ``regex_schema`` (LMDeploy's spelling)."""
    type: Literal['text', 'json_object', 'json_schema', 'regex_schema']
    json_schema: JsonSchemaFormat | None = None
    regex_schema: str | None = None

    @model_validator(mode='after')
    def _needs_its_field(self):
        if self.type == 'json_schema' and self.json_schema is None:
            raise ValueError("type 'json_schema' needs the field json_schema: {name, schema}")
        if self.type == 'regex_schema' and not self.regex_schema:
            raise ValueError("type 'regex_schema' needs the field regex_schema: a regular expression")
        return self

    def to_generation_format(self) -> dict | None:
        """The dict ``GenerationConfig.response_format`` takes; None for plain text."""
        if self.type == 'text':
            return None
        if self.type == 'json_object':
            return {'type': 'json_object'}
        if self.type == 'json_schema':
            return {'type': 'json_schema', 'json_schema': {'name': self.json_schema.name,
                                                           'schema': self.json_schema.schema_}}
        return {'type': 'regex_schema', 'regex_schema': self.regex_schema}


class _Sampling(_Strict):
    """What chat and completions share: OpenAI's sampling fields plus vLLM/LMDeploy's extras."""
    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # beyond OpenAI (vLLM / LMDeploy names), sent by clients as extra_body
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    session_id: int | None = Field(None, ge=0)
    # vLLM's: each prompt token's logprob and its k best alternatives, beside the answer (not streamed)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator('stop')
    @classmethod
    def _stop_strings(cls, v):
        if v is None:
            return None
        v = [v] if isinstance(v, str) else v
        if any(not s for s in v):
            raise ValueError('stop strings must be non-empty')
        return v or None

    @field_validator('stop_token_ids')
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError('token ids are non-negative')
        return v

    @field_validator('seed')
    @classmethod
    def _seed(cls, v):
        if v is not None and not -_U64 // 2 <= v < _U64:
            raise ValueError('seed must fit in 64 bits')
        return v

    @field_validator('prompt_logprobs')
    @classmethod
    def _prompt_logprobs_whole(cls, v, info):
        if v is not None and info.data.get('stream'):
            raise ValueError('prompt_logprobs are not available when stream is true (as vLLM answers)')
        return v

    @field_validator('logit_bias')
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError('logit_bias is not supported by lmd; use stop_token_ids / bad words instead')
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal['none', 'auto', 'required'] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    # accepted and without effect here
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    # LMDeploy / vLLM extras
    do_preprocess: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    regex: str | None = None  # shorthand for response_format regex_schema
    guided_json: dict[str, Any] | None = None  # vLLM's shorthand for a json_schema response_format

    @model_validator(mode='after')
    def _consistent(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError('top_logprobs needs logprobs: true')
        if self.tool_choice is not None and self.tool_choice != 'none' and not self.tools:
            raise ValueError('tool_choice needs tools')
        if isinstance(self.tool_choice, ToolChoiceFunction) and self.tool_choice.function.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f'tool_choice names function {self.tool_choice.function.name!r}, which is not in tools')
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's completions default; 0: score the prompt (echo)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None

    @field_validator('prompt')
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError('prompt is empty')
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError('a prompt of token ids is empty')
        if isinstance(v, list) and isinstance(v[0], int) and any(t < 0 for t in v):
            raise ValueError('token ids are non-negative')
        return v

    @model_validator(mode='after')
    def _consistent(self):
        if self.suffix:
            raise ValueError('suffix is not supported by lmd')
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError('best_of must equal n (lmd returns every sample)')
        return self


class GenerateRequest(_Strict):
    """LMDeploy's ``/generate``: a raw prompt or token ids, optionally in an interactive session.

    With ``interactive_mode`` the session keeps its KV cache after the turn and the next
    request with the same ``session_id`` sends only its new text; a request for that
    session with ``interactive_mode`` false ends it after answering. ``cancel`` aborts the
    session's running turn and ends the session.
    """
    prompt: str | None = None
    input_ids: list[int] | None = None
    session_id: int = Field(-1, ge=-1)
    interactive_mode: bool = False
    cancel: bool = False
    stream: bool = False
    stop: str | list[str] | None = None
    request_output_len: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    top_p: float = Field(0.8, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    do_preprocess: bool = False
    seed: int | None = Field(None, ge=0, lt=_U64)
    min_new_tokens: int = Field(0, ge=0)
    return_logprobs: bool = False
    adapter_name: str | None = None  # LMDeploy's: a LoRA adapter the server serves (--adapters)

    @model_validator(mode='after')
    def _one_prompt(self):
        if not self.cancel and (self.prompt is None) == (self.input_ids is None):
            raise ValueError('send exactly one of prompt and input_ids')
        if self.input_ids is not None and (not self.input_ids or min(self.input_ids) < 0):
            raise ValueError('input_ids must be a non-empty list of non-negative token ids')
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        return self


class EncodeRequest(_Strict):
    input: str | list[str]
    do_preprocess: bool = False
    add_bos: bool = True


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt`` tokenized as it is, or chat ``messages`` rendered by the chat
    template first (with ``add_generation_prompt``, ``tools``, ``chat_template_kwargs``). Without
    ``add_special_tokens`` a prompt gets the model's BOS and rendered messages none (the template
    writes its own), as vLLM's defaults."""
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    """vLLM's ``/detokenize``: token ids back to text."""
    model: str | None = None
    tokens: list[int]

    @field_validator('tokens')
    @classmethod
    def _ids(cls, v):
        if any(t < 0 for t in v):
            raise ValueError('token ids are non-negative')
        return v


class DecodeRequest(_Strict):
    input_ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True

    @field_validator('input_ids')
    @classmethod
    def _ids(cls, v):
        flat = [t for row in v for t in row] if v and isinstance(v[0], list) else v
        if any(t < 0 for t in flat):
            raise ValueError('token ids are non-negative')
        return v


class EmbeddingRequest(_Strict):
    """OpenAI's ``/v1/embeddings``: ``input`` a text, a list of texts, a list of token ids or a list of
    such lists; ``encoding_format`` 'float' or 'base64' (little-endian float32, which OpenAI's client
    asks for by default and decodes); ``dimensions`` where the model declares Matryoshka embeddings;
    ``user`` accepted and ignored."""
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal['float', 'base64'] = 'float'
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class LoadLoraAdapterRequest(_Strict):
    """vLLM's ``/v1/load_lora_adapter``: serve the PEFT adapter in folder ``lora_path`` as ``lora_name``."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's ``/v1/unload_lora_adapter``."""
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's clients may send it; the name decides
