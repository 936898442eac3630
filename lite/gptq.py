"""GPTQ: 4-bit weights in groups with zero points (W4A16), each column's rounding error
compensated by the columns not yet quantized.

Layer by layer over the calibration samples (``calibrate.LayerwiseRunner``), each layer given
what the already-quantized layers before it output:

0. (``search_scale``, the default) AWQ's scale and clip searches (``awq.awq_layer``) on those
   inputs first: activation scales folded into the producers, weight ranges clipped. GPTQ then
   compensates the rounding of weights that quantize better to begin with; on SmolLM2 at g64 the
   two together close about 75% of round-to-nearest's perplexity gap on both held-out texts,
   either alone about 55%;
1. the layer runs over every sample with hooks summing H = X^T X / rows of each input that
   linears share (``GROUPS``: q/k/v, o, gate/up, down);
2. each group of linears (stacked along the outputs: the same columns, the same H) is quantized
   by ``gptq_quantize``;
3. the layer runs again with the quantized weights; its outputs are the next layer's inputs.

``gptq_quantize`` minimises ||X W^T - X Q^T||^2 column by column: with U the upper Cholesky
factor of H^-1 (H damped by ``damp`` x its mean diagonal), column k is rounded to nearest in
its group's grid, and its error e = (w_k - q_k) / U[k, k] moves onto the later columns,
w_j -= e U[k, j]. The columns go in order of decreasing H[k, k] (act-order: the inputs that
carry the most go first, while the most columns are left to absorb their error); each group's
scale and zero point are fixed beforehand from its weights' range ("static groups"), so the
groups stay K's consecutive runs and the checkpoint needs no permutation (``desc_act: false``).
The updates are applied inside blocks of ``BLOCK`` columns and to the rest once per block (the
same result, fewer passes over W).

The checkpoint is AutoGPTQ's v1 layout (``to_gptq``), which Optimum and transformers read:

    X.qweight  int32 [K // 8, N]    q[n, k] in bits 4 (k % 8) .. of qweight[k // 8, n]
    X.qzeros   int32 [K // G, N // 8]   zero[n, g] - 1 in bits 4 (n % 8) .. of qzeros[g, n // 8]
    X.scales   fp16  [K // G, N]
    X.g_idx    int32 [K]            the group of input channel k: k // G (no act-order)
    w[n, k] = (q[n, k] - zero[n, k // G]) * scales[k // G, n]

with ``quantization_config {quant_method: gptq, bits: 4, group_size, desc_act: false, sym,
checkpoint_format: gptq}``; everything else float16, a tied head stays tied. v1 stores zero - 1,
so zero points are kept in 1..15 (``--w-sym``: 8).
"""
from __future__ import annotations

import torch

from .awq import SEARCH_ROWS, awq_layer, check_bits, check_group_size, dequantize_w4, group_params
from .calib_data import BUILTIN, calib_tokens
from .calibrate import LayerwiseRunner, hook_input_stats, load_float_model
from .checkpoint import float_tensors, write_checkpoint

GROUPS = (('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj'), ('self_attn.o_proj',),
          ('mlp.gate_proj', 'mlp.up_proj'), ('mlp.down_proj',))
BLOCK = 128  # columns whose updates are applied lazily together
DAMP = 0.1   # of H's mean diagonal; GPTQ's 0.01 left SmolLM2's linears more error on held-out code
SEARCH_DAMP = 0.1  # the AWQ scale search's gram damping before GPTQ (auto_awq's own is awq.GRAM_DAMP, 0.2)
PACK = 8     # 4-bit values per int32


