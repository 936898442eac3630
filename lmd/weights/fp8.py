"""FP8 checkpoints, run dequantized: each e4m3 weight becomes float at load, w = float(q) * scale in float32
(exact for 16-bit scales; the engines then cast it to their dtype), and the matmuls run on float
activations: the activation quantization the checkpoint was made for (X.input_scale, or dynamic) is not
run, so the outputs differ from an FP8 GEMM's by that quantization only.

transformers / vLLM (``quant_method "fp8"``)::

    config.json  "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic" | "static",
                                         "weight_block_size": [bn, bk] (block-wise checkpoints only)}
    X.weight            float8_e4m3fn [N, K]
    X.weight_scale      float [] or [1] (per tensor: AutoFP8, vLLM), or [N, 1] (per output channel)
    X.weight_scale_inv  float [ceil(N / bn), ceil(K / bk)] (block-wise: transformers' FineGrainedFP8,
                        DeepSeek-V3, Qwen3-FP8; a multiplier, despite its name)
    X.input_scale       static activation scale (dropped)
    w[n, k] = q[n, k] * scale[n // bn, k // bk]   (bn = N, bk = K per tensor; bn = 1, bk = K per channel)

compressed-tensors' "float-quantized" holds the same under ``X.weight_scale`` (per tensor, channel, group
or block; ``compressed_tensors.py``).
"""
from __future__ import annotations

import torch

from lmd.errors import ModelFormatError

_FP8 = torch.float8_e4m3fn


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """float8_e4m3fn [N, K] and its scale (the module doc: one value, [N] or [N, 1], or one per block of
    ``block`` = (bn, bk); without ``block``, a 2-D scale [R, C] must divide [N, K] evenly) -> float32 [N, K]."""
    (n, k), w, s = weight.shape, weight.float(), scale.float()
    if s.numel() == 1:
        return w * s.reshape(())
    if tuple(s.shape) in ((n,), (n, 1)):
        return w * s.reshape(n, 1)
    if s.dim() == 2:
        rows, cols = s.shape
        bn, bk = block or ((n // rows, k // cols) if n % rows == 0 and k % cols == 0 else (0, 0))
        if bn > 0 and bk > 0 and (rows, cols) == (-(-n // bn), -(-k // bk)):
            return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    raise ValueError(f'scale {list(s.shape)} fits neither one value, [N] / [N, 1] with N = {n}, nor blocks '
                     f'{list(block) if block else "dividing"} of [{n}, {k}]')


def dequantize_fp8_linear(weights: dict[str, torch.Tensor], base: str, block: tuple[int, int] | None,
                          where: str) -> None:
    """``base.weight`` (e4m3) with ``base.weight_scale`` (or ``.weight_scale_inv``) -> float32 ``base.weight``,
    in ``weights``; ``base.input_scale`` dropped."""
    scale_name = next((base + s for s in ('.weight_scale', '.weight_scale_inv') if base + s in weights), None)
    if scale_name is None:
        raise ModelFormatError(f'{where}: FP8 tensor {base + ".weight"!r} has no {base + ".weight_scale"!r} '
                               f'(or {base + ".weight_scale_inv"!r})')
    for name in ('.input_scale', '.input_zero_point'):
        weights.pop(base + name, None)
    try:
        weights[base + '.weight'] = dequantize_fp8(weights[base + '.weight'], weights.pop(scale_name), block)
    except ValueError as e:
        raise ModelFormatError(f'{where}: tensor {scale_name!r}: {e}') from None


def fp8_linears(weights: dict[str, torch.Tensor], quant_config: dict | None,
                where: str = 'the checkpoint') -> dict[str, tuple]:
    """Dequantize every FP8 weight of a ``quant_method "fp8"`` checkpoint in ``weights``, in place (the module
    doc); no matmul stays quantized, so the result is empty."""
    cfg = quant_config or {}
    block = cfg.get('weight_block_size')
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelFormatError(f'{where}: FP8 quantization_config.weight_block_size {block!r}: expected [bn, bk]')
    other = next((n for n, t in weights.items() if t.dtype.is_floating_point and t.dtype.itemsize == 1
                  and t.dtype != _FP8), None)
    if other is not None:
        raise ModelFormatError(f'{where}: tensor {other!r} is {weights[other].dtype}; lmd reads FP8 as float8_e4m3fn')
    names = [n for n, t in weights.items() if t.dtype == _FP8]
    if not names:
        raise ModelFormatError(f'{where}: config.json says quant_method fp8, but there is no float8_e4m3fn tensor')
    for name in names:
        if not name.endswith('.weight'):
            raise ModelFormatError(f'{where}: FP8 tensor {name!r} is not a matmul weight (X.weight)')
        dequantize_fp8_linear(weights, name[:-len('.weight')], tuple(block) if block else None, where)
    return {}
