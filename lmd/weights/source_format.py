"""What a checkpoint directory is (``source_format``: 'hf', 'gguf', 'awq' or 'w8a8') and its
AWQ / W8A8 matmuls read into the layouts of ``quant_layouts.py``, exactly.

Quantized checkpoints both engines read (``model_format``; ``None`` detects them from config.json):

AWQ (``'awq'``, AutoAWQ's GEMM packing; what ``lmd lite auto_awq`` writes)::

    config.json  "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": G,
                                         "zero_point": true, "version": "gemm"}
    X.qweight  int32 [K, N // 8]       nibble i of each int32 holds column AWQ_ORDER[i] of its 8
    X.qzeros   int32 [K // G, N // 8]  the same packing
    X.scales   fp16  [K // G, N]       w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]

W8A8 (``'w8a8'``, LMDeploy's ``smooth_quant``: smoothing is folded into the norms and weights,
so the checkpoint holds only int8 weights; what ``lmd lite smooth_quant`` writes)::

    config.json  "quantization_config": {"quant_method": "smooth_quant", "bits": 8,
                                         "activation_scheme": "dynamic_per_token"}
    X.weight        int8    [N, K]
    X.weight_scale  float32 [N] (or [N, 1])   w = weight * weight_scale[:, None]

In both, X is any of the seven matmuls of a layer (``q_proj`` ... ``down_proj``); embeddings,
norms, biases and the lm_head stay float.
"""
from __future__ import annotations

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import QUANT_METHODS, QUANTIZED_FORMATS, ModelConfig

from .compressed_tensors import compressed_tensors_linears
from .fp8 import fp8_linears
from .gptq import gptq_linears
from .mxfp4 import mxfp4_experts
from .quant_layouts import from_awq
from .schema import take_tensor


def source_format(model_dir: str, config: ModelConfig, model_format: str | None) -> str:
    """How a (not converted) ``model_dir`` is read: 'hf', 'gguf', or the quantized format its config.json
    declares (``QUANT_METHODS``' values)."""
    declared = config.model_format
    if declared != 'hf' and model_format not in (None, declared):
        raise ModelFormatError(
            f"{model_dir} is a {declared} checkpoint (config.json quantization_config.quant_method "
            f"{config.quantization_config['quant_method']!r}) but model_format={model_format!r}; "
            f"use model_format={declared!r} or None")
    if declared == 'hf' and model_format in QUANTIZED_FORMATS:
        methods = ' or '.join(repr(m) for m, f in QUANT_METHODS.items() if f == model_format)
        raise ModelFormatError(f"model_format={model_format!r}, but {model_dir}/config.json has no "
                               f"quantization_config saying so (quant_method {methods})")
    if declared != 'hf' or model_format == 'hf':
        return declared
    return 'gguf'  # 'gguf' or None: a GGUF conversion's quantized matmuls, if it is one


def quantized_linears(fmt: str, weights: dict[str, torch.Tensor], quant_config: dict | None,
                      where: str = 'the checkpoint') -> dict[str, tuple]:
    """Take the quantized matmuls of a ``fmt`` checkpoint (one of ``QUANTIZED_FORMATS``, its tensors read as
    stored) out of ``weights``: HF weight name -> its layout (``quant_layouts.py``). FP8 matmuls are
    dequantized in place instead, into float32 ``X.weight``; so are MXFP4 experts, into bfloat16 ``X``."""
    readers = {'awq': awq_linears, 'w8a8': w8a8_linears, 'gptq': gptq_linears,
               'compressed-tensors': compressed_tensors_linears, 'fp8': fp8_linears, 'mxfp4': mxfp4_experts}
    return readers[fmt](weights, quant_config, where)


def awq_linears(weights: dict[str, torch.Tensor], quant_config: dict | None,
                where: str = 'the checkpoint') -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Take every AWQ linear (``X.qweight``, ``X.qzeros``, ``X.scales``) out of ``weights``:
    ``'X.weight'`` -> (qweight, scales, mins) in the W4A16 layout, exactly."""
    cfg = quant_config or {}
    group_size = cfg.get('group_size')
    checks = ((cfg.get('bits', 4) == 4, 'bits must be 4'),
              (cfg.get('zero_point', True), 'zero_point must be true'),
              (str(cfg.get('version', 'gemm')).lower() == 'gemm', "version must be 'gemm' (AutoAWQ's GEMM packing)"),
              (isinstance(group_size, int) and group_size > 0 and group_size % 32 == 0,
               "group_size must be a multiple of 32 (the W4A16 kernel's groups)"))
    for ok, problem in checks:
        if not ok:
            raise ModelFormatError(f'{where}: AWQ quantization_config {cfg}: {problem}')
    out = {}
    for base in [n[:-len('.qweight')] for n in weights if n.endswith('.qweight')]:
        qweight = take_tensor(weights, base + '.qweight', 'int32', where)
        qzeros = take_tensor(weights, base + '.qzeros', 'int32', where)
        scales = take_tensor(weights, base + '.scales', 'float', where)
        if scales.shape[0] * group_size != qweight.shape[0]:
            raise ModelFormatError(f'{where}: tensor {base + ".scales"!r} has {scales.shape[0]} groups, expected '
                                   f'K / group_size = {qweight.shape[0]} / {group_size}')
        try:
            out[base + '.weight'] = from_awq(qweight, qzeros, scales)
        except ValueError as e:
            raise ModelFormatError(f'{where}: AWQ linear {base!r}: {e}') from None
    if not out:
        raise ModelFormatError(f'{where}: config.json says quant_method awq, but there is no X.qweight tensor')
    return out


def w8a8_linears(weights: dict[str, torch.Tensor], quant_config: dict | None,
                 where: str = 'the checkpoint') -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Take every W8A8 linear (``X.weight`` int8, ``X.weight_scale``) out of ``weights``:
    ``'X.weight'`` -> (qweight int8 [N, K], scales float32 [N])."""
    cfg = quant_config or {}
    if cfg.get('bits', 8) != 8 or cfg.get('activation_scheme', 'dynamic_per_token') != 'dynamic_per_token':
        raise ModelFormatError(f'{where}: smooth_quant quantization_config {cfg}: TurboMind runs bits 8 with '
                               "activation_scheme 'dynamic_per_token'")
    out = {}
    for name in [n[:-len('_scale')] for n in weights if n.endswith('.weight_scale')]:
        qweight = take_tensor(weights, name, 'int8', where)
        scales = weights.pop(name + '_scale')
        n = qweight.shape[0]
        if not scales.is_floating_point() or tuple(scales.shape) not in ((n,), (n, 1)):
            raise ModelFormatError(f'{where}: tensor {name + "_scale"!r} is {scales.dtype} {list(scales.shape)}; '
                                   f'expected float [{n}] or [{n}, 1]')
        out[name] = (qweight.contiguous(), scales.float().reshape(n).contiguous())
    if not out:
        raise ModelFormatError(f'{where}: config.json says quant_method smooth_quant, but there is no '
                               'X.weight_scale tensor')
    return out
