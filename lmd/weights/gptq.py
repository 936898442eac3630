"""GPTQ checkpoints (AutoGPTQ's layout, as Optimum, transformers and GPTQModel write it and ``lmd lite gptq``
too) read into the W4A16 layout of ``quant_layouts.py``, exactly.

    config.json  "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": G (-1: one group),
                                         "desc_act": false | true, "sym": true | false,
                                         "checkpoint_format": "gptq" (the default) | "gptq_v2"}
    X.qweight  int32 [K // 8, N]       nibble i (bits 4i..4i+3) of word [r, n] is q[k = 8 r + i, n]
    X.qzeros   int32 [K // G, N // 8]  nibble i of word [g, c] is the zero point of column n = 8 c + i:
                                       z - 1 in the 'gptq' format, z itself in 'gptq_v2'
    X.scales   fp16  [K // G, N]
    X.g_idx    int32 [K]               the group of each k: k // G, or with desc_act ("act-order") any
                                       assignment of G k to each group; may be left out where it is k // G
    w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

The zero points: AutoGPTQ packs z - 1 and the GPTQ kernels (AutoGPTQ's, exllama's, vLLM's gptq_gemm) add 1
back to each nibble, so a stored 15 reads as z = 16 (the -1 AutoGPTQ wrote for an asymmetric z = 0 reads
so there too); lmd reads them the same way, and the W4A16 layout holds z up to 16 (min = -z s). A symmetric
checkpoint stores z = 8 (0x77777777 in 'gptq'). GPTQModel's 'gptq_v2' (``checkpoint_format``, or
``format`` in its own config) stores z without the offset.

Onto W4A16: scale = s, min = -z s (exact in float32, as for AWQ). With act-order the groups are not runs
of consecutive k: k is sorted by g_idx (``quant_layouts.act_order``), the weight stored in that order
and the matmul reads x[:, perm] (y = x[:, perm] w[:, perm]^T = x w^T), which both engines gather before
the kernel. The parts of a fused matmul (q, k, v) each bring their own g_idx; where they differ they run
as parts (``schema.fuse_quantized``).
"""
from __future__ import annotations

import torch

from lmd.errors import ModelFormatError

from .quant_layouts import from_int4_groups, unpack_nibbles
from .schema import take_tensor

CHECKPOINT_FORMATS = {'gptq': 1, 'gptq_v2': 0}  # checkpoint_format -> what is added to a stored zero point


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              zero_offset: int):
    """One GPTQ linear (the module doc's tensors) -> W4A16 (qweight, scales, mins[, perm]) of its [N, K]
    weight; ``zero_offset`` 1 for the 'gptq' format, 0 for 'gptq_v2'. ValueError when the shapes disagree."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    num_groups = scales.shape[0]
    if scales.shape[1] != n:
        raise ValueError(f'scales: expected [K // G, N] with N = {n}, got {list(scales.shape)}')
    if tuple(qzeros.shape) != (num_groups, n // 8) or n % 8:
        raise ValueError(f'qzeros: expected {[num_groups, n // 8]} (N = {n} packed 8 a word), got {list(qzeros.shape)}')
    if g_idx is not None and (tuple(g_idx.shape) != (k,) or g_idx.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f'g_idx: expected int32 [K] = [{k}], got {g_idx.dtype} {list(g_idx.shape)}')
    q = unpack_nibbles(qweight, 0).T                                 # [N, K]
    zeros = unpack_nibbles(qzeros, 1).T.float() + zero_offset        # [N, K // G]
    return from_int4_groups(q, zeros, scales.T, g_idx)


def _check_config(cfg: dict, where: str) -> tuple[int | None, int]:
    """(group size, -1 read as None: one group of K; zero-point offset) of a GPTQ quantization_config."""
    group_size = cfg.get('group_size', 128)
    fmt = cfg.get('checkpoint_format', cfg.get('format', 'gptq'))
    checks = ((cfg.get('bits', 4) == 4, 'bits must be 4 (the W4A16 kernel)'),
              (fmt in CHECKPOINT_FORMATS, f"checkpoint_format {fmt!r} is not 'gptq' or 'gptq_v2'"),
              (isinstance(group_size, int) and (group_size == -1 or group_size > 0), 'group_size must be -1 or > 0'))
    for ok, problem in checks:
        if not ok:
            raise ModelFormatError(f'{where}: GPTQ quantization_config {cfg}: {problem}')
    return (None if group_size == -1 else group_size), CHECKPOINT_FORMATS[fmt]


def gptq_linears(weights: dict[str, torch.Tensor], quant_config: dict | None,
                 where: str = 'the checkpoint') -> dict[str, tuple]:
    """Take every GPTQ linear (``X.qweight``, ``X.qzeros``, ``X.scales``, ``X.g_idx``) out of ``weights``:
    ``'X.weight'`` -> its W4A16 tuple, exactly (the module doc)."""
    group_size, zero_offset = _check_config(quant_config or {}, where)
    out = {}
    for base in [n[:-len('.qweight')] for n in weights if n.endswith('.qweight')]:
        qweight = take_tensor(weights, base + '.qweight', 'int32', where)
        qzeros = take_tensor(weights, base + '.qzeros', 'int32', where)
        scales = take_tensor(weights, base + '.scales', 'float', where)
        g_idx = weights.pop(base + '.g_idx', None)
        k = qweight.shape[0] * 8
        if scales.shape[0] != (1 if group_size is None else k // group_size) or (group_size and k % group_size):
            raise ModelFormatError(f'{where}: tensor {base + ".scales"!r} has {scales.shape[0]} groups, but K = {k} '
                                   f'in groups of group_size {group_size or -1} from quantization_config')
        try:
            out[base + '.weight'] = from_gptq(qweight, qzeros, scales, g_idx, zero_offset)
        except ValueError as e:
            raise ModelFormatError(f'{where}: GPTQ linear {base!r}: {e}') from None
    if not out:
        raise ModelFormatError(f'{where}: config.json says quant_method gptq, but there is no X.qweight tensor')
    return out
