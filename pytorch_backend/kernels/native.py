"""The kernel library's C++ CPU kernels (``lmd.kernels.ops``) behind the dispatch table.

They take over where torch is slow on a CPU: the matmuls (a GEMV at batch 1 that reads
the weights at close to memory bandwidth, a thin GEMM at batch 16 where MKL wastes time
packing; as fast as MKL for prefill chunks, and a row's result never depends on the
other rows), and attention straight from the paged cache for decode and prefill rows alike (torch
has to gather each context into a padded copy first), and the small ops of every layer, fused where torch would
run several: RMSNorm with the residual add, RoPE with the KV-cache write, SiLU-and-mul. Tensors cross into C++ as DLPack views, never
copied; weights are wrapped once at load.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack

from lmd.kernels import ops, pack_w4a16_panels, pack_w8a16_panels
from lmd.weights.schema import quant_format

from ..context import StepContext
from . import torch_ops


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NativeLinear:
    """A linear layer's weight [N, K] and bias [N], kept as torch tensors and as C++ views."""
    __slots__ = ('weight', 'bias', 'w_handle', 'b_handle', 'out_features')

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.w_handle = ops.HostTensor(to_dlpack(self.weight))
        self.b_handle = None if bias is None else ops.HostTensor(to_dlpack(self.bias))
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # every row count: a row's result is then bitwise the same whatever else is in the batch
        if x.stride(-1) != 1 or x.dtype not in _DTYPES:
            return F.linear(x, self.weight, self.bias)
        y = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        ops.linear(to_dlpack(x), self.w_handle, self.b_handle, to_dlpack(y))
        return y


class NativeQuantLinear:
    """A quantized matmul in a layout of ``lmd.weights.quant_layouts`` run by
    ``ops.linear_w4a16`` (qweight, scales, mins), ``ops.linear_w8a8`` (qweight int8, scales [N]) or
    ``ops.linear_w8a16_packed`` (qweight int8, scales [N, K / G], packed at load); the bias in float32,
    as those kernels take it; wrapped for C++ once, at load."""
    __slots__ = ('parts', 'bias', 'handles', 'b_handle', 'out_features', 'group_size')

    def __init__(self, parts: tuple, bias: torch.Tensor | None):
        self.parts = tuple(t.contiguous() for t in parts)
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = parts[0].shape[0]
        # None: W8A8; else the group size of W4A16 (two k a byte) or W8A16
        self.group_size = None if parts[1].dim() == 1 else \
            parts[0].shape[1] * (2 if len(parts) == 3 else 1) // parts[1].shape[1]
        if len(self.parts) == 3:  # W4A16 in TurboMind's panels: its broadcast-form kernel, 1.5x at 16 rows
            self.parts = pack_w4a16_panels(*self.parts)
        elif self.group_size is not None:  # W8A16 likewise (1.4-1.6x at 16 rows)
            self.parts = pack_w8a16_panels(*self.parts)
        self.handles = tuple(ops.HostTensor(to_dlpack(t)) for t in self.parts)
        self.b_handle = None if self.bias is None else ops.HostTensor(to_dlpack(self.bias))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        if self.group_size is None:
            ops.linear_w8a8(to_dlpack(x), *self.handles, self.b_handle, to_dlpack(y))
        elif len(self.parts) == 2:
            ops.linear_w8a16_packed(to_dlpack(x), *self.handles, self.b_handle, to_dlpack(y))
        else:
            ops.linear_w4a16_packed(to_dlpack(x), *self.handles, self.b_handle, to_dlpack(y))
        return y


class NativeGgufLinear:
    """A matmul of GGUF blocks as stored (raw uint8 [N, row bytes], ggml type id int32 [1]), run by
    ``ops.linear_gguf`` at the file's own bit width; the bias in float32."""
    __slots__ = ('raw', 'type_id', 'bias', 'handle', 'b_handle', 'out_features')

    def __init__(self, raw: torch.Tensor, type_id: torch.Tensor, bias: torch.Tensor | None):
        self.raw, self.type_id = raw.contiguous(), int(type_id[0])
        self.bias = None if bias is None else bias.float().contiguous()
        self.handle = ops.HostTensor(to_dlpack(self.raw))
        self.b_handle = None if self.bias is None else ops.HostTensor(to_dlpack(self.bias))
        self.out_features = raw.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        ops.linear_gguf(to_dlpack(x), self.handle, self.type_id, self.b_handle, to_dlpack(y))
        return y


def prepare_linear(weight: torch.Tensor | tuple, bias: torch.Tensor | None):
    if isinstance(weight, torch.Tensor):
        return NativeLinear(weight, bias)
    if quant_format(weight) == 'gguf':
        return NativeGgufLinear(*weight, bias)
    return NativeQuantLinear(weight, bias)


