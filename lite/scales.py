"""Per-input-channel scales folded into a decoder layer, the common move of AWQ and SmoothQuant.

A group is the linears that share one input and the module that makes it:

    input_layernorm          -> q_proj, k_proj, v_proj
    v_proj                   -> o_proj          (only without GQA: v's outputs are o's inputs)
    post_attention_layernorm -> gate_proj, up_proj
    up_proj                  -> down_proj

Scaling input channel j of the linears by s_j and dividing the producer's output j by s_j
keeps the layer's float output; the quantizers choose s so the scaled weights quantize better.
"""
from __future__ import annotations

import torch
from torch import nn


def smooth_groups(layer: nn.Module) -> list[tuple[nn.Module, list[nn.Linear], str]]:
    """(producer, linears, the LINEARS name of the first linear, whose input stats stand for the group)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], 'self_attn.q_proj')]
    if attn.v_proj.out_features == attn.o_proj.in_features:  # AutoAWQ skips o_proj under GQA too
        groups.append((attn.v_proj, [attn.o_proj], 'self_attn.o_proj'))
    groups += [(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], 'mlp.gate_proj'),
               (mlp.up_proj, [mlp.down_proj], 'mlp.down_proj')]
    return groups


@torch.no_grad()
def fold_scales(producer: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Multiply the linears' input channels by ``s`` and divide the producer's outputs by it."""
    s = s.to(linears[0].weight.dtype)
    if isinstance(producer, nn.Linear):
        producer.weight.div_(s[:, None])
        if producer.bias is not None:
            producer.bias.div_(s)
    else:  # an RMSNorm: y = w * normalized(x)
        producer.weight.div_(s)
    for linear in linears:
        linear.weight.mul_(s)


def group_weight(linears: list[nn.Linear]) -> torch.Tensor:
    """The group's weights stacked along the outputs: float32 [sum of out_features, in_features]."""
    return torch.cat([linear.weight.detach().float() for linear in linears])
