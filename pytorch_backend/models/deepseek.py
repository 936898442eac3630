"""DeepSeek-V2 in plain torch: multi-head latent attention over a latent KV cache, and a mixture of
experts with shared experts and grouped routing.

Attention (``lmd.weights.mla``): q comes from ``q_proj`` (or ``q_a_proj`` -> RMSNorm -> ``q_b_proj``),
per head ``nope`` plain dims and ``rope`` rotated ones; ``kv_a_proj_with_mqa`` gives each token a latent
of L dims, RMS-normed, and one rotated key of ``rope`` dims shared by every head. That row [L + rope] is
all the cache holds (``allocate_kv_cache``: one tensor a layer, one KV head). Each head's plain query is
carried into the latent space by W_UK (``kv_b_proj``'s key half), so [q_nope W_UK | q_pe] attends over
the cached rows as keys and their first L dims as values (``Kernels.paged_latent_attention``), and the
latent output is carried out by W_UV (the value half) before ``o_proj``; prefill chunks run the same
path. The rope dims are reordered at load so the kernels' NeoX rotation is HF's interleaved one.

MLP: the first ``first_k_dense_replace`` layers are dense SwiGLU; the rest route each token to its
``top_k`` experts (softmax over the router's logits in float32, then top-k, within the best groups for
'group_limited_greedy'), their weights times ``routed_scaling_factor`` and kept in float32 as
transformers does, through the grouped expert matmuls (``Kernels.moe``), plus the shared experts
(one SwiGLU MLP, always on, ungated).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig, MoeConfig
from lmd.weights.memory import kv_block_bytes
from lmd.weights.mla import absorbed_weights, deinterleave_rope_rows
from lmd.weights.moe import moe_prefix, shared_expert_names, stack_experts
from lmd.weights.schema import check_weights, matmul_parts

from ..context import StepContext
from ..kernels import Kernels, prepare_matmul
from .llama import CausalLM


def route_grouped(router_logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (float32) -> (weights [T, k] float32, expert ids [T, k]): softmax, then top-k
    over every expert ('greedy') or over those of the ``topk_groups`` groups whose best expert scores
    highest ('group_limited_greedy'); the weights times ``routed_scaling_factor``."""
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if moe.topk_method == 'group_limited_greedy':
        num_tokens, per_group = scores.shape[0], moe.num_experts // moe.num_groups
        best = scores.view(num_tokens, moe.num_groups, per_group).amax(dim=-1)
        groups = torch.topk(best, moe.topk_groups, dim=-1).indices
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
        scores = scores.masked_fill(~keep.repeat_interleave(per_group, dim=1), 0.0)
    weights, ids = torch.topk(scores, moe.top_k, dim=-1)
    return weights * moe.routed_scaling_factor, ids


@dataclass
class DeepseekMoe:
    """One layer's experts: ``__call__(x[T, H]) -> [T, H]``, the routed experts' sum plus the shared ones."""
    kernels: Kernels
    config: MoeConfig
    router: object                  # prepared float32 [E, H]
    gate_up: torch.Tensor           # [E, 2 I, H]
    down: torch.Tensor              # [E, H, I]
    shared_gate_up: object | None   # prepared [2 S, H]
    shared_down: object | None      # prepared [H, S]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kern = self.kernels
        weights, ids = route_grouped(kern.linear(x.float(), self.router), self.config)
        out = kern.moe(x, self.gate_up, self.down, weights, ids)
        if self.shared_gate_up is not None:
            out += kern.linear(kern.silu_and_mul(kern.linear(x, self.shared_gate_up)), self.shared_down)
        return out


