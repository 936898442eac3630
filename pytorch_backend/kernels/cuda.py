"""The kernel library's CUDA kernels (``lmd.kernels.cuda``) behind the dispatch table: the GPU twin
of ``native.py``, with the same functions and the same argument rules.

What runs where:
- RMSNorm (fused with the residual add), SiLU-and-mul, RoPE fused with the KV-cache write
  (float, int8 and int4 caches) and paged attention (decode and prefill rows, float or quantized
  cache) are lmd's kernels;
- float matmuls are torch's ``F.linear`` (cuBLAS); W4A16 runs ``linear_w4a16`` (split-K) for
  M <= 8 rows and for float32 activations, ``linear_w4a16_mma`` (tensor cores) for M > 8 rows of
  float16 / bfloat16; W8A8 runs ``linear_w8a8``, which quantizes the activations per token itself
  (the ``quantize_per_token`` rule) before its int32 dot products;
- torch's op is borrowed where a kernel does not take the input: ``apply_rotary`` and
  ``fill_kv_cache`` (only Qwen3's per-head q/k norm path calls them separately), a dtype other
  than float32 / float16 / bfloat16, a tensor without unit stride in its last dim, int positions
  or slots that are not int64, an attention head_dim the kernel does not take (above 256, or not
  a multiple of the power of two >= head_dim / 32), a W4A16 group size that is not a multiple
  of 32, a W8A8 K above the kernel's limit.

Every call runs on torch's current stream of the current device (``torch.cuda.current_stream()``),
in order with torch's own work, and allocates its outputs (and attention's workspace) from torch's
caching allocator: no synchronisation and no host allocation per call. The kernels launch on the
current CUDA device, so ``get_kernels`` takes this backend for 'cuda' / 'cuda:0' only.

Not the default on CUDA yet ('triton' is): it becomes the default once it has passed
tests/test_gpu.py on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack

from lmd.kernels import cuda as kcuda

from ..context import StepContext
from . import torch_ops

if kcuda is None:
    raise ImportError('lmd was built without its CUDA kernels (lmd.kernels.cuda is None)')

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MMA_DTYPES = (torch.float16, torch.bfloat16)
_MMA_MIN_ROWS = 9          # linear_w4a16 (split-K) up to 8 rows, tensor cores from 9
_MAX_ATTENTION_HEAD_DIM = 256
_W8A8_MAX_K = 131072       # cpu::kW8A8MaxK: the int32 dot products would overflow beyond


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _attention_supports(head_dim: int) -> bool:
    """paged_attention_supports (cuda/paged_attention.cu): each of 32 lanes holds e elements,
    e the power of two >= head_dim / 32, and head_dim must be a multiple of e."""
    if head_dim < 1 or head_dim > _MAX_ATTENTION_HEAD_DIM:
        return False
    e = 1
    while e * 32 < head_dim:
        e *= 2
    return head_dim % e == 0


def _float_rows(x: torch.Tensor) -> bool:
    """A 2-D float tensor the kernels take: unit stride in its last dim."""
    return x.dim() == 2 and x.stride(-1) == 1 and x.dtype in _DTYPES


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it starting on a 16-byte boundary (the quantized matmuls read 16 bytes at a time)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# ---- matmuls ------------------------------------------------------------------------------------------

class CudaW4A16Linear:
    """4-bit weights (qweight uint8 [N, K / 2], scales, mins float32 [N, K / G]; lmd.weights.quant_layouts)
    and a float32 bias, as the kernels take them, on the weights' device."""
    __slots__ = ('qweight', 'scales', 'mins', 'bias', 'out_features', 'group_size', 'reference')

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None):
        self.qweight = _aligned16(qweight)
        self.scales = scales.float().contiguous()
        self.mins = mins.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = qweight.shape[0]
        self.group_size = qweight.shape[1] * 2 // scales.shape[1]
        # a group size the kernels do not take runs the torch reference on the same weights
        self.reference = None
        if self.group_size < 32 or self.group_size % 32:
            self.reference = torch_ops.W4A16Linear(qweight, scales, mins, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference is not None or x.dim() != 2 or x.dtype not in _DTYPES:
            return (self.reference or torch_ops.W4A16Linear(self.qweight, self.scales, self.mins, self.bias))(x)
        x = x.contiguous()
        y = torch.empty((x.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        kernel = kcuda.linear_w4a16_mma if (x.shape[0] >= _MMA_MIN_ROWS and x.dtype in _MMA_DTYPES) \
            else kcuda.linear_w4a16
        kernel(to_dlpack(x), to_dlpack(self.qweight), to_dlpack(self.scales), to_dlpack(self.mins),
               None if self.bias is None else to_dlpack(self.bias), to_dlpack(y), self.group_size, _stream())
        return y


class CudaW8A8Linear:
    """int8 weights [N, K] with per-channel float32 scales [N]; activations quantized per token by the
    kernel (torch_ops.W8A8Linear's rule, bitwise)."""
    __slots__ = ('qweight', 'scales', 'bias', 'out_features', 'reference')

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        self.qweight = _aligned16(qweight)
        self.scales = scales.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = qweight.shape[0]
        self.reference = torch_ops.W8A8Linear(qweight, scales, bias) if qweight.shape[1] > _W8A8_MAX_K else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference is not None or x.dim() != 2 or x.dtype not in _DTYPES:
            return (self.reference or torch_ops.W8A8Linear(self.qweight, self.scales, self.bias))(x)
        x = x.contiguous()
        y = torch.empty((x.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        kcuda.linear_w8a8(to_dlpack(x), to_dlpack(self.qweight), to_dlpack(self.scales),
                          None if self.bias is None else to_dlpack(self.bias), to_dlpack(y), _stream())
        return y


def prepare_linear(weight: torch.Tensor | tuple, bias: torch.Tensor | None):
    """A float weight stays (weight, bias) for F.linear; a quantized tuple gets its kernel's wrapper
    (W8A16 runs the torch reference)."""
    if isinstance(weight, torch.Tensor):
        return weight, bias
    if len(weight) == 3:
        return CudaW4A16Linear(*weight, bias)
    if weight[0].dtype == torch.uint8:  # GGUF blocks: dequantized once
        return torch_ops.GgufLinear(*weight, bias)
    return (CudaW8A8Linear if weight[1].dim() == 1 else torch_ops.W8A16Linear)(*weight, bias)


def linear(x: torch.Tensor, params) -> torch.Tensor:
    if type(params) is tuple:
        return F.linear(x, params[0], params[1])
    return params(x)


# ---- norms and activation -----------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 3 and x.dtype in _DTYPES:  # Qwen3's per-head q/k norm: [T, H, D] rows of D
        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    if not _float_rows(x) or weight.dtype != x.dtype:
        return torch_ops.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kcuda.rms_norm(to_dlpack(x), to_dlpack(weight.contiguous()), eps, to_dlpack(out), None, _stream())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place), then rms_norm(residual), in one kernel."""
    if (not _float_rows(x) or not _float_rows(residual) or residual.shape != x.shape
            or residual.dtype != x.dtype or weight.dtype != x.dtype):
        return torch_ops.add_rms_norm(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kcuda.rms_norm(to_dlpack(x), to_dlpack(weight.contiguous()), eps, to_dlpack(out), to_dlpack(residual),
                   _stream())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not _float_rows(x) or x.shape[1] % 2:
        return torch_ops.silu_and_mul(x)
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    kcuda.silu_and_mul(to_dlpack(x), to_dlpack(out), _stream())
    return out


# ---- RoPE + KV cache, attention -------------------------------------------------------------------------

def rope_fill_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                 k_params: torch.Tensor | None = None, v_params: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ops.rope_fill_kv in one kernel: returns the rotated q [T, Hq, D]."""
    if (not _float_rows(qkv) or positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64
            or cos_sin_cache.dtype != qkv.dtype):
        return torch_ops.rope_fill_kv(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads,
                                      num_kv_heads, k_params=k_params, v_params=v_params)
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q = torch.empty((qkv.shape[0], num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    params = {} if k_params is None else dict(k_params=to_dlpack(k_params), v_params=to_dlpack(v_params))
    kcuda.rope_fill_kv(to_dlpack(qkv), to_dlpack(positions.contiguous()), to_dlpack(cos_sin_cache),
                       to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(slot_mapping.contiguous()), to_dlpack(q),
                       num_heads, num_kv_heads, stream=_stream(), **params)
    return q


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    ctx: StepContext, scale: float, k_params: torch.Tensor | None = None,
                    v_params: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows read their own table; prefill rows (as native.py) are queries over their visible
    context, sharing their sequence's table through row_seqs. Float or quantized cache; with a
    window, each row's last ``window`` tokens; with ``sinks`` (float32 [Hq]), gpt-oss's sink logits. Soft-capped
    scores (Gemma 2): torch's, not in the kernel yet."""
    if q.dim() != 3 or q.dtype not in _DTYPES or not _attention_supports(q.shape[-1]) or softcap:
        return torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale, k_params=k_params, v_params=v_params,
                                         window=window, softcap=softcap, sinks=sinks)
    if ctx.is_decode:
        return _attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, None, scale, k_params, v_params,
                          window, sinks)
    rows = ctx.derived.get('cuda_rows')
    if rows is None:
        rows = ctx.derived['cuda_rows'] = _prefill_rows(ctx, q.shape[0], q.device)
    return _attention(q, k_cache, v_cache, ctx.block_tables, rows[1], rows[0], scale, k_params, v_params, window,
                      sinks)


def _prefill_rows(ctx: StepContext, num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_seqs, visible) int32 [T] on the device: each new token's sequence, and the tokens it sees
    (its history and the new tokens up to itself). output_size keeps repeat_interleave from
    reading the lengths back to the host."""
    query_lens = ctx.query_lens.to(device=device, dtype=torch.long)
    seq_of_row = torch.repeat_interleave(torch.arange(ctx.num_seqs, device=device), query_lens,
                                         output_size=num_rows)
    first_row = ctx.cu_query_lens[:-1].to(device=device, dtype=torch.long).repeat_interleave(
        query_lens, output_size=num_rows)
    history = (ctx.context_lens.to(device=device, dtype=torch.long) - query_lens)[seq_of_row]
    visible = history + torch.arange(num_rows, device=device) - first_row + 1
    return seq_of_row.to(torch.int32), visible.to(torch.int32)


def _attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, row_seqs: torch.Tensor | None, scale: float,
               k_params: torch.Tensor | None, v_params: torch.Tensor | None, window: int = 0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_rows, num_heads, head_dim = q.shape
    size = kcuda.paged_attention_workspace_size(num_rows, num_heads, head_dim,
                                                block_tables.shape[1] * k_cache.shape[1])
    # from torch's caching allocator, on torch's stream: no cudaMallocAsync inside the kernel
    workspace = None if size == 0 else torch.empty(size, dtype=torch.float32, device=q.device)
    params = {} if k_params is None else dict(k_params=to_dlpack(k_params), v_params=to_dlpack(v_params))
    kcuda.paged_decode_attention(
        to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(block_tables), to_dlpack(context_lens),
        scale, to_dlpack(out), stream=_stream(), row_seqs=None if row_seqs is None else to_dlpack(row_seqs),
        workspace=None if workspace is None else to_dlpack(workspace), window=window,
        sinks=None if sinks is None else to_dlpack(sinks), **params)
    return out
