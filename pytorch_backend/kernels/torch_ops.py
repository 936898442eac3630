"""Plain torch kernels: the reference every other backend is checked against, and the CPU path.

Layouts shared by every backend:
- activations are token-major: ``x[T, hidden]``, ``q[T, num_heads, head_dim]``,
  ``k, v[T, num_kv_heads, head_dim]``;
- k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; quantized
  (quant_policy 8 / 4, TurboMind's layout) they hold uint8 codes, ``head_dim`` or
  ``head_dim / 2`` bytes a row (two 4-bit codes a byte, low nibble = even d), and
  k_params, v_params ``[num_blocks, block_size, num_kv_heads, 2]`` float32 (scale, zero)
  with x = code * scale + zero: one asymmetric quantizer per (token, KV head) row,
  K quantized after RoPE (``quantize_kv``, the rule of TurboMind's ``kv_quantize_row``);
- cos_sin_cache: ``[max_position, rotary_dim]`` = ``cat(cos, sin)`` of the
  ``rotary_dim // 2`` frequencies, in the model dtype (HF rounds cos/sin to it too),
  applied NeoX style (``rotate_half``), as HF Llama/Qwen do.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..context import StepContext


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, round to x's dtype, then scale by weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The pre-norm residual stream: residual += x (in place), then rms_norm(residual)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q[T, Hq, D] and k[T, Hk, D] by their positions; returns new tensors.

    x * cos + rotate_half(x) * sin, with rotate_half(x) * sin written as
    roll(x, D/2) * cat(-sin, sin): three ops per tensor, same rounding as HF.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    rot = 2 * cos.shape[-1]
    if rot < q.shape[-1]:  # partial rotary: the tail passes through
        return _rotate_partial(q, cos, sin), _rotate_partial(k, cos, sin)
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((-sin, sin), dim=-1)
    return (torch.addcmul(q * cos, q.roll(rot // 2, -1), sin),
            torch.addcmul(k * cos, k.roll(rot // 2, -1), sin))


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]), dim=-1)


def prepare_linear(weight: torch.Tensor | tuple, bias: torch.Tensor | None):
    """weight: float [N, K], or a quantized matmul in a layout of ``lmd.weights.quant_layouts``:
    (qweight, scales, mins) W4A16, (qweight int8 [N, K], scales [N]) W8A8 or (qweight int8, scales
    [N, K / G]) W8A16; (raw uint8, type int32 [1]) GGUF blocks."""
    if isinstance(weight, torch.Tensor):
        return weight, bias
    if len(weight) == 3:
        return W4A16Linear(*weight, bias)
    if weight[0].dtype == torch.uint8:
        return GgufLinear(*weight, bias)
    return (W8A8Linear if weight[1].dim() == 1 else W8A16Linear)(*weight, bias)


def linear(x: torch.Tensor, params) -> torch.Tensor:
    """x[T, K] @ weight[N, K].T (+ bias)."""
    if type(params) is tuple:
        return F.linear(x, params[0], params[1])
    return params(x)


class W4A16Linear:
    """4-bit weights kept packed (qweight uint8 [N, K / 2], low nibble = even k; scales, mins
    float32 [N, K / G]); each call dequantizes them, w = q * scale + min, to x's dtype."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None):
        self.qweight, self.scales, self.mins, self.bias = qweight, scales, mins, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, num_groups = self.scales.shape
        q = torch.stack([self.qweight & 0xF, self.qweight >> 4], -1).view(n, num_groups, -1)
        w = (q.float() * self.scales[..., None] + self.mins[..., None]).view(n, -1).to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


