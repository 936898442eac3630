"""SmoothQuant W8A8: int8 weights per output channel, int8 activations per token at run time.

Outliers in a few activation channels make per-token int8 activations coarse. For each group
of linears sharing an input (``scales.smooth_groups``) the scales

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)      (max over calibration tokens / the group's rows)

move that difficulty into the weights: X / s feeds W * s, and 1/s is folded into the producer
(norm weight or preceding linear). Then every linear is quantized to int8, symmetric per output
channel (``lmd.weights.quant_layouts.quantize_w8``), and written as the W8A8 checkpoint of
``lmd.weights.source_format`` with everything else in float16.
"""
from __future__ import annotations

import torch

from lmd.weights.quant_layouts import quantize_w8

from .calib_data import BUILTIN, calib_tokens
from .calibrate import load_float_model, run_layers
from .checkpoint import float_tensors, quantized_linears, write_checkpoint
from .scales import fold_scales, group_weight, smooth_groups

QUANT_CONFIG = dict(quant_method='smooth_quant', bits=8, activation_scheme='dynamic_per_token')


def smooth_scale(act_absmax: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """act_absmax [K], w [N, K] -> s [K]."""
    w_absmax = w.abs().amax(0).clamp(min=1e-5)
    return (act_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def smooth_layer(layer, stats, alpha: float) -> None:
    for group in smooth_groups(layer):
        fold_scales(group.producer, group.linears,
                    smooth_scale(stats[group.name].absmax, group_weight(group.linears), alpha))


def w8a8_tensors(model) -> dict[str, torch.Tensor]:
    linears = quantized_linears(model)
    out = float_tensors(model, skip={f'{name}.weight' for name in linears})
    for name, linear in linears.items():
        out[f'{name}.weight'], out[f'{name}.weight_scale'] = quantize_w8(linear.weight.detach())
    return out


def smooth_quant(model: str, work_dir: str, alpha: float = 0.5, calib_dataset: str = BUILTIN,
                 calib_samples: int = 128, calib_seqlen: int = 512, batch_size: int = 4, w_bits: int = 8,
                 dtype: str = 'float32') -> str:
    """Smooth and quantize ``model`` to W8A8 (see the module doc) into ``work_dir``; returns its path."""
    if w_bits != 8:
        raise ValueError(f'--w-bits {w_bits} is not supported: smooth_quant writes 8-bit weights '
                         '(for 4-bit weights use lmd lite auto_awq)')
    if not 0 <= alpha <= 1:
        raise ValueError(f'--alpha must be in [0, 1], got {alpha}')
    model_dir, hf, tokenizer = load_float_model(model, dtype)
    tokens = calib_tokens(tokenizer, calib_dataset, calib_samples, calib_seqlen)
    run_layers(hf, tokens, batch_size, lambda i, layer, stats, kv: smooth_layer(layer, stats, alpha))
    return write_checkpoint(work_dir, model_dir, w8a8_tensors(hf), QUANT_CONFIG)
