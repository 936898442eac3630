"""compressed-tensors checkpoints (llm-compressor's; ``quant_method "compressed-tensors"``) read onto the
kernels: int4 weights in W4A16, int8 weights in W8A8 (with int8 activations) or W8A16 (without), exactly;
FP8 weights dequantized to float (``fp8.py``).

    config.json  "quantization_config": {"quant_method": "compressed-tensors", "format": F,
        "config_groups": {"group_0": {"targets": [...], "format": F (newer writers),
            "weights": {"type": "int" | "float", "num_bits": 4 | 8, "symmetric": ..., "strategy": "group" |
                        "channel" | "tensor" | "block", "group_size": G, "block_structure": [bn, bk]},
            "input_activations": null | {"type": "int", "num_bits": 8, "strategy": "token",
                                         "dynamic": true, "symmetric": true}}},
        "ignore": ["lm_head"], ...}

"pack-quantized", int4 (strategy "group"; "channel" is one group of K)::

    X.weight_packed      int32 [N, K // 8]       nibble i (bits 4i..4i+3) of word [n, c] is u[n, 8 c + i]
    X.weight_scale       fp16 / bf16 [N, K // G]
    X.weight_zero_point  int32 [N // 8, K // G]  asymmetric only: nibble i of word [r, g] is uz[8 r + i, g]
    X.weight_shape       int [2] = [N, K]
    X.weight_g_idx       int32 [K]               optional (actorder "group"): the group of each k, as GPTQ's

  The library quantizes to signed q in -8..7 (its zero points too) and packs u = q + 8 either way, so
  w[n, k] = (q - zp) s = (u[n, k] - uz[n, g]) * s[n, g], uz = 8 when symmetric: W4A16 with scale = s,
  min = -uz s (``quant_layouts.from_int4_groups``; with g_idx, over x[:, perm] as GPTQ act-order).

"int-quantized" / "naive-quantized", int8, symmetric::

    X.weight        int8 [N, K]
    X.weight_scale  float [N, 1] (per channel; [1] per tensor; [N, K // G] by groups, weight-only)
    w = weight * weight_scale

  With input_activations int8, dynamic per token, symmetric: W8A8, whose kernel quantizes each row of x
  by absmax / 127 as vLLM does; without input_activations: W8A16.

"float-quantized", FP8 e4m3: X.weight and X.weight_scale (per tensor, channel, group or block), dequantized;
the activation quantization is not run (X.input_scale dropped).

Layers in "ignore" are plain float tensors. Sparse (``sparsity_config``) and transformed
(``transform_config``) checkpoints, and other types, widths and activation schemes, are refused by name.
"""
from __future__ import annotations

import torch

from lmd.errors import ModelFormatError

from .fp8 import dequantize_fp8_linear
from .quant_layouts import from_int4_groups, unpack_nibbles
from .schema import take_tensor

FORMATS = ('pack-quantized', 'int-quantized', 'naive-quantized', 'float-quantized')
# input_activations the W8A8 kernel runs: (type, num_bits, strategy, dynamic, symmetric)
_W8A8_ACTIVATIONS = ('int', 8, 'token', True, True)


def _fail(where: str, field: str, problem: str):
    raise ModelFormatError(f'{where}: compressed-tensors quantization_config.{field}: {problem}')


def _check_config(cfg: dict, where: str) -> tuple[bool | None, tuple[int, int] | None]:
    """(whether int8 weights run with int8 activations, W8A8, or without, W8A16: None without int8 weights;
    the FP8 weights' scale block, if by blocks or groups) of a checked quantization_config."""
    sparsity = (cfg.get('sparsity_config') or {}).get('format', 'dense')
    if sparsity not in (None, 'dense'):
        _fail(where, 'sparsity_config.format', f'{sparsity!r}: lmd reads dense checkpoints')
    if cfg.get('transform_config'):
        _fail(where, 'transform_config', 'transformed weights (SpinQuant, QuIP) are not supported')
    groups = cfg.get('config_groups')
    if not isinstance(groups, dict) or not groups:
        _fail(where, 'config_groups', 'missing or empty')
    int8_activations, blocks = set(), set()
    for name, group in groups.items():
        field = f'config_groups.{name}'
        fmt = group.get('format') or cfg.get('format')
        if fmt not in FORMATS:
            _fail(where, f'{field}.format', f'{fmt!r} is not one of {", ".join(FORMATS)}')
        w, a = group.get('weights') or {}, group.get('input_activations')
        kind = (w.get('type'), w.get('num_bits'))
        if kind == ('int', 4) and a:
            _fail(where, f'{field}.input_activations', 'int4 weights run with float activations (W4A16)')
        elif kind == ('int', 8):
            if a and (a.get('type'), a.get('num_bits'), a.get('strategy'), a.get('dynamic'),
                      a.get('symmetric', True)) != _W8A8_ACTIVATIONS:
                _fail(where, f'{field}.input_activations', f'{a}: the W8A8 kernel quantizes activations to int8 '
                      'dynamically per token, symmetric')
            int8_activations.add(bool(a))
        elif kind == ('float', 8):
            if w.get('strategy') == 'block':
                blocks.add(tuple(w.get('block_structure') or ()))
            elif w.get('strategy') == 'group':
                blocks.add((1, w.get('group_size')))
        elif kind != ('int', 4):
            _fail(where, f'{field}.weights', f'type {kind[0]!r} with num_bits {kind[1]!r}: lmd reads int 4, int 8 '
                  'and float 8')
    if len(int8_activations) > 1 or len(blocks) > 1:
        _fail(where, 'config_groups', 'int8 weights with and without int8 activations, or FP8 weights in more '
              'than one block shape')
    return (next(iter(int8_activations), None), next(iter(blocks), None))