class W8A16Linear:
    """int8 weights in groups of G k with float32 scales [N, K / G]; each call dequantizes them,
    w = q * scale, to x's dtype."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        self.qweight, self.scales, self.bias = qweight, scales, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        (n, k), num_groups = self.qweight.shape, self.scales.shape[1]
        w = (self.qweight.float().view(n, num_groups, -1) * self.scales[..., None]).view(n, k).to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


class GgufLinear:
    """GGUF blocks as stored (raw uint8 [N, row bytes], ggml type id int32 [1]), dequantized once by
    ``gguf.quants.dequantize`` (the format's own reference) to float32; each call casts to x's dtype."""

    def __init__(self, raw: torch.Tensor, type_id: torch.Tensor, bias: torch.Tensor | None):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        w = dequantize(raw.cpu().numpy(), GGMLQuantizationType(int(type_id[0])))
        self.weight, self.bias = torch.from_numpy(w).to(raw.device), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class W8A8Linear:
    """int8 weights with per-channel scales; activations quantized per token as the C++ kernel
    does: xq = round-half-even(x * 127 / absmax(row)), y = (xq @ qweight.T) * (absmax / 127) * scales."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        self.qweight, self.scales, self.bias = qweight, scales, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx = quantize_per_token(x)
        acc = xq.double() @ self.qweight.double().T           # the int32 dot products, exactly
        y = acc.float() * sx[:, None] * self.scales
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x[M, K] -> (xq int8 [M, K], sx float32 [M]) with x ~ xq * sx[:, None]."""
    x = x.float()
    absmax = x.abs().amax(-1)
    inv = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    return torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int8), absmax / 127


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] (GeGLU: HF's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate='tanh').mul_(up)


def clamped_swiglu(x: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """x[T, 2I] = [gate | up] -> gpt-oss's SwiGLU [T, I]: gate = min(gate, limit), up = clamp(up, -limit,
    limit), (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
        swiglu_limit: float | None = None, swiglu_alpha: float = 1.0, linear=None) -> torch.Tensor:
    """Routed SwiGLU experts as grouped matmuls: x[T, H], the experts' gate_up [E, 2I, H] and down
    [E, H, I], each token's experts topk_ids [T, k] and their weights topk_weights [T, k] -> [T, H].
    Options (gpt-oss): biases gate_up_bias [E, 2I] and down_bias [E, H] on each expert's matmuls, and
    ``clamped_swiglu`` at ``swiglu_limit`` in place of silu(gate) * up. Quantized experts: gate_up and down
    (or float experts the backend runs itself) are sequences of E matmuls as ``Kernels.prepare_linear`` made
    them, run by ``linear(rows, prepared)`` (a backend's ``Kernels.linear``), the biases added after.

    The (token, slot) pairs are sorted by expert (stably: within an expert, in token order), each
    expert with tokens runs its two matmuls over its rows at once, and the weighted rows are summed
    into their tokens in one scatter-add, in expert order per token as transformers adds them. The
    weights multiply in their own dtype (Mixtral's float32), the product rounded to x's dtype."""
    top_k = topk_ids.shape[1]
    expert_of = topk_ids.reshape(-1)
    order = torch.argsort(expert_of, stable=True)
    tokens = order // top_k
    counts = torch.bincount(expert_of, minlength=len(gate_up)).tolist()
    rows = x[tokens]
    out_rows = torch.empty_like(rows)

    def matmul(h: torch.Tensor, weights, biases: torch.Tensor | None, expert: int) -> torch.Tensor:
        if linear is not None:
            y = linear(h, weights[expert])
            return y if biases is None else y + biases[expert]
        return F.linear(h, weights[expert], None if biases is None else biases[expert])

    start = 0
    for expert, count in enumerate(counts):
        if count:
            part = slice(start, start + count)
            h = matmul(rows[part], gate_up, gate_up_bias, expert)
            h = silu_and_mul(h) if swiglu_limit is None else clamped_swiglu(h, swiglu_limit, swiglu_alpha)
            out_rows[part] = matmul(h, down, down_bias, expert)
            start += count
    weighted = (out_rows * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, weighted)


