"""Tensor parallelism for a Llama-family checkpoint: which rows and columns of each HF tensor a rank holds.

With ``tp`` ranks, rank r holds (Megatron's split, as vLLM and LMDeploy shard):

- attention by heads: q's heads ``[r Hq/tp, (r+1) Hq/tp)``; K/V heads likewise when Hk >= tp, else the one
  KV head its q heads read (``kv_heads``: replicated over tp / Hk ranks); ``o_proj`` the matching columns;
- the MLP by columns of I: gate/up rows ``[r I/tp, (r+1) I/tp)``, down_proj the matching columns;
- a mixture of experts' experts each by columns of their own intermediate size as the MLP, the shared
  expert (Qwen2-MoE) by its own; the router and the shared expert's gate replicated, so every rank routes
  every token alike and the all-reduce after the MLP sums the experts' partial products (gpt-oss's
  stacked, interleaved experts and latent attention are refused);
- the vocabulary by rows: embedding and lm_head rows ``[r V/tp, (r+1) V/tp)`` (``vocab_range``; V rounded
  up to a multiple of tp, the last rank's rows padded with zeros).

So a rank's attention and MLP produce partial sums of the hidden state: one all-reduce after o_proj and one
after down_proj; a bias on them is held by rank 0 alone (the others hold zeros), so the sum adds it once.
The embedding's lookup is an all-reduce too (each rank fills the ids of its rows); the logits an
all-gather. ``shard_config`` is the config a rank's model is built from: its heads and its I.

Quantized matmuls (``quant_layouts``; a tuple standing for its [N, K] weight) are sharded by their groups:
rows of every field for a split along N, the group columns for a split along K, which must fall on group
(or GGUF block) boundaries. W8A8 quantizes its input per token over all of K, so a K split would change
its numbers: refused, as are GPTQ act-order matmuls (their input permutation spans K).
"""
from __future__ import annotations

import dataclasses

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig

from .moe import expert_weight_names, shared_expert_names
from .schema import dense_shape, quant_format
from .stacked_experts import has_stacked_experts


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """ModelFormatError unless ``config``'s model shards over ``tp`` ranks."""
    if tp == 1:
        return
    arch = config.architecture
    if config.mla is not None:
        raise ModelFormatError(f'{arch}: tensor parallelism (tp={tp}) runs multi-head attention models; its '
                               'latent attention is not sharded yet')
    moe = config.moe
    if moe is not None and has_stacked_experts(config):
        raise ModelFormatError(f'{arch}: tp={tp}: its experts come stacked and interleaved (gpt-oss); they are not '
                               'sharded yet')
    if moe is not None and (moe.intermediate_size % tp or moe.shared_intermediate_size % tp):
        raise ModelFormatError(f'{arch}: tp={tp} must divide the experts\' intermediate size '
                               f'{moe.intermediate_size}' + (f' and the shared expert\'s {moe.shared_intermediate_size}'
                                                             if moe.shared_intermediate_size else ''))
    if config.qk_norm_all_heads:
        raise ModelFormatError(f'{arch}: tp={tp}: its q/k norm spans all heads at once, which no rank holds')
    hq, hk = config.num_heads, config.num_kv_heads
    if hq % tp:
        raise ModelFormatError(f'{arch}: tp={tp} must divide the {hq} attention heads')
    if hk % tp and tp % hk:
        raise ModelFormatError(f'{arch}: tp={tp} must divide the {hk} KV heads or be a multiple of them')
    if config.intermediate_size % tp and (moe is None or not all(moe.sparse_layers)):
        raise ModelFormatError(f'{arch}: tp={tp} must divide intermediate_size {config.intermediate_size}')