def _int4_linear(weights: dict[str, torch.Tensor], base: str, where: str) -> tuple:
    """pack-quantized ``base`` -> its W4A16 tuple (the module doc)."""
    packed = take_tensor(weights, base + '.weight_packed', 'int32', where)
    scale = take_tensor(weights, base + '.weight_scale', 'float', where)
    shape, zero_point = weights.pop(base + '.weight_shape', None), weights.pop(base + '.weight_zero_point', None)
    n, k = packed.shape[0], packed.shape[1] * 8
    num_groups = scale.shape[1]
    if shape is not None and shape.tolist() != [n, k]:
        raise ModelFormatError(f'{where}: tensor {base + ".weight_shape"!r} is {shape.tolist()}, but '
                               f'{base + ".weight_packed"!r} holds [{n}, {k}] (K a multiple of 32)')
    if scale.shape[0] != n:
        raise ModelFormatError(f'{where}: tensor {base + ".weight_scale"!r} is {list(scale.shape)}; expected [{n}, K // G]')
    if zero_point is None:
        zeros = torch.full((n, num_groups), 8.0)
    elif zero_point.dtype == torch.int32 and tuple(zero_point.shape) == (n // 8, num_groups) and n % 8 == 0:
        zeros = unpack_nibbles(zero_point, 0)
    else:
        raise ModelFormatError(f'{where}: tensor {base + ".weight_zero_point"!r} is {zero_point.dtype} '
                               f'{list(zero_point.shape)}; expected int32 [N // 8, K // G] = [{n // 8}, {num_groups}]')
    g_idx = weights.pop(base + '.weight_g_idx', None)
    try:
        if g_idx is not None and tuple(g_idx.shape) != (k,):
            raise ValueError(f'weight_g_idx: expected [K] = [{k}], got {list(g_idx.shape)}')
        return from_int4_groups(unpack_nibbles(packed, 1), zeros, scale, g_idx)
    except ValueError as e:
        raise ModelFormatError(f'{where}: compressed-tensors linear {base!r}: {e}') from None


def _int8_linear(weights: dict[str, torch.Tensor], base: str, int8_activations: bool, where: str) -> tuple:
    """int-quantized ``base`` -> W8A8 (qweight, scales [N]) or W8A16 (qweight, scales [N, K // G])."""
    qweight = take_tensor(weights, base + '.weight', 'int8', where)
    scale = weights.pop(base + '.weight_scale')
    zero_point = weights.pop(base + '.weight_zero_point', None)
    (n, k), name = qweight.shape, base + '.weight_scale'
    if zero_point is not None and bool(zero_point.any()):
        raise ModelFormatError(f'{where}: tensor {base + ".weight_zero_point"!r} is not zero: lmd runs symmetric int8')
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)
    groups = scale.shape[1] if scale.dim() == 2 and scale.shape[0] == n else 0
    if not scale.is_floating_point() or not groups or k % groups or (groups > 1 and (k // groups) % 32):
        raise ModelFormatError(f'{where}: tensor {name!r} is {scale.dtype} {list(scale.shape)}; expected float '
                               f'[{n}, 1], or [{n}, K // G] with G a multiple of 32')
    if int8_activations and groups > 1:
        raise ModelFormatError(f'{where}: tensor {name!r} has {groups} groups a row; W8A8 takes one scale a channel')
    if int8_activations:
        return qweight.contiguous(), scale.float().reshape(n).contiguous()
    return qweight.contiguous(), scale.float().contiguous()


def compressed_tensors_linears(weights: dict[str, torch.Tensor], quant_config: dict | None,
                               where: str = 'the checkpoint') -> dict[str, tuple]:
    """Take every quantized linear (``X.weight_scale`` and its weight) out of ``weights``: ``'X.weight'`` -> its
    W4A16, W8A8 or W8A16 tuple; FP8 weights are dequantized in ``weights`` instead (the module doc)."""
    int8_activations, fp8_block = _check_config(quant_config or {}, where)
    out, num_fp8 = {}, 0
    for base in sorted({n[:-len('.weight_scale')] for n in weights if n.endswith('.weight_scale')}):
        weight = weights.get(base + '.weight')
        if base + '.weight_packed' in weights:
            out[base + '.weight'] = _int4_linear(weights, base, where)
        elif weight is not None and weight.dtype == torch.int8:
            out[base + '.weight'] = _int8_linear(weights, base, bool(int8_activations), where)
        elif weight is not None and weight.dtype == torch.float8_e4m3fn:
            dequantize_fp8_linear(weights, base, fp8_block, where)
            num_fp8 += 1
        else:
            raise ModelFormatError(f'{where}: tensor {base + ".weight_scale"!r} belongs to no int4 '
                                   '(X.weight_packed), int8 or float8_e4m3fn X.weight')
    if not out and not num_fp8:
        raise ModelFormatError(f'{where}: config.json says quant_method compressed-tensors, but there is no '
                               'X.weight_scale tensor')
    return out
