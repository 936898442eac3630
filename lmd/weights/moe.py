"""A mixture-of-experts layer's weights (``ModelConfig.moe``): their HF names, shapes, and the experts
stacked at load into the [E, N, K] tensors a grouped matmul reads.

HF checkpoints store one tensor per expert and matmul: Mixtral ``block_sparse_moe.experts.{e}.w1``
(gate), ``w3`` (up), ``w2`` (down) beside the router ``block_sparse_moe.gate``; Qwen2-MoE and Qwen3-MoE
``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` beside ``mlp.gate``, and Qwen2-MoE's shared
expert ``mlp.shared_expert.*`` with its gate ``mlp.shared_expert_gate`` [1, H]; DeepSeek-V2 the Qwen names and
its shared experts, fused into one, as ``mlp.shared_experts.*`` without a gate. Stacked, the experts are
``gate_up`` [E, 2 I, H] (each expert's gate rows, then its up rows, as ``schema`` fuses a dense MLP) and
``down`` [E, H, I]: the PyTorch engine's grouped matmuls read them, and TurboMind's (``fuse_moe``: a sparse
layer's tensors under TurboMind's names). gpt-oss stores its experts stacked already, interleaved and
transposed, with biases, and its router ``mlp.router`` with a bias (``stacked_experts.py``).
"""
from __future__ import annotations

from collections.abc import Collection

import torch

from ..model_config import ModelConfig
from .stacked_experts import has_stacked_experts, stacked_expert_shapes, unstack_experts

# family -> (the MLP's prefix in a layer, each expert's (gate, up, down) matmuls)
_EXPERT_NAMES = {'mixtral': ('block_sparse_moe.', ('w1', 'w3', 'w2'))}
_QWEN_EXPERT_NAMES = ('mlp.', ('gate_proj', 'up_proj', 'down_proj'))
SHARED_EXPERT_MATMULS = ('shared_expert.gate_proj', 'shared_expert.up_proj', 'shared_expert.down_proj')


def shared_expert_names(config: ModelConfig, layer: int) -> tuple[str, str, str]:
    """The HF names of layer ``layer``'s shared expert's gate, up and down weights: Qwen2-MoE's
    ``mlp.shared_expert.*``, DeepSeek-V2's ``mlp.shared_experts.*`` (its experts fused into one)."""
    p = moe_prefix(config, layer)
    if config.family == 'deepseek_v2':
        return tuple(f'{p}shared_experts.{m}.weight' for m in ('gate_proj', 'up_proj', 'down_proj'))
    return tuple(f'{p}{m}.weight' for m in SHARED_EXPERT_MATMULS)


def moe_prefix(config: ModelConfig, layer: int) -> str:
    """The HF name prefix of layer ``layer``'s MoE MLP: ``model.layers.{layer}.mlp.`` (Mixtral's:
    ``model.layers.{layer}.block_sparse_moe.``)."""
    return f'model.layers.{layer}.{_EXPERT_NAMES.get(config.family, _QWEN_EXPERT_NAMES)[0]}'


def expert_weight_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The HF names of expert ``expert``'s gate, up and down weights in layer ``layer``."""
    matmuls = _EXPERT_NAMES.get(config.family, _QWEN_EXPERT_NAMES)[1]
    prefix = f'{moe_prefix(config, layer)}experts.{expert}.'
    return tuple(f'{prefix}{m}.weight' for m in matmuls)


def router_names(config: ModelConfig, layer: int) -> tuple[str, str | None]:
    """The HF names of layer ``layer``'s router weight [E, H] and bias [E] (None: no bias): ``gate``, or
    gpt-oss's ``router`` with a bias."""
    p = moe_prefix(config, layer)
    if config.moe.router_bias:
        return p + 'router.weight', p + 'router.bias'
    return p + 'gate.weight', None


def moe_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor of layer ``layer``'s MoE MLP (router, experts, shared expert)."""
    moe, H = config.moe, config.hidden_size
    p, I, S = moe_prefix(config, layer), moe.intermediate_size, moe.shared_intermediate_size
    router, router_bias = router_names(config, layer)
    shapes = {router: (moe.num_experts, H)}
    if router_bias:
        shapes[router_bias] = (moe.num_experts,)
    if has_stacked_experts(config):
        return {**shapes, **stacked_expert_shapes(config, p)}
    for e in range(moe.num_experts):
        gate, up, down = expert_weight_names(config, layer, e)
        shapes.update({gate: (I, H), up: (I, H), down: (H, I)})
    if S:
        gate, up, down = shared_expert_names(config, layer)
        shapes.update({gate: (S, H), up: (S, H), down: (H, S)})
        if moe.shared_gate:
            shapes[p + 'shared_expert_gate.weight'] = (1, H)
    return shapes


