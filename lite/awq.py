"""AWQ: 4-bit weights in groups with zero points (W4A16), scaled by what the activations say.

Layer by layer over the calibration samples (``calibrate.run_layers``), for each group of
linears sharing an input (``scales.smooth_groups``):

1. scale search (``search_scale``): two families of candidates for r on the grid 0, 1/20, ..., 19/20,
   s = mean|x|^r and (AutoAWQ's duo scaling) s = mean|x|^r / mean|w|^(1-r), mean|w| being each input
   channel's weights relative to their quantization group's max, each normalised by
   sqrt(max s * min s); the weights W * s are fake-quantized, and the group's output error
   ||x W^T - (x / s) Q(W s)^T||^2 on a fixed sample of the calibration tokens decides the candidate
   (computed from the sample's gram matrix x^T x, so a step costs N K^2, not rows N K). r = 0 of the
   first family is plain round-to-nearest, so the search never does worse than RTN on that sample.
   The second family lifts the channels whose weights sit low in their groups, which the activations
   alone do not see: at full size it took the share of RTN's gap closed on Python source from 57.5%
   to 63.9% (prose 57.6% to 55.9%; ``benchmark/lite_quality.py``).
   1/s is folded into the producer (norm weight or preceding linear). Three choices make the
   scales hold up on text of another kind than the calibration's (``benchmark/lite_quality.py``
   measures it on Python source after calibrating on prose):
   - the grams are damped toward their mean diagonal (``GRAM_DAMP``): the search fits the
     calibration text's channel correlations less closely;
   - gate_proj / up_proj are searched by the error of the MLP's output (silu(x G^T) * (x U^T)
     through down_proj, on ``MLP_ROWS`` of the sample), not of their own outputs: an error in the
     gate matters as much as silu's slope and the up value let it through, as AutoAWQ measures a
     block's output;
   - o_proj is scaled under GQA too, its scales tied across the query heads that read one KV
     head (``scales.SmoothGroup.expand``), so that v_proj can take 1/s.
2. clip search (``search_clip``, AutoAWQ's auto_clip): per output channel and group, the weight
   range is shrunk to (1 - i/20) of its max, i < 10, where that lowers the group's partial output
   error; q_proj and k_proj are left alone (their errors are amplified by the softmax).

Then every linear is rounded to nearest (``quantize_w4``) and the checkpoint is written in
AutoAWQ's GEMM layout (``lmd.weights.quant_layouts.to_awq``), with everything else in float16.

LMDeploy's ``auto_awq`` searches r only with ``--search-scale`` and otherwise uses a fixed
smoothing; here the search is the default (it is what AWQ means and costs little), so
``--search-scale`` is accepted as is, ``--nosearch-scale`` uses the fixed r = 0.5, and ``--rtn``
skips calibration and scaling altogether (the baseline AWQ is compared with).
"""
from __future__ import annotations

import torch

from lmd.weights.quant_layouts import to_awq

from .calib_data import BUILTIN, calib_tokens
from .calibrate import load_float_model, run_layers
from .checkpoint import float_tensors, quantized_linears, write_checkpoint
from .scales import fold_scales, group_weight, smooth_groups

N_GRID = 20
SEARCH_ROWS = 4096   # calibration tokens per linear kept for the searches
MLP_ROWS = 2048      # of those, the ones the MLP-output search runs
# of the gram's mean diagonal, added to its diagonal for auto_awq's searches: 0.2 closed 61% / 64% of RTN's
# gap on the prose / code texts at 32 x 256 calibration tokens, 0.1 56% / 61%, 0.3 59% / 65%, 0.5 50% / 59%
# (gptq.SEARCH_DAMP: GPTQ's own scale search keeps 0.1)
GRAM_DAMP = 0.2
KERNEL_GROUP = 32    # TurboMind's W4A16 kernel takes group sizes that are multiples of this


