"""MXFP4 checkpoints (gpt-oss as OpenAI ships it), run dequantized: each expert stack becomes float at load,
exactly (an FP4 value times a power of two is a bfloat16), and the experts then run as any float ones.

transformers (``quant_method "mxfp4"``; OCP microscaling FP4)::

    config.json  "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [...]}
    X_blocks  uint8 [E, N, K / 32, 16]  per output row n, groups of 32 consecutive k, two FP4 (e2m1) codes a
                                        byte: element 2j in the low nibble, 2j + 1 in the high one
    X_scales  uint8 [E, N, K / 32]      a shared exponent per group, biased by 127 (e8m0)
    w[e, n, k] = FP4_VALUES[code] * 2 ** (scale[e, n, k // 32] - 127)

X is each layer's ``mlp.experts.gate_up_proj`` (N = 2 I, its rows gate and up interleaved; K = H) and
``mlp.experts.down_proj`` (N = H, K = I); dequantized, they are stored as the float checkpoint stores them,
x @ w ([E, K, N]), for ``stacked_experts.py`` to read. Everything else (attention, router, biases, norms,
embeddings) is float already.
"""
from __future__ import annotations

import torch

from lmd.errors import ModelFormatError

# the 16 e2m1 codes: sign bit 3, then two exponent bits and one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # elements that share a scale (16 bytes)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> bfloat16 [..., G * 32] (the module doc)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(torch.bfloat16)


def mxfp4_experts(weights: dict[str, torch.Tensor], quant_config: dict | None,
                  where: str = 'the checkpoint') -> dict[str, tuple]:
    """Dequantize every ``X_blocks`` / ``X_scales`` pair of a ``quant_method "mxfp4"`` checkpoint in
    ``weights``, in place, into ``X`` [E, K, N] (the module doc); no matmul stays quantized, so the result
    is empty."""
    names = [n[:-len('_blocks')] for n in weights if n.endswith('_blocks')]
    if not names:
        raise ModelFormatError(f'{where}: config.json says quant_method mxfp4, but there is no X_blocks tensor '
                               "(lmd reads MXFP4 for gpt-oss's experts)")
    for base in names:
        blocks, scales = weights.pop(base + '_blocks'), weights.pop(base + '_scales', None)
        if scales is None:
            raise ModelFormatError(f'{where}: tensor {base + "_blocks"!r} has no {base + "_scales"!r} beside it')
        if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4
                or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape)):
            raise ModelFormatError(
                f'{where}: MXFP4 tensors {base!r}: blocks {blocks.dtype} {list(blocks.shape)}, scales {scales.dtype} '
                f'{list(scales.shape)}; expected uint8 [E, N, K / 32, 16] and uint8 [E, N, K / 32]')
        weights[base] = dequantize_mxfp4(blocks, scales).transpose(1, 2)
    return {}
