"""The quantized matmul layouts the kernels run, and exact converters into them from GGUF and AWQ.

W4A16 (``ops.linear_w4a16``; the C++ side is ``lib/kernels/csrc/cpu/quant.h``), for a weight
``w[N, K]`` (out_features x in_features, as ``nn.Linear``) in groups of G consecutive k:

    qweight: uint8   [N, K // 2]   element k of row n in byte k // 2, low nibble = even k
    scales:  float32 [N, K // G]
    mins:    float32 [N, K // G]
    w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]        q in 0..15

Each source maps onto it exactly (the float32 dequantization is bit-for-bit the source's):

    GGUF Q4_0  w = d * (q - 8)      scale = d,  min = -8 d      (fp16 d, G = 32)
    GGUF Q4_1  w = d * q + m        scale = d,  min = m         (fp16 d and m, G = 32)
    GGUF Q4_K  w = (d sc) q - dmin m  scale = d sc, min = -(dmin m)  (eight groups of 32 a block)
    AWQ        w = (q - z) * s      scale = s,  min = -z s      (fp16 s, integer z)
    GPTQ, compressed-tensors int4   as AWQ (fp16 / bf16 s, integer z in 0..16; ``from_int4_groups``)

Groups that are not runs of consecutive k (GPTQ act-order: g_idx assigns each k a group) become runs
once k is permuted (``act_order``): the matmul then reads its input permuted, x[:, perm], and the
weight holds its k in perm's order. Such a W4A16 matmul is the tuple (qweight, scales, mins, perm).

W8A16 (``ops.linear_w8a16``): int8 weights in groups of G (a multiple of 32; of 16 in the panels
``ops.linear_w8a16_packed`` reads) with float scales,

    qweight: int8    [N, K]
    scales:  float32 [N, K // G]
    w[n, k] = q[n, k] * scales[n, k // G]

    GGUF Q8_0  w = d * q            scale = d                   (fp16 d, G = 32)
    GGUF Q5_0  w = d * (q - 16)     scale = d                   (fp16 d, G = 32)
    GGUF Q6_K  w = (d sc) (q - 32)  scale = d sc                (sixteen groups of 16 a block)

and any GGUF type without float mins (``gguf_as_w8a16``; the C++ is ``cpu/gguf.h``'s gguf_to_w8a16).

W8A8 (``ops.linear_w8a8``): ``qweight`` int8 [N, K] and per-output-channel ``scales``
float32 [N], w = qweight * scales[:, None]; activations are quantized per token inside
the kernel (``ops.quantize_per_token``).

A fused matmul keeps its format under ``<name>.qweight``, ``.scales`` (and ``.mins`` for W4A16);
the kernels tell the formats apart by what is there (mins; the scales' rank), and read the
group size of each matmul as K // scales.shape[1].

The checkpoints that hold them are read in ``source_format.py`` (AWQ, W8A8), ``gptq.py`` and
``compressed_tensors.py``.
"""
from __future__ import annotations

import numpy as np
import torch

# Nibble i (bits 4i..4i+3) of an AWQ int32 holds column AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GGUF_BLOCK = 32           # values per Q4_0 / Q4_1 block
Q4_0_BLOCK_BYTES = 18     # fp16 d, 16 bytes of nibbles
Q4_1_BLOCK_BYTES = 20     # fp16 d, fp16 m, 16 bytes of nibbles
Q8_0_BLOCK_BYTES = 34     # fp16 d, 32 int8
Q4_K_BLOCK, Q4_K_BLOCK_BYTES = 256, 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles


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