class Hessian:
    """H = X^T X / rows [K, K] of every input row a linear is given, summed in float64."""

    def __init__(self):
        self.sum, self.rows = None, 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        xtx = (x.T @ x).double()
        self.sum = xtx if self.sum is None else self.sum + xtx
        self.rows += len(x)

    @property
    def h(self) -> torch.Tensor:
        return self.sum / self.rows


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp * mean(diag H) I)^-1, float32 [K, K]."""
    h = h.double() + damp * h.diagonal().mean() * torch.eye(len(h), dtype=torch.float64)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, sym: bool = False, damp: float = DAMP):
    """w [N, K], h [K, K] of the inputs -> (q uint8 [N, K] in 0..15, scales fp16 [N, K // G], zeros uint8
    [N, K // G] in 1..15), w ~ (q - zeros) * scales (see the module doc)."""
    n, k = w.shape
    w, h = w.float().clone(), h.clone()
    dead = h.diagonal() == 0  # inputs that are always zero: any weight does, 0 costs nothing
    h[dead, dead] = 1
    w[:, dead] = 0
    scales, zeros = group_params(w.reshape(n, k // group_size, group_size), sym)
    zeros = zeros.clamp(min=1)
    order = torch.argsort(h.diagonal(), descending=True)  # the columns with the largest inputs first
    w, h = w[:, order], h[order][:, order]
    steps, zero_points = scales.float()[:, order // group_size], zeros[:, order // group_size]  # [N, K], as w
    u = _inverse_cholesky(h, damp)
    q = torch.empty(n, k)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        wb, err = w[:, b0:b1], torch.empty(n, b1 - b0)
        for j in range(b1 - b0):
            col = b0 + j
            step, zero = steps[:, col], zero_points[:, col]
            q[:, col] = (torch.round(wb[:, j] / step) + zero).clamp(0, 15)
            err[:, j] = (wb[:, j] - (q[:, col] - zero) * step) / u[col, col]
            wb[:, j + 1:] -= err[:, j, None] * u[col, col + 1:b1]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    q[:, order] = q.clone()
    return q.to(torch.uint8), scales, zeros.to(torch.uint8)


def _pack_rows(v: torch.Tensor) -> torch.Tensor:
    """v [R, C] with values 0..15, R a multiple of 8 -> int32 [R // 8, C]: row r in bits 4 (r % 8)."""
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int64)[None, :, None]
    packed = (v.to(torch.int64).reshape(-1, PACK, v.shape[1]) << shifts).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def to_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """q uint8 [N, K], scales fp16 [N, K // G], zeros uint8 [N, K // G] in 1..15 -> the v1 layout's
    qweight, qzeros, scales, g_idx (see the module doc)."""
    n, k = q.shape
    if n % PACK or k % PACK:
        raise ValueError(f'N = {n} and K = {k} must be multiples of {PACK} to pack into int32s')
    if int(zeros.min()) < 1:
        raise ValueError('zero points must be in 1..15: the GPTQ v1 layout stores zero - 1')
    group_size = k // scales.shape[1]
    return {'qweight': _pack_rows(q.T),
            'qzeros': _pack_rows(zeros.to(torch.int64) - 1).T.contiguous(),
            'scales': scales.T.contiguous(),
            'g_idx': torch.arange(k, dtype=torch.int32) // group_size}


@torch.no_grad()
def search_scales(runner: LayerwiseRunner, i: int, group_size: int, sym: bool = False) -> list[dict]:
    """AWQ's scale and clip searches on decoder layer ``i`` over the inputs ``runner`` holds, folded
    into the layer in place (its float output kept but for the clipping); returns awq_layer's log."""
    stats, hooks = hook_input_stats(runner, i, SEARCH_ROWS)
    try:
        runner.run(i, update=False)
    finally:
        for hook in hooks:
            hook.remove()
    return awq_layer(runner.layers[i], stats, group_size, sym, clip=True, damp=SEARCH_DAMP)


@torch.no_grad()
def gptq_layer(runner: LayerwiseRunner, i: int, group_size: int, sym: bool = False, damp: float = DAMP,
               search_scale: bool = True) -> dict:
    """Quantize decoder layer ``i`` in place on the inputs ``runner`` holds (after AWQ's searches with
    ``search_scale``), then push them through it; returns its linears' (q, scales, zeros) by their
    names in the layer (``mlp.down_proj``)."""
    if search_scale:
        search_scales(runner, i, group_size, sym)
    layer = runner.layers[i]
    hessians = {names: Hessian() for names in GROUPS}
    hooks = [layer.get_submodule(names[0]).register_forward_hook(lambda m, args, out, hs=hs: hs.add(args[0]))
             for names, hs in hessians.items()]
    try:
        runner.run(i, update=False)
    finally:
        for hook in hooks:
            hook.remove()
    out = {}
    for names, hs in hessians.items():
        linears = [layer.get_submodule(name) for name in names]
        q, scales, zeros = gptq_quantize(torch.cat([m.weight for m in linears]), hs.h, group_size, sym, damp)
        start = 0
        for name, m in zip(names, linears):
            rows = slice(start, start + m.out_features)
            out[name] = q[rows], scales[rows], zeros[rows]
            m.weight.copy_(dequantize_w4(*out[name]).to(m.weight.dtype))
            start += m.out_features
    runner.run(i)
    return out


def _quant_config(w_group_size: int, w_sym: bool) -> dict:
    return dict(quant_method='gptq', bits=4, group_size=w_group_size, desc_act=False, sym=w_sym,
                checkpoint_format='gptq')


def gptq(model: str, work_dir: str, calib_dataset: str = BUILTIN, calib_samples: int = 128, calib_seqlen: int = 512,
         batch_size: int = 4, w_bits: int = 4, w_sym: bool = False, w_group_size: int = 128, damp: float = DAMP,
         dtype: str = 'float32', log=None, search_scale: bool = True) -> str:
    """Quantize ``model`` with GPTQ (see the module doc; ``search_scale``: AWQ's searches first) into
    ``work_dir``; returns its path. ``log(i, seconds)`` after each layer."""
    import time
    check_bits(w_bits)
    if not 0 <= damp < 1:
        raise ValueError(f'--damp must be in [0, 1), got {damp}')
    model_dir, hf, tokenizer = load_float_model(model, dtype)
    check_group_size(hf, w_group_size)
    runner = LayerwiseRunner(hf, calib_tokens(tokenizer, calib_dataset, calib_samples, calib_seqlen), batch_size)
    tensors = {}
    for i in range(len(runner.layers)):
        start = time.perf_counter()
        for name, packed in gptq_layer(runner, i, w_group_size, w_sym, damp, search_scale).items():
            for field, t in to_gptq(*packed).items():
                tensors[f'model.layers.{i}.{name}.{field}'] = t
        if log is not None:
            log(i, time.perf_counter() - start)
    tensors.update(float_tensors(hf, skip={name.rsplit('.', 1)[0] + '.weight' for name in tensors}))
    return write_checkpoint(work_dir, model_dir, tensors, _quant_config(w_group_size, w_sym))