def quantize_w4(w: torch.Tensor, group_size: int, sym: bool = False):
    """w [N, K] -> (q uint8 [N, K] in 0..15, scales fp16 [N, K // G], zeros uint8 [N, K // G]) with
    w ~ (q - zeros) * scales per group of G consecutive k. Asymmetric: the group's [min, max] spans
    0..15; symmetric: max |w| is 7 steps and zeros are 8. The fp16 scales are the ones rounded with."""
    q, scales, zeros = _codes(w, group_size, sym)
    return q.reshape(w.shape).to(torch.uint8), scales, zeros.to(torch.uint8)


def _codes(w: torch.Tensor, group_size: int, sym: bool):
    """quantize_w4's codes as float32 [N, K // G, G], its fp16 scales and float32 zeros [N, K // G]."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    scales, zeros = group_params(g, sym)
    return (torch.round(g / scales.float()[..., None]) + zeros[..., None]).clamp_(0, 15), scales, zeros


def group_params(g: torch.Tensor, sym: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """g [..., G] float32 weights of groups -> (scales fp16 [...], zeros float32 [...] in 0..15): asymmetric,
    the group's [min, max] spans 0..15; symmetric, max |w| is 7 steps and zeros are 8."""
    if sym:
        scales = (g.abs().amax(-1) / 7).clamp(min=1e-5).half()
        return scales, torch.full_like(scales, 8, dtype=torch.float32)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-5).half()
    return scales, torch.round(-lo / scales.float()).clamp(0, 15)


def dequantize_w4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    g = q.float().reshape(n, scales.shape[1], -1)
    return ((g - zeros.float()[..., None]) * scales.float()[..., None]).reshape(n, k)


def fake_quantize_w4(w: torch.Tensor, group_size: int, sym: bool = False) -> torch.Tensor:
    """The float32 weight ``w`` stands for once quantized: dequantize_w4(*quantize_w4(w, ...)) bit for bit (the
    same float operations; the codes 0..15 and zero points pass through uint8 exactly), without the round trip
    through uint8 (the scale and clip searches call this for every candidate: half their time before)."""
    q, scales, zeros = _codes(w, group_size, sym)
    return q.sub_(zeros[..., None]).mul_(scales.float()[..., None]).reshape(w.shape)


def output_error(dw: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """mean over tokens of |x dw^T|^2 per output row, from gram = x^T x / rows: dw [N, K] -> [N]."""
    return ((dw @ gram) * dw).sum(-1)


def damped(gram: torch.Tensor, damp: float = GRAM_DAMP) -> torch.Tensor:
    """gram + damp * mean(diag gram) * I."""
    return gram + damp * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)


