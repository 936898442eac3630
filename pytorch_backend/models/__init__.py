"""Models of the PyTorch backend; ``build_model`` is the one entry point the engine uses."""
from __future__ import annotations

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig

from .deepseek import DeepseekV2CausalLM
from .llama import CausalLM
from .moe import MoeCausalLM

# family (ModelConfig.family) -> implementation; every supported family but DeepSeek-V2 is Llama-shaped.
MODEL_CLASSES = {
    'llama': CausalLM,
    'mistral': CausalLM,
    'qwen2': CausalLM,
    'qwen3': CausalLM,
    'smollm3': CausalLM,
    'phi3': CausalLM,
    'gemma2': CausalLM,
    'gemma3': CausalLM,
    'olmo2': CausalLM,
    'glm': CausalLM,
    'glm4': CausalLM,
    # the same decoder with mixtures of experts for MLPs (moe.py)
    'mixtral': MoeCausalLM,
    'qwen2_moe': MoeCausalLM,
    'qwen3_moe': MoeCausalLM,
    'gpt_oss': MoeCausalLM,
    # latent attention over a latent KV cache, experts with grouped routing (deepseek.py)
    'deepseek_v2': DeepseekV2CausalLM,
}


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str = 'cpu', kernel_backend: str | None = None,
                quantized: dict[str, tuple] | None = None, layers: range | None = None) -> CausalLM:
    """Build a model from HF-named weights (and quantized matmuls: ``CausalLM``); raises
    ModelFormatError when they do not fit. ``layers``: a pipeline stage's decoder layers (None: all)."""
    cls = MODEL_CLASSES.get(config.family)
    if cls is None:
        raise ModelFormatError(f'the pytorch backend has no model for family {config.family!r} '
                               f'({config.architecture})')
    if layers is None:
        return cls(config, weights, dtype, device, kernel_backend, quantized)
    if cls is DeepseekV2CausalLM:
        raise ModelFormatError(f'{config.architecture}: pipeline stages run Llama-shaped decoders; its latent '
                               'attention is not split into stages yet')
    return cls(config, weights, dtype, device, kernel_backend, quantized, layers)


__all__ = ['CausalLM', 'build_model', 'MODEL_CLASSES']