def quantize_kv(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x[..., D] -> (codes uint8 [..., D * bits / 8], params float32 [..., 2] = scale, zero), in float32:
    zero = min, scale = (max - min) / (2^bits - 1), code = round-half-even((x - zero) / scale)."""
    x = x.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    qmax = (1 << bits) - 1
    scale = (hi - lo) / qmax
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round((x - lo) * inv).clamp_(0, qmax).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, torch.cat([scale, lo], -1)


def dequantize_kv(codes: torch.Tensor, params: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_kv``: [..., D] in dtype."""
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)
    return (codes.float() * params[..., :1] + params[..., 1:]).to(dtype)


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_params: torch.Tensor | None = None,
                  v_params: torch.Tensor | None = None) -> None:
    """Write k, v[T, Hk, D] into the caches at slot_mapping[T] (block_id * block_size + offset);
    quantized with k_params, v_params given."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for x, cache, params in ((k, k_cache, k_params), (v, v_cache, v_params)):
        if params is None:
            cache.view(num_slots, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))
            continue
        codes, p = quantize_kv(x, 8 if cache.shape[-1] == x.shape[-1] else 4)
        cache.view(num_slots, *cache.shape[2:]).index_copy_(0, slot_mapping, codes)
        params.view(num_slots, *params.shape[2:]).index_copy_(0, slot_mapping, p)


def rope_fill_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                 apply_rotary=apply_rotary, fill_kv_cache=fill_kv_cache, k_params: torch.Tensor | None = None,
                 v_params: torch.Tensor | None = None) -> torch.Tensor:
    """Split a fused qkv[T, (Hq + 2 Hk) * D], rotate q and k, write k and v into the caches
    (quantized with k_params, v_params); returns the rotated q [T, Hq, D]."""
    num_tokens, head_dim = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    q, k = apply_rotary(q, k, positions, cos_sin_cache)
    if k_params is None:
        fill_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    else:
        fill_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_params=k_params, v_params=v_params)
    return q


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                    first_block: int = 0) -> torch.Tensor:
    """One sequence's cached K or V in order from block ``first_block`` on: [context_len - its first
    token, Hk, D]."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[first_block:num_blocks])
    return blocks.flatten(0, 1)[:context_len - first_block * block_size]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    ctx: StepContext, scale: float, k_params: torch.Tensor | None = None,
                    v_params: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the new tokens q[T, Hq, D] over each sequence's whole cached context.

    The new tokens of sequence i sit at positions context_len_i - query_len_i ...
    context_len_i - 1 and see every cached token at or before their own position (with
    ``window`` > 0, a sliding-window layer: the last ``window`` of them, itself included; the
    table's blocks wholly before every query's window are not read). ``softcap`` > 0: each scaled
    score s becomes tanh(s / softcap) * softcap before the softmax (Gemma 2). ``sinks`` (float32 [Hq],
    gpt-oss): each head's learned logit joins its softmax's denominator as a key without a value.
    Returns [T, Hq, D] in q's dtype; scores and softmax run in float32 for
    half-precision inputs (as HF eager does). A quantized cache (k_params, v_params)
    is read through a dequantized copy of the blocks the step uses.
    """
    if k_params is not None:
        k_cache, v_cache, ctx = _dequantized_blocks(q, k_cache, v_cache, k_params, v_params, ctx)
    if ctx.is_decode and not window and sinks is None:
        return _decode_attention(q, k_cache, v_cache, ctx, scale, softcap)
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(ctx.query_lens_list, ctx.context_lens_list)):
        out[start:start + q_len] = attend_one(q[start:start + q_len], k_cache, v_cache, ctx.block_tables[i],
                                              ctx_len, scale, window, softcap, sinks)
        start += q_len
    return out


def paged_latent_attention(q: torch.Tensor, cache: torch.Tensor, ctx: StepContext, scale: float,
                           v_dim: int) -> torch.Tensor:
    """Latent attention (DeepSeek-V2, ``lmd.weights.mla``): the new tokens' latent queries q[T, Hq, D]
    over one cache shared by every head, cache [num_blocks, block_size, 1, D], whose rows are the keys
    and whose first ``v_dim`` dims are the values; causal as ``paged_attention``, prefill chunks and
    decode alike. Returns [T, Hq, v_dim] in q's dtype."""
    out = q.new_empty((*q.shape[:2], v_dim))
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(ctx.query_lens_list, ctx.context_lens_list)):
        rows = _gather_context(cache, ctx.block_tables[i], ctx_len)
        out[start:start + q_len] = _prefill_one(q[start:start + q_len], rows, rows[..., :v_dim], scale)
        start += q_len
    return out


def _dequantized_blocks(q, k_cache, v_cache, k_params, v_params, ctx: StepContext):
    """The blocks ctx.block_tables names, dequantized to q's dtype, and a ctx renumbered onto them."""
    used, table = torch.unique(ctx.block_tables, return_inverse=True)
    bits = 8 if k_cache.shape[-1] == q.shape[-1] else 4
    k = dequantize_kv(k_cache[used], k_params[used], bits, q.dtype)
    v = dequantize_kv(v_cache[used], v_params[used], bits, q.dtype)
    return k, v, replace(ctx, block_tables=table.to(torch.int32), derived={})


