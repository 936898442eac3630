"""Reading a checkpoint's weights for the PyTorch engine's models (every rank's, with tensor parallelism)."""
from __future__ import annotations

import os

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import QUANTIZED_FORMATS, ModelConfig
from lmd.weights.source_format import quantized_linears, source_format
from lmd.weights.turbomind_layout import is_converted


def load_model_weights(model_dir: str, mc: ModelConfig, model_format: str | None,
                       dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, tuple], str]:
    """(float weights, quantized matmuls, format) of an HF checkpoint: float ('hf'; a GGUF
    conversion's dequantized weights included), or quantized (AWQ, W8A8, GPTQ, compressed-tensors, FP8),
    detected from config.json as TurboMind detects it, whose matmuls stay quantized (HF weight name -> a
    layout of ``lmd.weights.quant_layouts``; FP8 ones are dequantized). TurboMind's own layout is refused."""
    from lmd.model_loader import load_weights

    if is_converted(model_dir):
        raise ModelFormatError(f'{model_dir} is in TurboMind\'s own layout (lmd convert --backend turbomind); '
                               'the PyTorch engine reads HF checkpoints: use TurbomindEngineConfig, or convert '
                               'without --backend turbomind')
    fmt = source_format(model_dir, mc, model_format)
    where = os.path.join(model_dir, '')
    if fmt not in QUANTIZED_FORMATS:
        return load_weights(model_dir, dtype), {}, 'hf'
    weights = load_weights(model_dir)  # as stored: the quantized layout keeps fp16 scales exact in float32
    quantized = quantized_linears(fmt, weights, mc.quantization_config, where)
    stray = [f'{n!r} ({t.dtype})' for n, t in weights.items() if not t.is_floating_point()]
    if stray:
        raise ModelFormatError(f'{where}: {fmt} checkpoint with integer tensors that belong to no quantized '
                               f'matmul (a scale or zero point missing?): {", ".join(stray[:4])}')
    return weights, quantized, fmt