def _q4_k_scales_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sc: uint8 [..., 12] -> the eight 6-bit (scale, min) pairs of a Q4_K block, each int [..., 8]."""
    sc = sc.astype(np.int32)
    low, high = sc[..., 0:4], sc[..., 8:12]  # pairs 0..3 in 6 bits; pairs 4..7: low 4 bits here,
    scale = np.concatenate([low & 63, (high & 0xF) | ((low >> 6) << 4)], axis=-1)  # top 2 in bytes 0..3
    mins = np.concatenate([sc[..., 4:8] & 63, (high >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)  # and 4..7
    return scale, mins


def from_gguf_q4_k(raw, n: int, k: int):
    """GGUF Q4_K data of a [n, k] weight -> (qweight, scales, mins) of the W4A16 layout, group size 32.

    A Q4_K block holds 256 values in eight sub-blocks of 32: sub-block j's codes are the low (j even)
    or high (j odd) nibbles of bytes 32 (j // 2) ... + 31 of qs, and w = (d sc_j) q - (dmin m_j). Both
    products are exact in float32 (11-bit times 6-bit significands), so scale = d sc_j and
    min = -(dmin m_j) give w bit for bit, as ``gguf.quants.dequantize`` computes it."""
    if k % Q4_K_BLOCK:
        raise ValueError(f'K = {k} is not a multiple of the Q4_K block size {Q4_K_BLOCK}')
    data = np.ascontiguousarray(raw).view(np.uint8)
    if data.size != n * k // Q4_K_BLOCK * Q4_K_BLOCK_BYTES:
        raise ValueError(f'raw: {data.size} bytes, expected {n * k // Q4_K_BLOCK * Q4_K_BLOCK_BYTES} for [{n}, {k}]')
    blocks = data.reshape(n, k // Q4_K_BLOCK, Q4_K_BLOCK_BYTES)
    d, dmin = _fp16_field(blocks, 0).numpy(), _fp16_field(blocks, 2).numpy()
    sc, mn = _q4_k_scales_mins(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(n, k // Q4_K_BLOCK, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=3).reshape(n, k)  # chunk c: sub-blocks 2c (low), 2c + 1
    scales = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    mins = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
    return pack_int4(torch.from_numpy(np.ascontiguousarray(q))), torch.from_numpy(scales), torch.from_numpy(mins)


def from_gguf_q8_0(raw, n: int, k: int):
    """GGUF Q8_0 data of a [n, k] weight -> (qweight int8 [n, k], scales float32 [n, k // 32])."""
    blocks = _gguf_blocks(raw, n, k, Q8_0_BLOCK_BYTES)
    qweight = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
    return qweight, _fp16_field(blocks, 0)


# The GGUF block types whose matmuls run as W8A16 (in the 16-wide panels, 3-4x the block kernels' speed
# at batch 1; ``gguf_as_w8a16``): 8 bits a code where the file stores 8 (Q8_0), 5.5 (Q5_0) or 6.6 (Q6_K).
# Q4_0 has the W4A16 panels; IQ4_NL would take twice its bytes; the types with float mins have no W8A16 form.
W8A16_GGUF_TYPES = ('Q5_0', 'Q8_0', 'Q6_K')


def gguf_as_w8a16(runs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qweight int8 [N, K], scales float32 [N, K / G]): a matmul in runs of GGUF blocks (raw uint8, type
    int32 [1]; ``schema.gguf_runs``), each the next rows, as one W8A16 weight, the same weights exactly, when
    every run is of a type of ``W8A16_GGUF_TYPES`` and they share one group size G; else None."""
    from gguf import GGMLQuantizationType

    from lmd.kernels import gguf_to_w8a16, ops
    types = [int(t[0]) for _, t in runs]
    if any(GGMLQuantizationType(t).name not in W8A16_GGUF_TYPES for t in types) or \
            len({ops.gguf_w8a16_group(t) for t in types}) != 1:
        return None
    parts = [gguf_to_w8a16(raw, t) for (raw, _), t in zip(runs, types)]
    return tuple(torch.cat(fields).contiguous() for fields in zip(*parts))


def gguf_block_shape(raw: torch.Tensor, type_id: int) -> tuple[int, int]:
    """[N, K] of the weight that GGUF blocks raw uint8 [N, row bytes] of ggml type ``type_id`` hold."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(type_id))]
    return raw.shape[0], raw.shape[1] // nbytes * values


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols // 8] in AWQ's nibble order -> uint8 [rows, cols]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF     # [rows, cols // 8, nibble]
    out = torch.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles
    return out.reshape(packed.shape[0], -1).to(torch.uint8)


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols] in 0..15 (cols a multiple of 8) -> int32 [rows, cols // 8] in AWQ's nibble
    order (the inverse of ``awq_unpack``)."""
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
    q = awq_unpack(qweight).T.contiguous()                  # [N, K]
    z = awq_unpack(qzeros).T.float()                        # [N, K // G]
    s = scales.T.float().contiguous()
    return pack_int4(q), s, (-z * s).contiguous()            # z * s: exact in float32


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 packed along ``dim`` (0 or 1), nibble i (bits 4i..4i+3) of each word holding element 8 j + i
    of its eight along ``dim`` (GPTQ's and compressed-tensors' order) -> uint8 with 8x the size there."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 0:
        nibbles = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF   # [rows, 8, cols]
        return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF                       # [rows, cols, 8]
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def act_order(g_idx: torch.Tensor, num_groups: int) -> torch.Tensor | None:
    """g_idx int [K], the group of each k -> perm int32 [K]: k sorted by group (stably), so that permuted k j
    lies in group j // G, G = K / num_groups; None where that is the identity (g_idx = k // G).
    ValueError unless every group holds exactly G k."""
    k = g_idx.numel()
    g = g_idx.reshape(-1).to(torch.int64)
    if k % num_groups or int(g.min()) < 0 or int(g.max()) >= num_groups \
            or bool((torch.bincount(g, minlength=num_groups) != k // num_groups).any()):
        raise ValueError(f'g_idx does not give each of the {num_groups} groups K / {num_groups} = '
                         f'{k / num_groups:g} of the K = {k} inputs')
    perm = torch.sort(g, stable=True).indices
    return None if torch.equal(perm, torch.arange(k)) else perm.to(torch.int32)


def from_int4_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None):
    """w[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)] with g(k) = g_idx[k] (k // G without g_idx;
    q uint8 [N, K] in 0..15, zeros integers in 0..16, scales [N, K // G]) -> W4A16 (qweight, scales, mins),
    or (qweight, scales, mins, perm) over x[:, perm] where the groups are not runs (``act_order``).
    min = -z s: exact in float32 for 16-bit scales, as the product q s is."""
    (n, k), num_groups = q.shape, scales.shape[1]
    if k % num_groups or (k // num_groups) % 32:
        raise ValueError(f'{num_groups} groups of K = {k}: the group size must be a multiple of 32 '
                         '(the W4A16 kernel\'s groups)')
    s = scales.float().contiguous()
    mins = (-zeros.float() * s).contiguous()
    perm = None if g_idx is None else act_order(g_idx, num_groups)
    if perm is None:
        return pack_int4(q.contiguous()), s, mins
    return pack_int4(q[:, perm.long()].contiguous()), s, mins, perm


def dequantize_w8a8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of a W8A8 matmul (its activations are quantized at run time)."""
    return qweight.float() * scales[:, None]


def quantize_w8(w: torch.Tensor):
    """w [N, K] float -> (qweight int8 [N, K], scales float32 [N]): symmetric per output channel."""
    w = w.float()
    scales = w.abs().amax(dim=1) / 127
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    return torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8), scales
