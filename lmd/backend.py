"""Which engine runs a model: ``backend='auto'``, the default of ``pipeline()`` and every command.

As LMDeploy's ``autoget_backend``: TurboMind where it runs the model's architecture and
weight format on the device asked for, else the PyTorch engine. The answer comes from the
model's ``config.json`` alone, so deciding imports no engine; ``build_engine`` (in
``async_engine.py``) builds what ``resolve_backend`` says.
"""
from __future__ import annotations

from .messages import EngineConfig, PytorchEngineConfig, SpeculativeConfig, TurbomindEngineConfig
from .model_config import ModelConfig

BACKENDS = ('auto', 'turbomind', 'pytorch')
CONFIGS: dict[str, type[EngineConfig]] = {'turbomind': TurbomindEngineConfig, 'pytorch': PytorchEngineConfig}

# What lmd.turbomind runs: the families turbomind/model.py builds, the weight formats it reads
# (lmd.weights.turbomind_layout.load_fused; its own layout, written by `lmd convert --backend
# turbomind`, declares one of them), on the devices it has kernels for (CPU only: the CUDA kernels
# come later).
TURBOMIND_ARCHITECTURES = frozenset({
    'LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'SmolLM3ForCausalLM',
    'Phi3ForCausalLM', 'Gemma2ForCausalLM', 'Gemma3ForCausalLM', 'MixtralForCausalLM', 'Qwen2MoeForCausalLM',
    'Qwen3MoeForCausalLM', 'DeepseekV2ForCausalLM', 'Olmo2ForCausalLM', 'GlmForCausalLM', 'Glm4ForCausalLM',
    'GptOssForCausalLM'})
TURBOMIND_FORMATS = frozenset({'hf', 'awq', 'w8a8', 'gptq', 'compressed-tensors', 'fp8', 'mxfp4', 'gguf'})
TURBOMIND_DEVICES = frozenset({'cpu'})


def check_backend(backend: str | None) -> str:
    """``backend`` as given ('auto' for None); ValueError naming the allowed values otherwise."""
    backend = 'auto' if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f'backend={backend!r} is invalid: allowed values are '
                         + ', '.join(repr(b) for b in BACKENDS))
    return backend


def turbomind_refusal(model_dir: str, model_format: str | None = None, device: str = 'cpu') -> str | None:
    """Why TurboMind cannot run ``model_dir`` as asked, or None when it can."""
    config = ModelConfig.from_dir(model_dir)
    if config.architecture not in TURBOMIND_ARCHITECTURES:
        return f'TurboMind does not run {config.architecture}'
    fmt = model_format or config.model_format
    if fmt not in TURBOMIND_FORMATS:
        return f'TurboMind does not read model_format {fmt!r}'
    if str(device).split(':')[0] not in TURBOMIND_DEVICES:
        return f'TurboMind has no kernels for device {device!r}'
    return None


def autoget_backend(model_dir: str, model_format: str | None = None, device: str = 'cpu') -> str:
    """'turbomind' where it runs the model, its format and the device; else 'pytorch'."""
    return 'pytorch' if turbomind_refusal(model_dir, model_format, device) else 'turbomind'


def resolve_backend(model_dir: str, backend: str | None, backend_config: EngineConfig | None) -> tuple[str, str]:
    """(the engine to build, why, as the start-up line says it). An explicit backend wins; with
    'auto' (or None) a config decides by its type, and without one ``autoget_backend`` does."""
    backend = check_backend(backend)
    if backend != 'auto':
        return backend, f'backend={backend!r}'
    if isinstance(backend_config, TurbomindEngineConfig):
        return 'turbomind', 'a TurbomindEngineConfig'
    if isinstance(backend_config, PytorchEngineConfig):
        return 'pytorch', 'a PytorchEngineConfig'
    model_format = backend_config.model_format if backend_config is not None else None
    device = backend_config.device if backend_config is not None else 'cpu'
    refusal = turbomind_refusal(model_dir, model_format, device)
    if refusal:
        return 'pytorch', f'auto: {refusal}'
    return 'turbomind', 'auto: TurboMind runs this model'



def command_speculative_config(algorithm: str | None, num_draft_tokens: int | None,
                               draft_model: str | None) -> SpeculativeConfig | None:
    """The ``SpeculativeConfig`` of a command's --speculative-algorithm / --speculative-num-draft-tokens /
    --speculative-draft-model (LMDeploy's flags); None without an algorithm."""
    if algorithm is None:
        if num_draft_tokens is not None or draft_model is not None:
            raise ValueError('--speculative-num-draft-tokens and --speculative-draft-model need '
                             '--speculative-algorithm (ngram or draft_target)')
        return None
    fields = dict(method=algorithm, model=draft_model)
    if num_draft_tokens is not None:
        fields['num_speculative_tokens'] = num_draft_tokens
    return SpeculativeConfig(**fields)


# the PyTorch engine's settings a command takes beside the shared ones, and their values when not set
PYTORCH_FIELDS = {'pp': 1, 'distributed_executor_backend': None, 'ray_address': None}


def command_engine_config(fields: dict, backend: str, int8_activations: bool = False) -> EngineConfig:
    """The engine config of a command's flags: the shared ``fields`` (None values left out), as a
    ``TurbomindEngineConfig`` when a TurboMind-only flag is set (which a PyTorch backend refuses), as a
    ``PytorchEngineConfig`` when one of ``PYTORCH_FIELDS`` is (--pp, --distributed-executor-backend,
    --ray-address; which TurboMind refuses). --ray-address alone implies the 'ray' executor."""
    fields = {k: v for k, v in fields.items() if v is not None}
    pytorch = {k: fields.pop(k) for k in PYTORCH_FIELDS if k in fields}
    if 'ray_address' in pytorch:
        pytorch.setdefault('distributed_executor_backend', 'ray')
    pytorch_set = [k for k, v in pytorch.items() if v != PYTORCH_FIELDS[k]]
    if pytorch_set:
        flag = '--' + pytorch_set[0].replace('_', '-')
        if int8_activations:
            raise ValueError(f'--int8-activations is a TurboMind setting and {flag} a PyTorch engine one: '
                             'choose one engine')
        if backend == 'turbomind':
            raise ValueError(f'{flag} {pytorch[pytorch_set[0]]} is a PyTorch engine setting (TurboMind scales out '
                             'with --dp): use --backend pytorch or auto')
        return PytorchEngineConfig(**fields, **pytorch)
    if not int8_activations:
        return EngineConfig(**fields)
    if backend == 'pytorch':
        raise ValueError('int8_activations=True is a TurboMind setting: use backend turbomind or auto')
    return TurbomindEngineConfig(**fields, int8_activations=True)
