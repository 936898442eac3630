"""Reading a checkpoint's weights for the PyTorch engine's models (every rank's, with tensor parallelism)."""
from __future__ import annotations

import os

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import QUANTIZED_FORMATS, ModelConfig
from lmd.weights.source_format import quantized_linears, source_format
from lmd.weights.turbomind_layout import gguf_matmuls, is_converted


def load_model_weights(model_dir: str, mc: ModelConfig, model_format: str | None,
                       dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, tuple], str]:
    """(float weights, quantized matmuls, format) of an HF checkpoint: float ('hf'), a GGUF conversion
    ('gguf': its Q4_0 / Q4_1 / Q4_K matmuls and Q8_0 head quantized as TurboMind reads them,
    ``gguf_matmuls``, the rest dequantized), or quantized (AWQ, W8A8, GPTQ, compressed-tensors, FP8),
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
        weights = load_weights(model_dir, dtype)
        # DeepSeek-V2's model runs float weights only (models/deepseek.py): its GGUF matmuls dequantized
        quantized = gguf_matmuls(model_dir, mc) if fmt == 'gguf' and mc.mla is None else {}
        for name in quantized:
            weights.pop(name, None)  # the dequantized copy
        return weights, quantized, 'gguf' if quantized else 'hf'
    weights = load_weights(model_dir)  # as stored: the quantized layout keeps fp16 scales exact in float32
    quantized = quantized_linears(fmt, weights, mc.quantization_config, where)
    stray = [f'{n!r} ({t.dtype})' for n, t in weights.items() if not t.is_floating_point()]
    if stray:
        raise ModelFormatError(f'{where}: {fmt} checkpoint with integer tensors that belong to no quantized '
                               f'matmul (a scale or zero point missing?): {", ".join(stray[:4])}')
    return weights, quantized, fmt


def load_model(model_dir: str, mc: ModelConfig, model_format: str | None, dtype: torch.dtype, device: torch.device,
               kernel_backend: str | None, rank: int = 0, tp: int = 1, layers: range | None = None):
    """(model, format) of ``model_dir``: its weights (``load_model_weights``), rank ``rank``'s shard of them
    when ``tp`` > 1 (``lmd.weights.tensor_parallel``), built on ``device`` with its kernels on this thread's
    torch thread count; ``layers``: a pipeline stage's decoder layers (None: all). Its RoPE table is the
    caller's to build (``build_rope``), once it knows the session length."""
    from lmd.weights.tensor_parallel import shard_config, shard_weights

    from .models import build_model
    weights, quantized, fmt = load_model_weights(model_dir, mc, model_format, dtype)
    weights, quantized = shard_weights(mc, weights, quantized, rank, tp)
    model = build_model(shard_config(mc, rank, tp), weights, dtype, device, kernel_backend, quantized, layers)
    model.kernels.set_num_threads(torch.get_num_threads())
    return model, fmt