def weight_absmean(w: torch.Tensor, group_size: int, num_channels: int, spread=None) -> torch.Tensor:
    """w [N, K] -> [C]: the mean over the outputs of |w| relative to its quantization group's max |w|, per
    input channel, averaged over the K inputs that each of the C producer channels feeds (``spread``)."""
    n, k = w.shape
    g = w.abs().reshape(n, k // group_size, group_size)
    per_k = (g / (g.amax(-1, keepdim=True) + 1e-6)).reshape(n, k).mean(0)
    if spread is None:
        return per_k
    index = spread(torch.arange(num_channels))
    total = torch.zeros(num_channels).index_add_(0, index, per_k)
    return total / torch.zeros(num_channels).index_add_(0, index, torch.ones(k))


def search_scale(gram: torch.Tensor, w: torch.Tensor, absmean: torch.Tensor, group_size: int, sym: bool = False,
                 ratios=None, error=None, spread=None, duo: bool = False) -> tuple[torch.Tensor, float, list[float]]:
    """gram [K, K] of the inputs x (x^T x / rows), w [N, K] the group's weights, absmean [C] per
    producer channel -> (s [C], best r, the error of each candidate). ``spread(s)`` gives the scale of
    each of the K inputs (default: s itself). The error of x W^T against (x / s) Q(W s)^T is that of
    the weight difference Q(W s) / s - W, a quadratic form in the gram; ``error(wq)``, given the group's
    fake-quantized weights Q(W s) / s [N, K], replaces it. ``duo``: the candidates s = absmean^r /
    weight_absmean^(1 - r) join (their best r is reported as 1 + r)."""
    ratios = [i / N_GRID for i in range(N_GRID)] if ratios is None else ratios
    x = absmean.clamp(min=1e-4)
    candidates = [(r, x.pow(r)) for r in ratios]
    if duo:
        wm = weight_absmean(w, group_size, len(absmean), spread)
        candidates += [(1 + r, x.pow(r) / (wm.pow(1 - r) + 1e-4)) for r in ratios]
    errors, best = [], None
    for r, s in candidates:
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        sk = s if spread is None else spread(s)
        wq = fake_quantize_w4(w * sk, group_size, sym) / sk
        errors.append(output_error(wq - w, gram).mean().item() if error is None else error(wq))
        if best is None or errors[-1] < best[0]:
            best = errors[-1], s, r
    return best[1], best[2], errors


def mlp_output_error(mlp, x: torch.Tensor):
    """error(wq) for the gate/up group of ``mlp`` over inputs x [rows, H]: the mean squared error of
    the MLP's output when gate_proj and up_proj (stacked in wq [2 I, H]) are replaced by wq."""
    gate, up, down = (m.weight.detach().float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    x = x.float()
    ref = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)

    def error(wq: torch.Tensor) -> float:
        g, u = wq.split(len(gate))
        return ((torch.nn.functional.silu(x @ g.T) * (x @ u.T) - ref) @ down.T).pow(2).mean().item()
    return error


def search_clip(gram: torch.Tensor, w: torch.Tensor, group_size: int, sym: bool = False) -> torch.Tensor:
    """gram [K, K] of the inputs, w [N, K] -> max |w| to clamp to, [N, K // G, 1], per output channel
    and group (AutoAWQ's auto_clip: shrink steps of 1/20, down to 0.55 of the max), chosen by the
    error of the group's partial output (the gram's diagonal blocks)."""
    n, k = w.shape
    num_groups = k // group_size
    blocks = gram.reshape(num_groups, group_size, num_groups, group_size).diagonal(dim1=0, dim2=2)
    blocks = blocks.permute(2, 0, 1)                          # [groups, G, G]
    wg = w.reshape(n, num_groups, group_size)
    max0 = wg.abs().amax(-1, keepdim=True)
    best_max, best_err = max0.clone(), torch.full(max0.shape, float('inf'))
    for i in range(N_GRID // 2):
        m = max0 * (1 - i / N_GRID)
        wq = fake_quantize_w4(torch.maximum(torch.minimum(wg, m), -m).reshape(n, k), group_size, sym)
        dw = (wq.reshape(wg.shape) - wg).transpose(0, 1)      # [groups, N, G]
        err = ((dw @ blocks) * dw).sum(-1).T[..., None]        # [N, groups, 1]
        better = err < best_err
        best_err, best_max = torch.where(better, err, best_err), torch.where(better, m, best_max)
    return best_max


def check_bits(w_bits: int) -> None:
    if w_bits != 4:
        raise ValueError(f'--w-bits {w_bits} is not supported: auto_awq writes 4-bit weights '
                         '(for 8-bit weights use lmd lite smooth_quant)')


def check_group_size(model, w_group_size: int) -> None:
    """ValueError naming the first linear whose in_features ``w_group_size`` does not divide (with the
    sizes that fit), or whose out_features do not pack into AWQ's int32s."""
    linears = quantized_linears(model)
    fits = [g for g in (256, 128, 64, 32) if all(m.in_features % g == 0 for m in linears.values())]
    hint = f'; sizes that fit every layer: {", ".join(map(str, fits))}' if fits else ''
    if w_group_size < KERNEL_GROUP or w_group_size % KERNEL_GROUP:
        raise ValueError(f'--w-group-size {w_group_size} is invalid: it must be a multiple of {KERNEL_GROUP}{hint}')
    for name, m in linears.items():
        if m.out_features % 8:
            raise ValueError(f'{name} has {m.out_features} out_features; 4-bit checkpoints pack them 8 to an int32')
        if m.in_features % w_group_size:
            raise ValueError(f'--w-group-size {w_group_size} does not divide the {m.in_features} in_features of '
                             f'{name}{hint}')


@torch.no_grad()
def awq_layer(layer, stats, group_size: int, sym: bool = False, ratios=None, clip: bool = False,
              damp: float = GRAM_DAMP, duo: bool = False) -> list[dict]:
    """Search and fold the scales of one decoder layer (and clip its weights) in place, on grams damped by
    ``damp``, with the duo-scaling candidates where ``duo``; returns per group {'linears', 'ratio', 'errors'}."""
    log = []
    for group in smooth_groups(layer, tied=True):
        x = stats[group.name].samples
        gram = damped(x.T @ x / len(x), damp)
        error = mlp_output_error(layer.mlp, x[:MLP_ROWS]) if group.name == 'mlp.gate_proj' else None
        s, ratio, errors = search_scale(gram, group_weight(group.linears), group.tie(stats[group.name].absmean),
                                        group_size, sym, ratios, error, group.spread, duo)
        fold_scales(group.producer, group.linears, s, group.expand)
        log.append({'linears': group.name, 'ratio': ratio, 'errors': errors})
        if clip:
            sk = group.spread(s)
            gram_scaled = gram / sk[:, None] / sk[None, :]  # of the scaled inputs x / s
            for linear in group.linears:
                if linear in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    continue  # their errors are amplified by the softmax
                m = search_clip(gram_scaled, linear.weight.float(), group_size, sym)
                w = linear.weight.reshape(m.shape[0], m.shape[1], -1)
                w.copy_(torch.maximum(torch.minimum(w, m.to(w.dtype)), -m.to(w.dtype)))
    return log


def awq_tensors(model, group_size: int, sym: bool = False) -> dict[str, torch.Tensor]:
    """The AWQ GEMM checkpoint's tensors of ``model``: its seven matmuls per layer rounded to nearest
    in 4 bits, everything else (embeddings, norms, biases, an untied lm_head) in float16."""
    linears = quantized_linears(model)
    out = float_tensors(model, skip={f'{name}.weight' for name in linears})
    for name, linear in linears.items():
        for field, t in to_awq(*quantize_w4(linear.weight.detach(), group_size, sym)).items():
            out[f'{name}.{field}'] = t
    return out


def _quant_config(w_group_size: int) -> dict:
    # zero_point stays true with --w-sym: symmetric weights are written with zeros of 8
    return dict(quant_method='awq', version='gemm', bits=4, group_size=w_group_size, zero_point=True)


def auto_awq(model: str, work_dir: str, calib_dataset: str = BUILTIN, calib_samples: int = 128,
             calib_seqlen: int = 512, batch_size: int = 4, w_bits: int = 4, w_sym: bool = False,
             w_group_size: int = 128, search_scale: bool = True, search_clip: bool = True,
             dtype: str = 'float32', log=None) -> str:
    """Quantize ``model`` with AWQ (see the module doc) into ``work_dir``; returns its path."""
    check_bits(w_bits)
    model_dir, hf, tokenizer = load_float_model(model, dtype)
    check_group_size(hf, w_group_size)
    tokens = calib_tokens(tokenizer, calib_dataset, calib_samples, calib_seqlen)
    ratios = None if search_scale else [0.5]

    def visit(i, layer, stats, kv):
        groups = awq_layer(layer, stats, w_group_size, w_sym, ratios, search_clip, duo=search_scale)
        if log is not None:
            log(i, groups)

    run_layers(hf, tokens, batch_size, visit, keep_rows=SEARCH_ROWS)
    return write_checkpoint(work_dir, model_dir, awq_tensors(hf, w_group_size, w_sym), _quant_config(w_group_size))


def quantize_rtn(model: str, work_dir: str, w_bits: int = 4, w_sym: bool = False, w_group_size: int = 128,
                 dtype: str = 'float32') -> str:
    """Plain round-to-nearest 4-bit weights (no calibration, no scales) in the same AWQ checkpoint
    layout: the baseline AWQ is measured against."""
    check_bits(w_bits)
    model_dir, hf, _ = load_float_model(model, dtype)
    check_group_size(hf, w_group_size)
    return write_checkpoint(work_dir, model_dir, awq_tensors(hf, w_group_size, w_sym), _quant_config(w_group_size))
