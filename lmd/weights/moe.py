"""A mixture-of-experts layer's weights (``ModelConfig.moe``): their HF names, shapes, and the experts
stacked at load into the [E, N, K] tensors a grouped matmul reads.

HF checkpoints store one tensor per expert and matmul: Mixtral ``block_sparse_moe.experts.{e}.w1``
(gate), ``w3`` (up), ``w2`` (down) beside the router ``block_sparse_moe.gate``; Qwen2-MoE and Qwen3-MoE
``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` beside ``mlp.gate``, and Qwen2-MoE's shared
expert ``mlp.shared_expert.*`` with its gate ``mlp.shared_expert_gate`` [1, H]. Stacked, the experts are
``gate_up`` [E, 2 I, H] (each expert's gate rows, then its up rows, as ``schema`` fuses a dense MLP) and
``down`` [E, H, I]: the PyTorch engine's grouped matmuls read them, and TurboMind's (``fuse_moe``: a sparse
layer's tensors under TurboMind's names).
"""
from __future__ import annotations

import torch

from ..model_config import ModelConfig

# family -> (the MLP's prefix in a layer, each expert's (gate, up, down) matmuls)
_EXPERT_NAMES = {'mixtral': ('block_sparse_moe.', ('w1', 'w3', 'w2'))}
_QWEN_EXPERT_NAMES = ('mlp.', ('gate_proj', 'up_proj', 'down_proj'))
SHARED_EXPERT_MATMULS = ('shared_expert.gate_proj', 'shared_expert.up_proj', 'shared_expert.down_proj')


def moe_prefix(config: ModelConfig, layer: int) -> str:
    """The HF name prefix of layer ``layer``'s MoE MLP: ``model.layers.{layer}.mlp.`` (Mixtral's:
    ``model.layers.{layer}.block_sparse_moe.``)."""
    return f'model.layers.{layer}.{_EXPERT_NAMES.get(config.family, _QWEN_EXPERT_NAMES)[0]}'


def expert_weight_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The HF names of expert ``expert``'s gate, up and down weights in layer ``layer``."""
    matmuls = _EXPERT_NAMES.get(config.family, _QWEN_EXPERT_NAMES)[1]
    prefix = f'{moe_prefix(config, layer)}experts.{expert}.'
    return tuple(f'{prefix}{m}.weight' for m in matmuls)


def moe_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor of layer ``layer``'s MoE MLP (router, experts, shared expert)."""
    moe, H = config.moe, config.hidden_size
    p, I, S = moe_prefix(config, layer), moe.intermediate_size, moe.shared_intermediate_size
    shapes = {p + 'gate.weight': (moe.num_experts, H)}
    for e in range(moe.num_experts):
        gate, up, down = expert_weight_names(config, layer, e)
        shapes.update({gate: (I, H), up: (I, H), down: (H, I)})
    if S:
        gate, up, down = (f'{p}{m}.weight' for m in SHARED_EXPERT_MATMULS)
        shapes.update({gate: (S, H), up: (S, H), down: (H, S), p + 'shared_expert_gate.weight': (1, H)})
    return shapes


def stack_experts(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s experts as (gate_up [E, 2 I, H], down [E, H, I]) in ``dtype`` (see the module doc)."""
    names = [expert_weight_names(config, layer, e) for e in range(config.moe.num_experts)]
    gate_up = torch.stack([torch.cat([weights[gate].to(dtype), weights[up].to(dtype)]) for gate, up, _ in names])
    down = torch.stack([weights[down].to(dtype) for _, _, down in names])
    return gate_up, down


# TurboMind's names (``fuse_weights``) of a sparse layer's tensors, under ``layers.{i}.``: the float
# matmuls [N, K] beside the expert stacks [E, N, K]
MOE_MATMULS = ('router', 'shared_gate_up', 'shared_down', 'shared_gate')
EXPERT_STACKS = ('experts.gate_up', 'experts.down')


def fuse_moe(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s MoE MLP under TurboMind's names, in ``dtype``: ``router`` [E, H], the experts
    stacked (``experts.gate_up`` [E, 2 I, H], ``experts.down`` [E, H, I]) and, for Qwen2-MoE, the shared
    expert (``shared_gate_up`` [2 S, H], ``shared_down`` [H, S]) and its gate ``shared_gate`` [1, H]."""
    p, q = moe_prefix(config, layer), f'layers.{layer}.'

    def get(name: str) -> torch.Tensor:
        return weights[name].to(dtype).contiguous()

    gate_up, down = stack_experts(config, weights, layer, dtype)
    out = {q + 'router': get(p + 'gate.weight'), q + 'experts.gate_up': gate_up, q + 'experts.down': down}
    if config.moe.shared_intermediate_size:
        gate, up, down = (p + m + '.weight' for m in SHARED_EXPERT_MATMULS)
        out.update({q + 'shared_gate_up': torch.cat([get(gate), get(up)]), q + 'shared_down': get(down),
                    q + 'shared_gate': get(p + 'shared_expert_gate.weight')})
    return out
