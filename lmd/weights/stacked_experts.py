"""Experts a checkpoint stores stacked, one tensor per matmul for all of a layer's experts (gpt-oss), and
their conversion at load into lmd's stacks (``lmd.weights.moe``).

gpt-oss (HF's GptOssExperts) keeps, under ``model.layers.{i}.mlp.experts.``: ``gate_up_proj`` [E, H, 2 I]
multiplied from the right (x @ w), its gate and up columns interleaved (gate = [..., ::2], up = [..., 1::2]),
with ``gate_up_proj_bias`` [E, 2 I] interleaved alike; ``down_proj`` [E, I, H] with ``down_proj_bias`` [E, H].
Its router is ``mlp.router`` with a weight [E, H] and a bias [E]. lmd's stacks are [E, N, K] (rows are
outputs): ``gate_up`` [E, 2 I, H] with each expert's gate rows first, then its up rows, and ``down`` [E, H, I];
the biases follow the same row order.
"""
from __future__ import annotations

import torch

from ..model_config import ModelConfig

# the stacked tensors under model.layers.{i}.mlp.experts.
_GATE_UP, _GATE_UP_BIAS, _DOWN, _DOWN_BIAS = 'gate_up_proj', 'gate_up_proj_bias', 'down_proj', 'down_proj_bias'


def has_stacked_experts(config: ModelConfig) -> bool:
    """Whether ``config``'s checkpoints store each layer's experts stacked (gpt-oss)."""
    return config.family == 'gpt_oss'


def stacked_expert_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of the stacked expert tensors under ``prefix`` (``model.layers.{i}.mlp.``)."""
    E, H, I = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
    p = prefix + 'experts.'
    return {p + _GATE_UP: (E, H, 2 * I), p + _GATE_UP_BIAS: (E, 2 * I), p + _DOWN: (E, I, H), p + _DOWN_BIAS: (E, H)}


def _gate_rows_first(t: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] with gate and up interleaved along the last dim -> [..., 2 I], the I gates then the I ups."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def unstack_experts(weights: dict[str, torch.Tensor], prefix: str,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stacked experts under ``prefix`` in lmd's layout and ``dtype``: (gate_up [E, 2 I, H],
    down [E, H, I], gate_up_bias [E, 2 I], down_bias [E, H]), each contiguous."""
    p = prefix + 'experts.'
    gate_up = _gate_rows_first(weights[p + _GATE_UP].to(dtype)).transpose(1, 2).contiguous()
    down = weights[p + _DOWN].to(dtype).transpose(1, 2).contiguous()
    gate_up_bias = _gate_rows_first(weights[p + _GATE_UP_BIAS].to(dtype)).contiguous()
    return gate_up, down, gate_up_bias, weights[p + _DOWN_BIAS].to(dtype).contiguous()