def linear(x: torch.Tensor, p) -> torch.Tensor:
    return p(x)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    ctx: StepContext, scale: float, k_params: torch.Tensor | None = None,
                    v_params: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    if q.dtype not in _DTYPES:
        return torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale, k_params=k_params, v_params=v_params,
                                         window=window, softcap=softcap, sinks=sinks)
    params = {} if k_params is None else dict(k_params=to_dlpack(k_params), v_params=to_dlpack(v_params))
    params['window'] = window
    params['softcap'] = softcap
    if sinks is not None:  # float32 [Hq] (the model keeps them so)
        params['sinks'] = to_dlpack(sinks)
    if ctx.is_decode:
        return _decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, params)
    # Prefill chunks too: each new token is a query over its own visible context (the
    # tokens up to its position), so one kernel serves every row of the step, and a
    # token's attention is computed the same way in a prefill chunk as in a decode step.
    tables = ctx.derived.get('native_row_tables')
    seq_of_row, visible = _row_prefixes(ctx)
    if tables is None:
        tables = ctx.derived['native_row_tables'] = ctx.block_tables.index_select(0, seq_of_row.long())
    return _decode_attention(q, k_cache, v_cache, tables, visible, scale, params)


def _row_prefixes(ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sequence of each row of the step, the tokens each row sees: its own visible prefix), int32
    [T] each; computed once a step (``ctx.derived``), for every layer's attention."""
    rows = ctx.derived.get('native_row_prefixes')
    if rows is None:
        seq_of_row = torch.repeat_interleave(torch.arange(ctx.num_seqs), ctx.query_lens.long())
        first_row = ctx.cu_query_lens[:-1].long().repeat_interleave(ctx.query_lens.long())
        history = (ctx.context_lens - ctx.query_lens).long()[seq_of_row]
        visible = (history + torch.arange(len(seq_of_row)) - first_row + 1).to(torch.int32)
        rows = ctx.derived['native_row_prefixes'] = (seq_of_row.to(torch.int32), visible)
    return rows


def paged_latent_attention(q: torch.Tensor, cache: torch.Tensor, ctx: StepContext, scale: float,
                           v_dim: int) -> torch.Tensor:
    """``torch_ops.paged_latent_attention`` by the kernel library's ``ops.paged_latent_attention``: every
    row of the step, prefill or decode, a query over its own visible prefix (as ``paged_attention``)."""
    if q.dtype not in _DTYPES:
        return torch_ops.paged_latent_attention(q, cache, ctx, scale, v_dim)
    q = q.contiguous()
    out = q.new_empty((*q.shape[:2], v_dim))
    if ctx.is_decode:
        ops.paged_latent_attention(to_dlpack(q), to_dlpack(cache), to_dlpack(ctx.block_tables),
                                   to_dlpack(ctx.context_lens), scale, to_dlpack(out))
        return out
    seq_of_row, visible = _row_prefixes(ctx)
    ops.paged_latent_attention(to_dlpack(q), to_dlpack(cache), to_dlpack(ctx.block_tables), to_dlpack(visible), scale,
                               to_dlpack(out), row_seqs=to_dlpack(seq_of_row))
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, params: dict) -> torch.Tensor:
    out = torch.empty_like(q)
    ops.paged_decode_attention(to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(block_tables),
                               to_dlpack(context_lens), scale, to_dlpack(out), **params)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in _DTYPES:  # e.g. Qwen3's per-head q/k norm
        return torch_ops.rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    ops.rms_norm(to_dlpack(x), to_dlpack(weight), eps, to_dlpack(out))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    ops.rms_norm(to_dlpack(x), to_dlpack(weight), eps, to_dlpack(out), to_dlpack(residual))
    return out


def rope_fill_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                 k_params: torch.Tensor | None = None, v_params: torch.Tensor | None = None) -> torch.Tensor:
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q = torch.empty((qkv.shape[0], num_heads, head_dim), dtype=qkv.dtype)
    params = {} if k_params is None else dict(k_params=to_dlpack(k_params), v_params=to_dlpack(v_params))
    ops.rope_fill_kv(to_dlpack(qkv), to_dlpack(positions), to_dlpack(cos_sin_cache), to_dlpack(k_cache),
                     to_dlpack(v_cache), to_dlpack(slot_mapping), to_dlpack(q), num_heads, num_kv_heads, **params)
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    ops.silu_and_mul(to_dlpack(x), to_dlpack(out))
    return out


def set_num_threads(n: int) -> None:
    ops.set_num_threads(n)