def stack_experts(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s experts as (gate_up [E, 2 I, H], down [E, H, I]) in ``dtype`` (see the module doc)."""
    if has_stacked_experts(config):
        return unstack_experts(weights, moe_prefix(config, layer), dtype)[:2]
    names = [expert_weight_names(config, layer, e) for e in range(config.moe.num_experts)]
    gate_up = torch.stack([torch.cat([weights[gate].to(dtype), weights[up].to(dtype)]) for gate, up, _ in names])
    down = torch.stack([weights[down].to(dtype) for _, _, down in names])
    return gate_up, down


def expert_biases(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer ``layer``'s expert biases (gate_up [E, 2 I] in ``stack_experts``' row order, down [E, H]) in
    ``dtype``, or None where the experts have none."""
    if not config.moe.expert_bias:
        return None
    return unstack_experts(weights, moe_prefix(config, layer), dtype)[2:]


# TurboMind's names (``fuse_weights``) of a sparse layer's tensors, under ``layers.{i}.``: the float
# matmuls [N, K] beside the expert stacks [E, N, K]
MOE_MATMULS = ('router', 'shared_gate_up', 'shared_down', 'shared_gate')
EXPERT_STACKS = ('experts.gate_up', 'experts.down')


def moe_matmuls(config: ModelConfig, layer: int) -> dict[str, list[str]]:
    """Layer ``layer``'s expert and shared-expert matmuls that may run quantized, each as TurboMind's name
    (under ``layers.{layer}.``) -> the HF weights fused into it: ``experts.gate_up.{e}`` [gate, up] and
    ``experts.down.{e}`` [down] for each expert (none where the checkpoint stacks them, gpt-oss),
    ``shared_gate_up`` and ``shared_down``."""
    out = {}
    if not has_stacked_experts(config):
        for e in range(config.moe.num_experts):
            gate, up, down = expert_weight_names(config, layer, e)
            out[f'experts.gate_up.{e}'], out[f'experts.down.{e}'] = [gate, up], [down]
    if config.moe.shared_intermediate_size:
        gate, up, down = shared_expert_names(config, layer)
        out['shared_gate_up'], out['shared_down'] = [gate, up], [down]
    return out


def quantized_moe_matmuls(config: ModelConfig, layer: int, quantized: dict) -> dict[str, list[str]]:
    """The part of ``moe_matmuls`` whose HF weights all have a quantized layout in ``quantized`` (HF name ->
    layout), run quantized, one matmul each: the shared expert's, and the experts' only when every expert's
    are (else the experts run as float stacks)."""
    matmuls = moe_matmuls(config, layer)
    done = {name: parts for name, parts in matmuls.items() if all(p in quantized for p in parts)}
    if any(name.startswith('experts.') and name not in done for name in matmuls):
        done = {name: parts for name, parts in done.items() if not name.startswith('experts.')}
    return done


def fuse_moe(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
             dtype: torch.dtype, quantized: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s MoE MLP under TurboMind's names, in ``dtype``: ``router`` [E, H], the experts
    stacked (``experts.gate_up`` [E, 2 I, H], ``experts.down`` [E, H, I]) and, for Qwen2-MoE, the shared
    expert (``shared_gate_up`` [2 S, H], ``shared_down`` [H, S]) and its gate ``shared_gate`` [1, H]; gpt-oss's
    ``router_bias`` [E] and the experts' biases (``experts.gate_up_bias`` [E, 2 I], ``experts.down_bias`` [E, H]).
    The matmuls named in ``quantized`` (``quantized_moe_matmuls``) are left out: the caller writes them in
    their quantized layout (the expert stacks with the first expert's)."""
    p, q = moe_prefix(config, layer), f'layers.{layer}.'

    def get(name: str) -> torch.Tensor:
        return weights[name].to(dtype).contiguous()

    router, router_bias = router_names(config, layer)
    out = {q + 'router': get(router)}
    if 'experts.gate_up.0' not in quantized:
        out[q + 'experts.gate_up'], out[q + 'experts.down'] = stack_experts(config, weights, layer, dtype)
    if router_bias:
        out[q + 'router_bias'] = get(router_bias)
    biases = expert_biases(config, weights, layer, dtype)
    if biases is not None:
        out[q + 'experts.gate_up_bias'], out[q + 'experts.down_bias'] = biases
    if config.moe.shared_intermediate_size:  # DeepSeek-V2's shared experts: no gate
        gate, up, down = shared_expert_names(config, layer)
        if 'shared_gate_up' not in quantized:
            out[q + 'shared_gate_up'] = torch.cat([get(gate), get(up)])
        if 'shared_down' not in quantized:
            out[q + 'shared_down'] = get(down)
        if config.moe.shared_gate:
            out[q + 'shared_gate'] = get(p + 'shared_expert_gate.weight')
    return out