@dataclass
class MlaLayer:
    input_norm: torch.Tensor        # [H]
    post_norm: torch.Tensor         # [H]
    # q: q_proj [Hq (nope + rope), H]; or q_a [r, H], q_a_norm [r], q_b [Hq (nope + rope), r]
    q: object | None
    q_a: object | None
    q_a_norm: torch.Tensor | None
    q_b: object | None
    kv_a: object                    # prepared [L + rope, H]
    kv_a_norm: torch.Tensor         # [L]
    w_uk: torch.Tensor              # [Hq, nope, L]
    w_uv_t: torch.Tensor            # [Hq, L, v]
    o: object                       # prepared [H, Hq v]
    gate_up: object | None          # a dense MLP's prepared [2 I, H] and [H, I]; None on an MoE layer
    down: object | None
    moe: DeepseekMoe | None


class DeepseekV2CausalLM(CausalLM):
    """DeepSeek-V2 over a latent KV cache; see the module docstring. Shares ``CausalLM``'s RoPE table
    and logits; its own layers, cache and forward."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = 'cpu', kernel_backend: str | None = None,
                 quantized: dict[str, tuple] | None = None):
        self._setup(config, dtype, device, kernel_backend)
        if quantized:
            raise ModelFormatError(f'{config.architecture}: quantized checkpoints are not supported yet; '
                                   'use a float checkpoint')
        check_weights(config, weights)
        self.mla = mla = config.mla
        kern = self.kernels

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def matmul(w: torch.Tensor) -> object:
            return prepare_matmul(kern, w.to(device=self.device, dtype=dtype).contiguous(), None)

        nope, rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.embed_tokens = get('model.embed_tokens.weight')
        self.norm = get('model.norm.weight')
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else get('lm_head.weight')
        self.lm_head_params = prepare_matmul(kern, self.lm_head, None)
        self.layers: list[MlaLayer] = []
        for n in range(config.num_layers):
            p = f'model.layers.{n}.'
            a = p + 'self_attn.'
            q_rows = partial(deinterleave_rope_rows, head_dim=nope + rope, rope_dim=rope)
            w_uk, w_uv = absorbed_weights(config, weights[a + 'kv_b_proj.weight'].to(dtype))
            lora = mla.q_lora_rank is not None
            dense = not config.is_sparse(n)
            self.layers.append(MlaLayer(
                input_norm=get(p + 'input_layernorm.weight'),
                post_norm=get(p + 'post_attention_layernorm.weight'),
                q=None if lora else matmul(q_rows(weights[a + 'q_proj.weight'])),
                q_a=matmul(weights[a + 'q_a_proj.weight']) if lora else None,
                q_a_norm=get(a + 'q_a_layernorm.weight') if lora else None,
                q_b=matmul(q_rows(weights[a + 'q_b_proj.weight'])) if lora else None,
                kv_a=matmul(deinterleave_rope_rows(weights[a + 'kv_a_proj_with_mqa.weight'],
                                                   mla.kv_lora_rank + rope, rope)),
                kv_a_norm=get(a + 'kv_a_layernorm.weight'),
                w_uk=w_uk.to(self.device),
                w_uv_t=w_uv.transpose(1, 2).contiguous().to(self.device),
                o=matmul(weights[a + 'o_proj.weight']),
                gate_up=matmul(torch.cat([weights[w] for w in matmul_parts(config, n, 'gate_up')])) if dense else None,
                down=matmul(weights[matmul_parts(config, n, 'down')[0]]) if dense else None,
                moe=None if dense else self._moe(config, weights, n),
            ))
        self.build_rope()

    def _moe(self, config: ModelConfig, weights: dict[str, torch.Tensor], layer: int) -> DeepseekMoe:
        kern, moe = self.kernels, config.moe
        gate_up, down = stack_experts(config, weights, layer, self.dtype)
        shared_gate_up = shared_down = None
        if moe.shared_intermediate_size:
            gate, up, sdown = (weights[w].to(self.dtype) for w in shared_expert_names(config, layer))
            shared_gate_up = prepare_matmul(kern, torch.cat([gate, up]).to(self.device).contiguous(), None)
            shared_down = prepare_matmul(kern, sdown.to(self.device).contiguous(), None)
        # the router in float32, as transformers keeps it
        router = weights[moe_prefix(config, layer) + 'gate.weight'].to(device=self.device, dtype=torch.float32)
        return DeepseekMoe(kernels=kern, config=moe, router=prepare_matmul(kern, router.contiguous(), None),
                           gate_up=gate_up.to(self.device), down=down.to(self.device),
                           shared_gate_up=shared_gate_up, shared_down=shared_down)

    # -- KV cache -------------------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int, block_size: int, quant_policy: int = 0) -> list[tuple]:
        """Per layer a one-tensor tuple, the latent cache [num_blocks, block_size, 1, L + rope]: each
        token's normed latent, then its rotated key. Not quantized."""
        if quant_policy:
            raise ValueError(f'quant_policy={quant_policy}: the latent KV cache of {self.config.architecture} '
                             'is not quantized; use quant_policy=0')
        alloc = torch.empty if self.kernels.name == 'native' else torch.zeros
        shape = (num_blocks, block_size, 1, self.mla.cache_dim)
        return [(alloc(shape, dtype=self.dtype, device=self.device),) for _ in range(self.num_layers)]

    def kv_cache_bytes_per_block(self, block_size: int, quant_policy: int = 0) -> int:
        """The latent rows of every layer (``lmd.weights.memory.kv_block_bytes``)."""
        return kv_block_bytes(self.config, block_size, self.dtype, quant_policy)

    # -- forward --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, H] after the final norm; writes the new tokens' latent
        rows into ctx.kv_caches at ctx.slot_mapping."""
        kern = self.kernels
        rms_norm, add_rms_norm, linear = kern.rms_norm, kern.add_rms_norm, kern.linear
        eps, mla = self.eps, self.mla
        num_tokens, num_heads = input_ids.shape[0], self.num_heads
        nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank

        residual = F.embedding(input_ids, self.embed_tokens)
        delta = None
        for layer, (cache,) in zip(self.layers, ctx.kv_caches):
            x = rms_norm(residual, layer.input_norm, eps) if delta is None else \
                add_rms_norm(delta, residual, layer.input_norm, eps)
            if layer.q is not None:
                q = linear(x, layer.q)
            else:
                q = linear(rms_norm(linear(x, layer.q_a), layer.q_a_norm, eps), layer.q_b)
            q = q.view(num_tokens, num_heads, nope + rope)
            kv = linear(x, layer.kv_a)                                       # [T, L + rope]
            q_pe, k_pe = kern.apply_rotary(q[..., nope:], kv[:, None, rank:], positions, self.cos_sin_cache)
            # the cached row: [normed latent | rotated key]
            row = torch.cat([rms_norm(kv[:, :rank], layer.kv_a_norm, eps), k_pe[:, 0]], dim=-1)
            cache.view(-1, mla.cache_dim).index_copy_(0, ctx.slot_mapping, row)
            # the latent query [q_nope W_UK | q_pe], per head
            q_latent = torch.empty((num_tokens, num_heads, mla.cache_dim), dtype=q.dtype, device=q.device)
            q_latent[..., :rank] = torch.bmm(q[..., :nope].transpose(0, 1), layer.w_uk).transpose(0, 1)
            q_latent[..., rank:] = q_pe
            o_latent = kern.paged_latent_attention(q_latent, cache, ctx, self.scale, rank)   # [T, Hq, L]
            o = torch.bmm(o_latent.transpose(0, 1), layer.w_uv_t).transpose(0, 1)           # [T, Hq, v]
            delta = linear(o.reshape(num_tokens, -1), layer.o)
            x = add_rms_norm(delta, residual, layer.post_norm, eps)
            delta = layer.moe(x) if layer.moe is not None else \
                linear(kern.silu_and_mul(linear(x, layer.gate_up)), layer.down)
        return add_rms_norm(delta, residual, self.norm, eps)

    __call__ = forward
