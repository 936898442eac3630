"""TurboMind's quantized weight layouts, and converters into them from GGUF and AWQ.

W4A16 (``ops.linear_w4a16``; the C++ side is ``lib/kernels/csrc/cpu/quant.h``), for a weight
``w[N, K]`` (out_features x in_features, as ``nn.Linear``) in groups of G consecutive k:

    qweight: uint8   [N, K // 2]   element k of row n in byte k // 2, low nibble = even k
    scales:  float32 [N, K // G]
    mins:    float32 [N, K // G]
    w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]        q in 0..15

Each source maps onto it exactly (the float32 dequantization is bit-for-bit the source's):

    GGUF Q4_0  w = d * (q - 8)      scale = d,  min = -8 d      (fp16 d, G = 32)
    GGUF Q4_1  w = d * q + m        scale = d,  min = m         (fp16 d and m, G = 32)
    AWQ        w = (q - z) * s      scale = s,  min = -z s      (fp16 s, integer z)

W8A16 (``ops.linear_w8a16``): int8 weights in groups of G (a multiple of 32) with float scales,

    qweight: int8    [N, K]
    scales:  float32 [N, K // G]
    w[n, k] = q[n, k] * scales[n, k // G]

    GGUF Q8_0  w = d * q            scale = d                   (fp16 d, G = 32)

W8A8 (``ops.linear_w8a8``): ``qweight`` int8 [N, K] and per-output-channel ``scales``
float32 [N], w = qweight * scales[:, None]; activations are quantized per token inside
the kernel (``ops.quantize_per_token``).

A fused matmul keeps its format under ``<name>.qweight``, ``.scales`` (and ``.mins`` for W4A16);
the kernels tell the formats apart by what is there (mins; the scales' rank), and read the
group size of each matmul as K // scales.shape[1].

Quantized checkpoints TurboMind reads (``model_format``; ``None`` detects them from config.json):

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

import os

import numpy as np
import torch

# Nibble i (bits 4i..4i+3) of an AWQ int32 holds column AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GGUF_BLOCK = 32           # values per Q4_0 / Q4_1 block
Q4_0_BLOCK_BYTES = 18     # fp16 d, 16 bytes of nibbles
Q4_1_BLOCK_BYTES = 20     # fp16 d, fp16 m, 16 bytes of nibbles
Q8_0_BLOCK_BYTES = 34     # fp16 d, 32 int8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: uint8 [N, K] with values 0..15 (K even) -> qweight uint8 [N, K // 2]."""
    q = torch.as_tensor(q)
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f'q: expected a uint8 [N, K] tensor with even K, got {q.dtype} {list(q.shape)}')
    if q.numel() and int(q.max()) > 15:
        raise ValueError('q: values must be in 0..15')
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight uint8 [N, K // 2] -> q uint8 [N, K]."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def dequantize_w4a16(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] the W4A16 layout stands for (the tests' reference)."""
    q = unpack_int4(qweight).float()
    group_size = q.shape[1] // scales.shape[1]
    return q * scales.repeat_interleave(group_size, 1) + mins.repeat_interleave(group_size, 1)


def dequantize_w8a16(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] the W8A16 layout stands for (the tests' reference)."""
    (n, k), num_groups = qweight.shape, scales.shape[1]
    return (qweight.float().view(n, num_groups, k // num_groups) * scales[:, :, None]).view(n, k)


def _gguf_blocks(raw, n: int, k: int, block_bytes: int) -> np.ndarray:
    """Raw GGUF tensor data (rows of k values, k // 32 blocks each) as uint8 [n, k // 32, block_bytes]."""
    if k % GGUF_BLOCK:
        raise ValueError(f'K = {k} is not a multiple of the GGUF block size {GGUF_BLOCK}')
    data = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) \
        else np.ascontiguousarray(raw).view(np.uint8)
    want = n * (k // GGUF_BLOCK) * block_bytes
    if data.size != want:
        raise ValueError(f'raw: {data.size} bytes, expected {want} for [{n}, {k}] in {block_bytes}-byte blocks')
    return data.reshape(n, k // GGUF_BLOCK, block_bytes)


def _gguf_nibbles(qs: np.ndarray) -> torch.Tensor:
    """qs: uint8 [n, blocks, 16] -> q uint8 [n, blocks * 32]: value j < 16 is the low
    nibble of byte j, value j + 16 its high nibble."""
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    return torch.from_numpy(q.reshape(q.shape[0], -1).copy())


def _fp16_field(blocks: np.ndarray, offset: int) -> torch.Tensor:
    return torch.from_numpy(blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def from_gguf_q4_0(raw, n: int, k: int):
    """GGUF Q4_0 data of a [n, k] weight -> (qweight, scales, mins), group size 32."""
    blocks = _gguf_blocks(raw, n, k, Q4_0_BLOCK_BYTES)
    d = _fp16_field(blocks, 0)
    return pack_int4(_gguf_nibbles(blocks[..., 2:])), d, -8 * d


def from_gguf_q4_1(raw, n: int, k: int):
    """GGUF Q4_1 data of a [n, k] weight -> (qweight, scales, mins), group size 32."""
    blocks = _gguf_blocks(raw, n, k, Q4_1_BLOCK_BYTES)
    return pack_int4(_gguf_nibbles(blocks[..., 4:])), _fp16_field(blocks, 0), _fp16_field(blocks, 2)


def from_gguf_q8_0(raw, n: int, k: int):
    """GGUF Q8_0 data of a [n, k] weight -> (qweight int8 [n, k], scales float32 [n, k // 32])."""
    blocks = _gguf_blocks(raw, n, k, Q8_0_BLOCK_BYTES)
    qweight = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
    return qweight, _fp16_field(blocks, 0)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols // 8] in AWQ's nibble order -> uint8 [rows, cols]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF     # [rows, cols // 8, nibble]
    out = torch.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles
    return out.reshape(packed.shape[0], -1).to(torch.uint8)


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols] in 0..15 (cols a multiple of 8) -> int32 [rows, cols // 8] in AWQ's nibble
    order (the inverse of ``_awq_unpack``)."""
    q = q.to(torch.int32).reshape(q.shape[0], -1, 8)
    packed = torch.zeros(q.shape[:2], dtype=torch.int32)
    for i, col in enumerate(AWQ_ORDER):
        packed |= q[:, :, col] << (4 * i)
    return packed


def to_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """An [N, K] weight w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G] (q, zeros uint8 in
    0..15, scales fp16 [N, K // G]) -> AWQ GEMM tensors {'qweight', 'qzeros', 'scales'} (the inverse
    of ``from_awq``)."""
    if q.shape[0] % 8:
        raise ValueError(f'AWQ packs 8 output channels per int32: N = {q.shape[0]} is not a multiple of 8')
    return {'qweight': awq_pack(q.T), 'qzeros': awq_pack(zeros.T),
            'scales': scales.to(torch.float16).T.contiguous()}


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """AWQ (GEMM layout) -> (qweight, scales, mins) of the [N, K] weight.

    qweight int32 [K, N // 8], qzeros int32 [K // G, N // 8], scales fp16 [K // G, N];
    w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n], and the linear weight is w.T.
    """
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if scales.dim() != 2 or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f'scales: expected [K // G, N] = [K // G, {n}] with G dividing K = {k}, '
                         f'got {list(scales.shape)}')
    if tuple(qzeros.shape) != (scales.shape[0], n // 8):
        raise ValueError(f'qzeros: expected {[scales.shape[0], n // 8]}, got {list(qzeros.shape)}')
    q = _awq_unpack(qweight).T.contiguous()                  # [N, K]
    z = _awq_unpack(qzeros).T.float()                        # [N, K // G]
    s = scales.T.float().contiguous()
    return pack_int4(q), s, (-z * s).contiguous()            # z * s: exact in float32


_DTYPE_CHECKS = {'int32': lambda t: t.dtype == torch.int32, 'int8': lambda t: t.dtype == torch.int8,
                 'float': lambda t: t.is_floating_point()}


def _take(weights: dict[str, torch.Tensor], name: str, kind: str, where: str) -> torch.Tensor:
    """weights.pop(name): a 2-D tensor of ``kind`` ('int32', 'int8', 'float')."""
    from lmd.errors import ModelFormatError
    t = weights.pop(name, None)
    if t is None or t.dim() != 2 or not _DTYPE_CHECKS[kind](t):
        got = 'missing' if t is None else f'{t.dtype} {list(t.shape)}'
        raise ModelFormatError(f'{where}: tensor {name!r} is {got}; expected a 2-D {kind} tensor')
    return t


def awq_linears(weights: dict[str, torch.Tensor], quant_config: dict | None,
                where: str = 'the checkpoint') -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Take every AWQ linear (``X.qweight``, ``X.qzeros``, ``X.scales``) out of ``weights``:
    ``'X.weight'`` -> (qweight, scales, mins) in the W4A16 layout, exactly."""
    from lmd.errors import ModelFormatError
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
        qweight = _take(weights, base + '.qweight', 'int32', where)
        qzeros = _take(weights, base + '.qzeros', 'int32', where)
        scales = _take(weights, base + '.scales', 'float', where)
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
    from lmd.errors import ModelFormatError
    cfg = quant_config or {}
    if cfg.get('bits', 8) != 8 or cfg.get('activation_scheme', 'dynamic_per_token') != 'dynamic_per_token':
        raise ModelFormatError(f'{where}: smooth_quant quantization_config {cfg}: TurboMind runs bits 8 with '
                               "activation_scheme 'dynamic_per_token'")
    out = {}
    for name in [n[:-len('_scale')] for n in weights if n.endswith('.weight_scale')]:
        qweight = _take(weights, name, 'int8', where)
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


def dequantize_w8a8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of a W8A8 matmul (its activations are quantized at run time)."""
    return qweight.float() * scales[:, None]


def quantize_w8(w: torch.Tensor):
    """w [N, K] float -> (qweight int8 [N, K], scales float32 [N]): symmetric per output channel."""
    w = w.float()
    scales = w.abs().amax(dim=1) / 127
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    return torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8), scales


# The matmul weights TurboMind runs in W4A16 straight from a GGUF file.
_GGUF_W4_READERS = {'Q4_0': from_gguf_q4_0, 'Q4_1': from_gguf_q4_1}
_LINEAR_SUFFIXES = ('q_proj.weight', 'k_proj.weight', 'v_proj.weight', 'o_proj.weight',
                    'gate_proj.weight', 'up_proj.weight', 'down_proj.weight')


def read_gguf_w4a16(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF name -> (qweight, scales, mins) for every Q4_0 / Q4_1 matmul weight of a GGUF file,
    in the W4A16 layout (group size 32), bit-exact; llama.cpp's row permutation of q and k
    undone as ``lmd.gguf_model`` undoes it. Tensors of other types are left out (the caller
    takes them from the dequantized model)."""
    from lmd.gguf_model import GGUF_ARCHITECTURES, _fields, _hf_name, _open_reader, _unpermute_rope
    reader = _open_reader(path)
    meta = _fields(reader, path)
    arch = meta.get('general.architecture')
    heads = None
    if arch in GGUF_ARCHITECTURES and GGUF_ARCHITECTURES[arch][2]:
        n_head = int(meta.get(f'{arch}.attention.head_count', 0))
        n_kv = meta.get(f'{arch}.attention.head_count_kv', n_head)
        heads = {'q_proj.weight': n_head, 'k_proj.weight': int(n_kv[0] if isinstance(n_kv, list) else n_kv)}
    out = {}
    for t in reader.tensors:
        convert = _GGUF_W4_READERS.get(t.tensor_type.name)
        name = _hf_name(t.name, path)
        if convert is None or not name.endswith(_LINEAR_SUFFIXES):
            continue
        k, n = (int(d) for d in t.shape)  # GGUF lists dims fastest first
        qweight, scales, mins = convert(t.data, n, k)
        suffix = name.rsplit('.', 2)[-2] + '.weight'
        if heads is not None and suffix in heads:  # a row permutation: whole rows move, groups intact
            rows = torch.from_numpy(_unpermute_rope(np.arange(n), heads[suffix]).copy())
            qweight, scales, mins = qweight[rows], scales[rows], mins[rows]
        out[name] = (qweight.contiguous(), scales.contiguous(), mins.contiguous())
    return out


# Beside the converted model, in a folder of its own so weight loaders never mistake them for shards.
W4A16_CACHE_FILE = os.path.join('turbomind', 'w4a16.safetensors')
HEAD_W8A16_CACHE_FILE = os.path.join('turbomind', 'head_w8a16.safetensors')


def _gguf_source(model_dir: str) -> str | None:
    """The GGUF file ``lmd convert`` made ``model_dir`` from, if it is one and the file is still there."""
    import json

    from lmd.model_path import CONVERSION_MARKER
    marker = os.path.join(model_dir, CONVERSION_MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding='utf-8') as f:
        source = json.load(f).get('source')
    return source if source and os.path.isfile(source) else None


def _cached(model_dir: str, cache_file: str, build) -> dict[str, torch.Tensor] | None:
    """Flat tensors from model_dir/cache_file, or ``build(gguf_source)`` (None: nothing to cache),
    then written there atomically (skipped in a read-only directory). None when model_dir is
    not a GGUF conversion and has no cache."""
    import tempfile

    from safetensors.torch import load_file, save_file
    cache = os.path.join(model_dir, cache_file)
    if os.path.isfile(cache):
        return load_file(cache)
    source = _gguf_source(model_dir)
    if source is None:
        return None
    flat = build(source)
    if flat:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix='.cache-', suffix='.tmp', dir=os.path.dirname(cache))
            os.close(fd)
            save_file(flat, tmp)
            os.replace(tmp, cache)
        except OSError:
            pass
    return flat


def gguf_w4a16_for(model_dir: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """The W4A16 matmul weights of a directory that ``lmd convert`` made from a GGUF file
    (``read_gguf_w4a16``), cached in the directory; None for any other directory."""
    fields = ('qweight', 'scales', 'mins')

    def build(source):
        return {f'{n}.{f}': t for n, parts in read_gguf_w4a16(source).items() for f, t in zip(fields, parts)}
    flat = _cached(model_dir, W4A16_CACHE_FILE, build)
    if not flat:
        return None
    names = {k.rsplit('.', 1)[0] for k in flat}
    return {n: tuple(flat[f'{n}.{f}'] for f in fields) for n in names}


def gguf_head_w8a16_for(model_dir: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qweight int8, scales) of the lm_head of a GGUF conversion whose head (``output.weight``,
    or the tied ``token_embd.weight``) is Q8_0, bit-exact; None otherwise."""
    def build(source):
        head = read_gguf_head_q8_0(source)
        return None if head is None else {'qweight': head[0], 'scales': head[1]}
    flat = _cached(model_dir, HEAD_W8A16_CACHE_FILE, build)
    return None if not flat else (flat['qweight'], flat['scales'])


def read_gguf_head_q8_0(path: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    from lmd.gguf_model import _open_reader
    reader = _open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get('output.weight', tensors.get('token_embd.weight'))
    if t is None or t.tensor_type.name != 'Q8_0':
        return None
    k, n = (int(d) for d in t.shape)
    return from_gguf_q8_0(t.data, n, k)
