"""Per-input-channel scales folded into a decoder layer, the common move of AWQ and SmoothQuant.

A group is the linears that share one input and the module that makes it:

    input_layernorm          -> q_proj, k_proj, v_proj
    v_proj                   -> o_proj          (v's outputs are o's inputs)
    post_attention_layernorm -> gate_proj, up_proj
    up_proj                  -> down_proj

Scaling input channel j of the linears by s_j and dividing the producer's output j by s_j
keeps the layer's float output; the quantizers choose s so the scaled weights quantize better.
Under GQA o_proj's input holds each KV head's values once per query head that reads them, so its
scales are tied: o's input channel (h, d) takes the scale of v's output channel (kv(h), d)
(``SmoothGroup.expand``); ``smooth_groups(layer, tied=False)`` leaves such a group out, as
AutoAWQ and SmoothQuant do.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class SmoothGroup(NamedTuple):
    producer: nn.Module         # an RMSNorm or a linear, whose outputs the linears read
    linears: list[nn.Linear]
    name: str                   # the LINEARS name of the first linear, whose input stats stand for the group
    expand: torch.Tensor | None = None  # the linears' input channel j reads the producer's output expand[j]

    def tie(self, per_input: torch.Tensor) -> torch.Tensor:
        """Per-input-channel statistics [K] of the linears -> per producer output: the mean over the
        input channels that read each output (the identity without ``expand``)."""
        if self.expand is None:
            return per_input
        n = int(self.expand.max()) + 1
        counts = torch.zeros(n).index_add_(0, self.expand, torch.ones(len(self.expand)))
        return torch.zeros(n, dtype=per_input.dtype).index_add_(0, self.expand, per_input) / counts

    def spread(self, s: torch.Tensor) -> torch.Tensor:
        """Scales per producer output -> per input channel of the linears."""
        return s if self.expand is None else s[self.expand]


def smooth_groups(layer: nn.Module, tied: bool = False) -> list[SmoothGroup]:
    """The layer's groups (the module doc); with ``tied``, o_proj under GQA too."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [SmoothGroup(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], 'self_attn.q_proj')]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append(SmoothGroup(attn.v_proj, [attn.o_proj], 'self_attn.o_proj'))
    elif tied:
        head_dim = attn.head_dim
        per_kv = attn.o_proj.in_features // attn.v_proj.out_features  # query heads per KV head
        heads = torch.arange(attn.o_proj.in_features) // head_dim
        expand = heads // per_kv * head_dim + torch.arange(attn.o_proj.in_features) % head_dim
        groups.append(SmoothGroup(attn.v_proj, [attn.o_proj], 'self_attn.o_proj', expand))
    groups += [SmoothGroup(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], 'mlp.gate_proj'),
               SmoothGroup(mlp.up_proj, [mlp.down_proj], 'mlp.down_proj')]
    return groups


@torch.no_grad()
def fold_scales(producer: nn.Module, linears: list[nn.Linear], s: torch.Tensor,
                expand: torch.Tensor | None = None) -> None:
    """Multiply the linears' input channels by ``s`` (``s[expand]`` where given) and divide the
    producer's outputs by ``s``."""
    s = s.to(linears[0].weight.dtype)
    if isinstance(producer, nn.Linear):
        producer.weight.div_(s[:, None])
        if producer.bias is not None:
            producer.bias.div_(s)
    else:  # an RMSNorm: y = w * normalized(x)
        producer.weight.div_(s)
    s = s if expand is None else s[expand]
    for linear in linears:
        linear.weight.mul_(s)


def group_weight(linears: list[nn.Linear]) -> torch.Tensor:
    """The group's weights stacked along the outputs: float32 [sum of out_features, in_features]."""
    return torch.cat([linear.weight.detach().float() for linear in linears])
