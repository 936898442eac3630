"""The configs and results users pass to and get from lmd (LMDeploy's names).

Every config validates itself in ``__post_init__`` and raises ``ValueError``
naming the field, the value it got and what is allowed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

FinishReason = Literal['stop', 'length', 'abort', 'error']


def _fail(cls: str, name: str, value: Any, allowed: str) -> None:
    raise ValueError(f'{cls}.{name}={value!r} is invalid: {allowed}')


def _check_range(cls: str, name: str, value, lo=None, hi=None, lo_open=False, hi_open=False, integer=False):
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        _fail(cls, name, value, 'expected an integer')
    if not integer and (isinstance(value, bool) or not isinstance(value, (int, float))):
        _fail(cls, name, value, 'expected a number')
    if value != value:  # NaN
        _fail(cls, name, value, 'expected a number, got NaN')
    if lo is not None and (value <= lo if lo_open else value < lo):
        _fail(cls, name, value, f'must be {">" if lo_open else ">="} {lo}')
    if hi is not None and (value >= hi if hi_open else value > hi):
        _fail(cls, name, value, f'must be {"<" if hi_open else "<="} {hi}')


def _check_choice(cls: str, name: str, value, choices):
    if value not in choices:
        _fail(cls, name, value, f'allowed values are {", ".join(repr(c) for c in choices)}')


def _as_str_list(cls: str, name: str, value) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        _fail(cls, name, value, 'expected a string or a list of non-empty strings')
    return list(value)


def _as_int_list(cls: str, name: str, value) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        _fail(cls, name, value, 'expected a token id or a list of non-negative token ids')
    return list(value)


@dataclass
class GenerationConfig:
    """How to generate: LMDeploy's fields and defaults (greedy unless ``do_sample``)."""
    n: int = 1
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    response_format: dict | None = None
    # vLLM's: each prompt token's logprob and its top-k alternatives, from the prefill pass (None: none)
    prompt_logprobs: int | None = None

    def __post_init__(self):
        c = 'GenerationConfig'
        _check_range(c, 'n', self.n, lo=1, integer=True)
        _check_range(c, 'max_new_tokens', self.max_new_tokens, lo=0, integer=True)
        _check_range(c, 'min_new_tokens', self.min_new_tokens, lo=0, integer=True)
        if self.min_new_tokens > self.max_new_tokens:
            _fail(c, 'min_new_tokens', self.min_new_tokens, f'must be <= max_new_tokens ({self.max_new_tokens})')
        if not isinstance(self.do_sample, bool):
            _fail(c, 'do_sample', self.do_sample, 'expected True or False')
        _check_range(c, 'temperature', self.temperature, lo=0.0, hi=100.0)
        _check_range(c, 'top_p', self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_range(c, 'top_k', self.top_k, lo=0, integer=True)
        _check_range(c, 'min_p', self.min_p, lo=0.0, hi=1.0)
        _check_range(c, 'repetition_penalty', self.repetition_penalty, lo=0.0, lo_open=True)
        _check_range(c, 'presence_penalty', self.presence_penalty, lo=-2.0, hi=2.0)
        _check_range(c, 'frequency_penalty', self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.random_seed is not None:
            _check_range(c, 'random_seed', self.random_seed, lo=0, hi=2**64 - 1, integer=True)
        if self.logprobs is not None:
            _check_range(c, 'logprobs', self.logprobs, lo=0, hi=20, integer=True)
        if self.prompt_logprobs is not None:
            _check_range(c, 'prompt_logprobs', self.prompt_logprobs, lo=0, hi=20, integer=True)
        self.stop_words = _as_str_list(c, 'stop_words', self.stop_words)
        self.bad_words = _as_str_list(c, 'bad_words', self.bad_words)
        self.stop_token_ids = _as_int_list(c, 'stop_token_ids', self.stop_token_ids)
        self.bad_token_ids = _as_int_list(c, 'bad_token_ids', self.bad_token_ids)
        if self.response_format is not None and not isinstance(self.response_format, dict):
            _fail(c, 'response_format', self.response_format, 'expected a dict like {"type": "json_object"}')

    @property
    def greedy(self) -> bool:
        """Sampling reduces to argmax: no sampling asked, zero temperature, or top_k 1."""
        return not self.do_sample or self.temperature == 0.0 or self.top_k == 1

    def replace(self, **changes) -> 'GenerationConfig':
        return dataclasses.replace(self, **changes)


@dataclass
class SpeculativeConfig:
    """Speculative decoding (LMDeploy's ``SpeculativeConfig``; vLLM's n-gram settings): each step a
    decoding sequence gets up to ``num_speculative_tokens`` drafted tokens, which the model verifies in
    one pass with its next token; the output is the one without speculation (greedy: token for token;
    sampled: the same distribution, by rejection sampling).

    ``method``: 'ngram' (prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) or 'draft_target' (a
    smaller ``model`` sharing the tokenizer drafts).

    ``adaptive_draft_length`` (lmd's): each step, each draft is cut to the length that pays on this
    machine, from the measured cost of a verification row and the sequence's recent acceptance rate
    (``lmd.kernels.ops.DraftLength``); ``num_speculative_tokens`` is then the most a step drafts. False:
    always ``num_speculative_tokens`` where the proposer has them.
    """
    method: str = 'ngram'
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive_draft_length: bool = True

    def __post_init__(self):
        c = 'SpeculativeConfig'
        _check_choice(c, 'method', self.method, ('ngram', 'draft_target'))
        _check_range(c, 'num_speculative_tokens', self.num_speculative_tokens, lo=1, hi=16, integer=True)
        _check_range(c, 'prompt_lookup_min', self.prompt_lookup_min, lo=1, integer=True)
        _check_range(c, 'prompt_lookup_max', self.prompt_lookup_max, lo=self.prompt_lookup_min, integer=True)
        if self.method == 'draft_target' and not self.model:
            _fail(c, 'model', self.model, "method 'draft_target' needs the draft model's path")


@dataclass
class EngineConfig:
    """The settings both engines share (LMDeploy's names and defaults), checked once here.

    ``cache_max_entry_count`` is the fraction of free memory the KV cache may take;
    ``num_cache_blocks`` overrides it with an exact block count.
    """
    session_len: int | None = None
    max_batch_size: int = 128
    cache_max_entry_count: float = 0.8
    cache_block_seq_len: int = 64
    num_cache_blocks: int | None = None
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    tp: int = 1  # tensor parallel ranks (the PyTorch engine: torch.distributed; TurboMind: CUDA builds)
    dp: int = 1  # data-parallel replicas: dp engines behind one AsyncEngine, each with its share of the cores
    model_format: str | None = None
    dtype: str = 'auto'
    device: str = 'cpu'
    max_prefill_token_num: int | None = 4096
    num_threads: int | None = None
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters served beside the base model from the start (LMDeploy's name): {name: PEFT folder}
    adapters: dict[str, str] | None = None

    def __post_init__(self):
        c = type(self).__name__
        if self.session_len is not None:
            _check_range(c, 'session_len', self.session_len, lo=1, integer=True)
        _check_range(c, 'max_batch_size', self.max_batch_size, lo=1, integer=True)
        _check_range(c, 'cache_max_entry_count', self.cache_max_entry_count, lo=0.0, hi=1.0, lo_open=True)
        _check_range(c, 'cache_block_seq_len', self.cache_block_seq_len, lo=1, integer=True)
        if self.num_cache_blocks is not None:
            _check_range(c, 'num_cache_blocks', self.num_cache_blocks, lo=1, integer=True)
        if not isinstance(self.enable_prefix_caching, bool):
            _fail(c, 'enable_prefix_caching', self.enable_prefix_caching, 'expected True or False')
        _check_choice(c, 'quant_policy', self.quant_policy, (0, 4, 8))
        _check_range(c, 'tp', self.tp, lo=1, integer=True)
        _check_range(c, 'dp', self.dp, lo=1, integer=True)
        _check_choice(c, 'model_format', self.model_format,
                      (None, 'hf', 'awq', 'w8a8', 'gptq', 'compressed-tensors', 'fp8', 'mxfp4', 'gguf'))
        _check_choice(c, 'dtype', self.dtype, ('auto', 'float32', 'bfloat16', 'float16'))
        if self.max_prefill_token_num is not None:
            _check_range(c, 'max_prefill_token_num', self.max_prefill_token_num, lo=1, integer=True)
        if self.num_threads is not None:
            _check_range(c, 'num_threads', self.num_threads, lo=1, integer=True)
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            _fail(c, 'speculative_config', self.speculative_config, 'expected a SpeculativeConfig or None')
        if self.adapters is not None and not (isinstance(self.adapters, dict) and all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.adapters.items())):
            _fail(c, 'adapters', self.adapters, 'expected a dict of adapter name -> PEFT adapter folder')
        if not isinstance(self.device, str) or not self._device_ok(self.device):
            _fail(c, 'device', self.device, f'allowed values are {self._devices}')

    # the devices an engine takes, as the error names them, and the test (TurboMind's are fewer)
    _devices: ClassVar[str] = "'cpu', 'cuda', 'cuda:N'"

    @staticmethod
    def _device_ok(device: str) -> bool:
        return device.split(':')[0] in ('cpu', 'cuda')


@dataclass
class PytorchEngineConfig(EngineConfig):
    """The PyTorch backend's settings: the shared ones, and its kernels and CPU cache cap."""
    # None: by device ('native' on CPU, 'triton' on CUDA); 'cuda': lmd's own CUDA kernels (a build
    # with them, on a CUDA device; not the default until it has passed the GPU tests)
    kernel_backend: str | None = None
    max_cache_memory_gib: float | None = 4.0  # caps cache_max_entry_count on CPU, where "free" is the host's RAM
    pp: int = 1  # pipeline stages: the layers split over pp ranks (times tp: tp * pp ranks in all)
    # how the tp * pp ranks start: 'mp' local processes, 'ray' a Ray cluster's placement group
    # (RAY_ADDRESS or ray_address; a local one when neither names a cluster); None: 'mp'
    distributed_executor_backend: str | None = None
    ray_address: str | None = None

    def __post_init__(self):
        super().__post_init__()
        c = 'PytorchEngineConfig'
        _check_choice(c, 'kernel_backend', self.kernel_backend, (None, 'torch', 'native', 'triton', 'cuda'))
        if self.kernel_backend == 'cuda' and self.device == 'cpu':
            _fail(c, 'kernel_backend', self.kernel_backend,
                  "lmd's CUDA kernels run on a CUDA device: set device='cuda', or choose 'native' or 'torch' "
                  "for the CPU (a build with them: pip install . -C cmake.define.LMD_WITH_CUDA=ON)")
        if self.max_cache_memory_gib is not None:
            _check_range(c, 'max_cache_memory_gib', self.max_cache_memory_gib, lo=0.0, lo_open=True)
        _check_range(c, 'pp', self.pp, lo=1, integer=True)
        _check_choice(c, 'distributed_executor_backend', self.distributed_executor_backend, (None, 'mp', 'ray'))
        if self.ray_address is not None and self.distributed_executor_backend != 'ray':
            _fail(c, 'ray_address', self.ray_address, "it applies to distributed_executor_backend='ray'")


@dataclass
class TurbomindEngineConfig(EngineConfig):
    """TurboMind's settings (the C++ engine, ``lmd.turbomind``): the shared ones, and

    ``int8_activations``: the group-quantized matmuls (4-bit: GGUF Q4_0 / Q4_1, AWQ; 8-bit: GGUF
    Q8_0; a GGUF's other block types) take their activations quantized to int8 per 32 values, as
    llama.cpp multiplies Q4 and Q8_0 by Q8: a faster CPU decode, logits no longer equal to float
    arithmetic (lib/kernels/csrc/cpu/gemm.h W4A8, quant.h W8A8 by groups, gguf.h). A W8A16 lm_head
    keeps float activations: its float panels are faster than the int8 kernel there.
    """
    int8_activations: bool = False
    _devices: ClassVar[str] = "'cpu', 'cuda'"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.int8_activations, bool):
            _fail('TurbomindEngineConfig', 'int8_activations', self.int8_activations, 'expected True or False')

    @staticmethod
    def _device_ok(device: str) -> bool:
        return device in ('cpu', 'cuda')


@dataclass
class ChatTemplateConfig:
    """Override the model's own chat template with a named built-in, or parts of it."""
    model_name: str
    system: str | None = None
    meta_instruction: str | None = None  # default system prompt when the user gives none
    chat_template: str | None = None     # a Jinja template that replaces the built-in's

    def __post_init__(self):
        from .chat_template import BUILTIN_TEMPLATES
        if self.model_name not in BUILTIN_TEMPLATES:
            _fail('ChatTemplateConfig', 'model_name', self.model_name,
                  f'built-in templates are {", ".join(sorted(BUILTIN_TEMPLATES))}')


@dataclass
class Response:
    """One prompt's answer, or one streamed piece of it (``text``/``token_ids`` then hold the new part)."""
    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: FinishReason | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    session_id: int | None = None
    num_cached_tokens: int = 0
    # with GenerationConfig.prompt_logprobs, on the first piece: one entry per prompt token, the first
    # None (nothing predicts it), the others {token_id: logprob} with the prompt's own token first
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __repr__(self):
        return (f'Response(text={self.text!r}, generate_token_len={self.generate_token_len}, '
                f'input_token_len={self.input_token_len}, finish_reason={self.finish_reason!r}, '
                f'index={self.index})')