def kv_heads(config: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """[first, end) of the KV heads rank ``rank`` holds."""
    hk = config.num_kv_heads
    if hk >= tp:
        return rank * hk // tp, (rank + 1) * hk // tp
    first = rank * hk // tp  # the KV head its q heads read
    return first, first + 1


def vocab_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """[first, end) of the vocabulary rows rank ``rank`` holds: ceil(V / tp) each, the last fewer."""
    per = -(-vocab_size // tp)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


def shard_config(config: ModelConfig, rank: int, tp: int) -> ModelConfig:
    """The config of rank ``rank``'s model: its q and KV heads, its columns of I and its rows of the
    vocabulary, ceil(V / tp) (head_dim stays)."""
    if tp == 1:
        return config
    first, end = kv_heads(config, rank, tp)
    moe = config.moe and dataclasses.replace(config.moe, intermediate_size=config.moe.intermediate_size // tp,
                                             shared_intermediate_size=config.moe.shared_intermediate_size // tp)
    return dataclasses.replace(config, num_heads=config.num_heads // tp, num_kv_heads=end - first,
                               intermediate_size=config.intermediate_size // tp,
                               vocab_size=-(-config.vocab_size // tp), moe=moe)


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor], quantized: dict[str, tuple],
                  rank: int, tp: int) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """Rank ``rank``'s part of (``weights``, ``quantized``) (HF names; see the module docstring). The
    embedding and lm_head keep their names, holding rows ``vocab_range`` padded to ceil(V / tp)."""
    if tp == 1:
        return weights, quantized
    check_tensor_parallel(config, tp)
    D, hq, I = config.head_dim, config.num_heads, config.intermediate_size
    q_rows = (rank * hq // tp * D, (rank + 1) * hq // tp * D)
    k0, k1 = kv_heads(config, rank, tp)
    kv_rows = (k0 * D, k1 * D)
    i_rows = (rank * I // tp, (rank + 1) * I // tp)
    q_size, kv_size = hq * D, config.num_kv_heads * D
    # HF matmul -> the row ranges of its N it keeps, as offsets into N (fused checkpoint tensors: several)
    rows = {'self_attn.q_proj': [q_rows], 'self_attn.k_proj': [kv_rows], 'self_attn.v_proj': [kv_rows],
            'self_attn.qkv_proj': [q_rows, _shift(kv_rows, q_size), _shift(kv_rows, q_size + kv_size)],
            'mlp.gate_proj': [i_rows], 'mlp.up_proj': [i_rows], 'mlp.gate_up_proj': [i_rows, _shift(i_rows, I)]}
    cols = {'self_attn.o_proj': q_rows, 'mlp.down_proj': i_rows}  # HF matmul -> the range of K it keeps
    if config.moe is not None and any(config.moe.sparse_layers):
        # each expert, and the shared one, split by its own intermediate size as the dense MLP is (the router
        # and the shared expert's gate are replicated: every rank routes every token alike)
        E, S = config.moe.intermediate_size, config.moe.shared_intermediate_size
        e_rows, s_rows = (rank * E // tp, (rank + 1) * E // tp), (rank * S // tp, (rank + 1) * S // tp)
        layer = config.moe.sparse_layers.index(True)  # the names below the layer are every layer's

        def parts(names):  # 'model.layers.{n}.mlp.experts.3.gate_proj.weight' -> 'mlp.experts.3.gate_proj'
            return [name.split('.', 3)[-1].rpartition('.')[0] for name in names]
        for e in range(config.moe.num_experts):
            gate, up, down = parts(expert_weight_names(config, layer, e))
            rows[gate], rows[up], cols[down] = [e_rows], [e_rows], e_rows
        if S:
            gate, up, down = parts(shared_expert_names(config, layer))
            rows[gate], rows[up], cols[down] = [s_rows], [s_rows], s_rows
    vocab = vocab_range(config.vocab_size, rank, tp)
    padded = -(-config.vocab_size // tp)

    out, out_q = {}, {}
    for name, t in weights.items():
        matmul, _, field = name.rpartition('.')
        part = matmul.split('.', 3)[-1] if matmul.startswith('model.layers.') else None
        if name in ('model.embed_tokens.weight', 'lm_head.weight'):
            out[name] = _pad_rows(t[vocab[0]:vocab[1]], padded)
        elif part in rows:
            out[name] = torch.cat([t[a:b] for a, b in rows[part]])
        elif part in cols and field == 'weight':
            out[name] = t[:, cols[part][0]:cols[part][1]]
        elif part in cols:  # o_proj / down_proj bias: added once, by rank 0
            out[name] = t if rank == 0 else torch.zeros_like(t)
        elif name.endswith('self_attn.sinks'):
            out[name] = t[rank * hq // tp:(rank + 1) * hq // tp]
        else:
            out[name] = t  # norms (q/k norms are per head), replicated
    for name, q in quantized.items():
        matmul = name.rpartition('.')[0]
        part = matmul.split('.', 3)[-1] if matmul.startswith('model.layers.') else None
        where = f'{config.architecture}: tp={tp}: {name}'
        if name == 'lm_head.weight':
            out_q[name] = _quantized_rows(q, [vocab], where, pad_to=padded)
        elif part in rows:
            out_q[name] = _quantized_rows(q, rows[part], where)
        elif part in cols:
            out_q[name] = _quantized_cols(q, cols[part], where)
        else:
            raise ModelFormatError(f'{where}: a quantized tensor tensor parallelism does not know how to split')
    return out, out_q


def _shift(r: tuple[int, int], by: int) -> tuple[int, int]:
    return r[0] + by, r[1] + by


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _quantized_rows(q: tuple, ranges: list[tuple[int, int]], where: str, pad_to: int | None = None) -> tuple:
    """The rows ``ranges`` of N of quantized matmul ``q``, every field that runs along N (a GGUF block
    type and a W4A16 input permutation do not)."""
    n = dense_shape(q)[0]
    fmt = quant_format(q)
    fields = []
    for i, f in enumerate(q):
        along_n = f.dim() >= 1 and f.shape[0] == n and not (fmt == 'gguf' and i == 1) and not (i == 3)
        if along_n:
            f = torch.cat([f[a:b] for a, b in ranges])
            if pad_to is not None:
                f = _pad_rows(f, pad_to)
        fields.append(f.contiguous())
    return tuple(fields)


def _quantized_cols(q: tuple, keep: tuple[int, int], where: str) -> tuple:
    """Columns ``keep`` of K of quantized matmul ``q``, cut on its group (GGUF block) boundaries."""
    fmt = quant_format(q)
    if fmt == 'w8a8':
        raise ModelFormatError(f'{where}: a W8A8 matmul quantizes its input per token over all of K; split along '
                               'K it would compute other numbers than at tp=1, so it is not sharded')
    if len(q) == 4:
        raise ModelFormatError(f'{where}: a GPTQ act-order matmul reads its input permuted across all of K; '
                               'it cannot be split along K')
    n, k = dense_shape(q)
    fields = []
    for i, f in enumerate(q):
        if f.dim() == 2 and not (fmt == 'gguf' and i == 1):
            width = f.shape[1]
            a, b = keep[0] * width, keep[1] * width
            if a % k or b % k:
                raise ModelFormatError(f'{where}: columns {keep[0]}..{keep[1]} of K={k} do not fall on the '
                                       f'boundaries of its {width} groups (or blocks)')
            f = f[:, a // k:b // k]
        fields.append(f.contiguous())
    return tuple(fields)
