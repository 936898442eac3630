"""Mixture-of-experts models: Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss (``ModelConfig.moe``).

Each is the Llama-family decoder of ``llama.py`` (Qwen2-MoE with q/k/v biases, Qwen3-MoE with q/k
norms) whose MLP is, on its sparse layers, a ``SparseMoe``: a router picks each token's top-k experts,
the experts run as grouped matmuls over the tokens routed to each (``Kernels.moe``), and Qwen2-MoE adds
a shared expert scaled by a sigmoid gate. Routing follows transformers exactly: softmax in float32 over
the router's logits, top-k, then the k weights renormalised to sum 1 (Mixtral always; Qwen with
``norm_topk_prob``); Mixtral keeps them in float32, Qwen rounds them to the model's dtype. Dense layers
(Qwen's ``mlp_only_layers``, ``decoder_sparse_step``) keep the plain MLP. gpt-oss routes the other way
round ('topk_softmax': the top-k of its biased router's logits, then a softmax over those k), its experts
carry biases and run a clamped SwiGLU (``torch_ops.clamped_swiglu``); its attention sinks live in
``llama.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmd.model_config import ModelConfig
from lmd.weights.moe import (expert_biases, moe_matmuls, moe_prefix, quantized_moe_matmuls, router_names,
                             stack_experts)
from lmd.weights.schema import fuse_quantized

from ..kernels import Kernels, prepare_matmul
from .llama import CausalLM


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          dtype: torch.dtype, topk_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in ``dtype``, expert ids [T, k]): softmax in float32,
    top-k, renormalised to sum 1 with ``norm_topk_prob``; ``topk_softmax`` (gpt-oss): top-k of the logits,
    then a softmax over those k."""
    if topk_softmax:
        top, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32).to(dtype), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


@dataclass
class SharedExpert:
    """Qwen2-MoE's always-on expert: a SwiGLU MLP, its output scaled by sigmoid(gate(x)) per token."""
    gate_up: object  # prepared [2 S, H]
    down: object     # prepared [H, S]
    gate: object     # prepared [1, H]


@dataclass
class SparseMoe:
    """One layer's mixture of experts: ``__call__(x[T, H]) -> [T, H]``, the MLP's output."""
    kernels: Kernels
    router: object                 # prepared [E, H]
    gate_up: torch.Tensor | list   # [E, 2 I, H], each expert's gate rows then its up rows (quantized: E prepared)
    down: torch.Tensor | list      # [E, H, I] (quantized: E prepared)
    top_k: int
    norm_topk_prob: bool
    weight_dtype: torch.dtype      # the routing weights' dtype (Mixtral float32, Qwen the model's)
    shared: SharedExpert | None
    # gpt-oss: softmax over the top-k logits, biases [E, 2 I] and [E, H], the clamped SwiGLU's settings
    topk_softmax: bool = False
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kern = self.kernels
        weights, ids = route(kern.linear(x, self.router), self.top_k, self.norm_topk_prob, self.weight_dtype,
                             self.topk_softmax)
        options = {} if self.swiglu_limit is None and self.gate_up_bias is None else dict(
            gate_up_bias=self.gate_up_bias, down_bias=self.down_bias, swiglu_limit=self.swiglu_limit,
            swiglu_alpha=self.swiglu_alpha)
        if isinstance(self.gate_up, list):  # one prepared matmul an expert (quantized, or the native kernels')
            options['linear'] = kern.linear
        out = kern.moe(x, self.gate_up, self.down, weights, ids, **options)
        if self.shared is not None:
            shared = kern.linear(kern.silu_and_mul(kern.linear(x, self.shared.gate_up)), self.shared.down)
            out += torch.sigmoid(kern.linear(x, self.shared.gate)) * shared
        return out


class MoeCausalLM(CausalLM):
    """A Llama-family decoder whose sparse layers run a ``SparseMoe`` (see the module docstring)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = 'cpu', kernel_backend: str | None = None,
                 quantized: dict[str, tuple] | None = None, layers: range | None = None):
        super().__init__(config, weights, dtype, device, kernel_backend, quantized, layers)
        for n, layer in zip(self.layer_ids, self.layers):
            if config.is_sparse(n):
                layer.moe = self._sparse_moe(config, weights, n, quantized or {})

    def _sparse_moe(self, config: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
                    quantized: dict[str, tuple]) -> SparseMoe:
        """Layer ``layer``'s experts stacked (or, quantized, one prepared matmul each), its router and shared
        expert prepared for the kernels."""
        kern, p = self.kernels, moe_prefix(config, layer)

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=self.dtype).contiguous()

        matmuls, quantized_names = moe_matmuls(config, layer), quantized_moe_matmuls(config, layer, quantized)

        def matmul(name: str):
            """The prepared matmul ``name`` of ``moe_matmuls``, its HF weights fused along N, quantized or float."""
            if name in quantized_names:
                return prepare_matmul(kern, fuse_quantized([quantized[n] for n in matmuls[name]]), None)
            return prepare_matmul(kern, torch.cat([get(n) for n in matmuls[name]]), None)

        shared = None
        if config.moe.shared_intermediate_size:
            shared = SharedExpert(gate_up=matmul('shared_gate_up'), down=matmul('shared_down'),
                                  gate=prepare_matmul(kern, get(p + 'shared_expert_gate.weight'), None))
        if 'experts.gate_up.0' in quantized_names:
            gate_up = [matmul(f'experts.gate_up.{e}') for e in range(config.moe.num_experts)]
            down = [matmul(f'experts.down.{e}') for e in range(config.moe.num_experts)]
        else:
            gate_up, down = (t.to(self.device) for t in stack_experts(config, weights, layer, self.dtype))
            if kern.name == 'native':  # the kernel library's matmuls, on views of the stacks (its threads)
                gate_up = [prepare_matmul(kern, w, None) for w in gate_up]
                down = [prepare_matmul(kern, w, None) for w in down]
        biases = expert_biases(config, weights, layer, self.dtype)
        gate_up_bias, down_bias = (None, None) if biases is None else (b.to(self.device) for b in biases)
        router, router_bias = router_names(config, layer)
        moe = config.moe
        return SparseMoe(kernels=kern, router=prepare_matmul(kern, get(router), router_bias and get(router_bias)),
                         gate_up=gate_up, down=down, top_k=moe.top_k,
                         norm_topk_prob=moe.norm_topk_prob,
                         weight_dtype=torch.float32 if config.family == 'mixtral' else self.dtype, shared=shared,
                         topk_softmax=moe.topk_method == 'topk_softmax', gate_up_bias=gate_up_bias,
                         down_bias=down_bias, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha)