def attend_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               context_len: int, scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's new tokens q[Lq, Hq, D], the last Lq of its context_len cached tokens (with a
    window, read from the first block any of them sees)."""
    first = max(0, context_len - q.shape[0] + 1 - window) // k_cache.shape[1] if window else 0
    k = _gather_context(k_cache, block_table, context_len, first)
    v = _gather_context(v_cache, block_table, context_len, first)
    return _prefill_one(q, k, v, scale, window, softcap, sinks)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                 softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q[Lq, Hq, D] against k, v[Lk, Hk, D]: the queries are the last Lq of the Lk positions; with a
    window, each sees its last ``window`` positions only."""
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gqa = num_heads != num_kv_heads
    if q_len == ctx_len and not window and not softcap and sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # bottom-right aligned causal mask: query j sits at position ctx_len - q_len + j
        qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
        kpos = torch.arange(ctx_len, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window) if window else kpos <= qpos
        if softcap or sinks is not None:
            out = _eager_attention(qh, kh, vh, mask, scale, softcap, sinks)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


def _eager_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over qh[Hq, Lq, D], kh, vh[Hk, Lk, D] spelled out in float32 (HF's eager attention): the
    scaled scores soft-capped before the mask (Gemma 2), and with ``sinks`` [Hq] a sink logit per head
    appended to each query's scores for the softmax and dropped after it (gpt-oss)."""
    group = qh.shape[0] // kh.shape[0]
    kh, vh = kh.repeat_interleave(group, 0).float(), vh.repeat_interleave(group, 0).float()
    scores = _softcapped(torch.matmul(qh.float(), kh.transpose(1, 2)).mul_(scale), softcap)
    scores.masked_fill_(~mask, float('-inf'))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, vh).to(qh.dtype)


def _softcapped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """tanh(s / softcap) * softcap in place; scores as they are where softcap is 0."""
    return scores.div_(softcap).tanh_().mul_(softcap) if softcap else scores


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      ctx: StepContext, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """One query per sequence. The B contexts are gathered padded to the longest and masked;
    GQA groups the query heads of one KV head so K/V are never repeated."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_len = ctx.max_context_len
    num_blocks = (max_len + block_size - 1) // block_size
    table = ctx.block_tables[:, :num_blocks]
    if batch == 1:
        table = table[0]
        # k: [Hk, L, D]
        k = k_cache.index_select(0, table).flatten(0, 1)[:max_len].transpose(0, 1)
        v = v_cache.index_select(0, table).flatten(0, 1)[:max_len].transpose(0, 1)
        qg = q.view(num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, k.transpose(1, 2))            # [Hk, G, L]
        probs = _softmax(scores, scale, q.dtype, softcap)
        return torch.matmul(probs, v).view(1, num_heads, head_dim)
    # k: [B, Hk, L, D]
    flat = table.flatten()
    gathered = (batch, num_blocks * block_size, num_kv_heads, head_dim)
    k = k_cache.index_select(0, flat).view(gathered)[:, :max_len].transpose(1, 2)
    v = v_cache.index_select(0, flat).view(gathered)[:, :max_len].transpose(1, 2)
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(2, 3))                 # [B, Hk, G, L]
    pad = None
    if min(ctx.context_lens_list) < max_len:
        lens = ctx.context_lens.to(device=q.device, dtype=torch.long)
        pad = (torch.arange(max_len, device=q.device)[None, :] >= lens[:, None])[:, None, None, :]
    probs = _softmax(scores, scale, q.dtype, softcap, pad)
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)


def _softmax(scores: torch.Tensor, scale: float, dtype: torch.dtype, softcap: float = 0.0,
             pad: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the last dim of the scaled (and soft-capped) scores, in float32; ``pad``: positions
    left out."""
    s = _softcapped(scores.float().mul_(scale) if scores.dtype != torch.float32 else scores.mul_(scale), softcap)
    if pad is not None:
        s.masked_fill_(pad, float('-inf'))
    return torch.softmax(s, dim=-1).to(dtype)
