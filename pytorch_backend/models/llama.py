"""The Llama family in plain torch: Llama (incl. Llama-3 rope scaling), Mistral, Qwen2, Qwen3,
SmolLM3, Phi-3, Gemma 2, Gemma 3, OLMo 2, GLM and GLM-4.

They differ only in small switches read from ``ModelConfig``:
- Qwen2 has biases on q/k/v (``attention_bias``);
- Qwen3 RMS-normalises q and k per head before RoPE (``qk_norm``) and has an
  explicit ``head_dim``;
- Llama may carry a bias on o_proj too (``attention_bias``) and on the MLP
  (``mlp_bias``); Llama-3 and others scale RoPE (``lmd.weights.rope``);
- SmolLM3 leaves RoPE out of some layers (``ModelConfig.uses_rope``);
- Phi-3 stores q/k/v and gate/up fused already (``schema.layer_matmuls``) and scales RoPE by
  LongRoPE, whose factors depend on the session length (``build_rope``);
- Gemma scales its embeddings (``embed_scale``), norms by (1 + w) (``schema.norm_weight``), norms the
  attention's and the MLP's outputs too (``sandwich_norms``), runs GeGLU, scales scores by
  ``query_pre_attn_scalar``; Gemma 2 soft-caps scores and logits, Gemma 3 normalises q and k like
  Qwen3 and rotates its sliding layers by a table of their own (``local_rope_layers``);
- OLMo 2 has no pre-norms (``pre_norms``: each block reads the residual stream itself), norms the
  attention's and the MLP's outputs, and q and k over all their heads at once (``qk_norm_all_heads``);
- GLM stores gate/up fused and rotates interleaved pairs of half of each head, run as half-split by
  permuting q's and k's rows at load (``lmd.weights.interleaved_rope``); GLM-4 norms both outputs too;
- gpt-oss (its experts in ``moe.py``) adds a learned sink logit per head to each attention softmax
  (``attention_sinks``: ``DecoderLayer.sinks``).

Weights load from HF names and are fused at load as the weights layer says
(``lmd.weights.schema``: q/k/v into one ``qkv`` [(Hq + 2 Hk) * D, H], gate/up into one
``gate_up`` [2 I, H]), so a layer runs four matmuls. The matmuls of a quantized
checkpoint come in ``quantized`` (HF weight name -> a layout of ``lmd.weights.quant_layouts``)
and stay quantized, fused the same way (their parts concatenated along N, or kept as parts where
they read differently permuted inputs: ``schema.fuse_quantized``). The decoder
loop lives in ``CausalLM.forward`` on purpose: a decode step is Python-overhead bound at
small batch, and the loop touches plain tensors rather than module trees.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig
from lmd.weights.interleaved_rope import to_half_split
from lmd.weights.memory import kv_block_bytes
from lmd.weights.rope import build_cos_sin_cache
from lmd.weights.schema import (check_quantized_weights, fuse_quantized, layer_norms, matmul_parts, norm_weight,
                                quant_format)

from ..context import StepContext
from ..kernels import Kernels, get_kernels, prepare_matmul


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor | None   # [H]; None: no pre-norm (OLMo 2)
    # float [N, K], or a quantized tuple standing for it (lmd.weights.schema; a list: in parts)
    qkv_weight: torch.Tensor | tuple | list  # [(Hq + 2 Hk) * D, H]
    qkv_bias: torch.Tensor | None     # [(Hq + 2 Hk) * D]
    q_norm: torch.Tensor | None       # [D] (Qwen3); [Hq * D] over all heads (OLMo 2)
    k_norm: torch.Tensor | None       # [D] (Qwen3); [Hk * D] over all heads (OLMo 2)
    o_weight: torch.Tensor | tuple    # [H, Hq * D]
    o_bias: torch.Tensor | None       # [H]
    post_norm: torch.Tensor | None    # [H]; None: no pre-norm (OLMo 2)
    gate_up_weight: torch.Tensor | tuple | list  # [2 I, H]
    gate_up_bias: torch.Tensor | None  # [2 I]
    down_weight: torch.Tensor | tuple  # [H, I]
    down_bias: torch.Tensor | None    # [H]
    rope: bool = True                 # q and k rotated (SmolLM3's NoPE layers: False)
    local_rope: bool = False          # rotated by the sliding layers' own table (Gemma 3)
    attn_out_norm: torch.Tensor | None = None  # [H] on the attention's output (Gemma)
    mlp_out_norm: torch.Tensor | None = None   # [H] on the MLP's output (Gemma)
    window: int = 0                   # sliding window: a query reads its last `window` tokens; 0: all
    sinks: torch.Tensor | None = None  # float32 [Hq]: each head's sink logit in its softmax (gpt-oss)
    # a mixture of experts in place of gate_up / down (models/moe.py; their weights None then)
    moe: Callable[[torch.Tensor], torch.Tensor] | None = None
    # the four matmuls' parameters as the kernel backend wants them (Kernels.prepare_linear)
    qkv: object = None
    o: object = None
    gate_up: object = None
    down: object = None

    def prepare(self, kern: Kernels) -> None:
        self.qkv = prepare_matmul(kern, self.qkv_weight, self.qkv_bias)
        self.o = prepare_matmul(kern, self.o_weight, self.o_bias)
        if self.gate_up_weight is not None:  # None: a mixture of experts (moe)
            self.gate_up = prepare_matmul(kern, self.gate_up_weight, self.gate_up_bias)
            self.down = prepare_matmul(kern, self.down_weight, self.down_bias)


class CausalLM:
    """A Llama-family decoder over a paged KV cache; see the module docstring."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = 'cpu', kernel_backend: str | None = None,
                 quantized: dict[str, tuple] | None = None, layers: range | None = None):
        self._setup(config, dtype, device, kernel_backend, layers)
        quantized = quantized or {}
        check_quantized_weights(config, weights, quantized)
        weights = to_half_split(config, weights, quantized)  # GLM's interleaved RoPE, as half-split
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.softcap = config.attn_softcap
        # HF multiplies by sqrt(H) rounded to the model dtype
        self.embed_scale = None if config.embed_scale == 1.0 else torch.tensor(config.embed_scale, dtype=dtype,
                                                                                device=self.device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in weights else None

        def norm(name: str) -> torch.Tensor | None:
            return norm_weight(config, weights[name], dtype).to(self.device) if name in weights else None

        def on_device(q: tuple) -> tuple:
            return tuple(t.to(self.device) for t in q)

        def cat(names: list[str]) -> torch.Tensor | tuple | list | None:
            parts = [quantized.get(n) for n in names]
            if any(q is not None for q in parts):
                if None in parts or len({(quant_format(q), q[1].shape[1:]) for q in parts}) != 1:
                    raise ModelFormatError(f'{config.architecture}: {", ".join(names)} mix quantized formats '
                                           'or group sizes; they are fused into one matmul')
                fused = fuse_quantized(parts)
                return [on_device(q) for q in fused] if isinstance(fused, list) else on_device(fused)
            if names[0] not in weights:
                return None
            return torch.cat([weights[n].to(dtype) for n in names], dim=0).to(self.device).contiguous()

        # a pipeline stage holds the embedding when it is the first, the final norm and lm_head when the last
        tied = self.last_stage and config.tie_word_embeddings
        embed = get('model.embed_tokens.weight') if self.first_stage or tied else None
        self.embed_tokens = embed if self.first_stage else None
        self.norm = self.lm_head = None
        if self.last_stage:
            self.norm = norm('model.norm.weight')
            # tied models share the embedding (a checkpoint may still carry a copy of it); GPTQ's may quantize it
            self.lm_head = quantized.get('lm_head.weight')
            if self.lm_head is None:
                self.lm_head = embed if tied else get('lm_head.weight')
            else:  # one part: GGUF blocks may become W8A16 (fuse_quantized)
                self.lm_head = on_device(fuse_quantized([self.lm_head]))
        self.layers: list[DecoderLayer] = []
        for n in self.layer_ids:
            p = f'model.layers.{n}.'
            attn, mlp = p + 'self_attn.', p + 'mlp.'
            norms = dict(input_norm=None, post_norm=None)  # none without pre-norms (OLMo 2)
            norms.update({ours: norm(f'{p}{hf_name}.weight') for ours, hf_name in layer_norms(config).items()})
            self.layers.append(DecoderLayer(
                qkv_weight=cat(matmul_parts(config, n, 'qkv')),
                qkv_bias=cat(matmul_parts(config, n, 'qkv', 'bias')),
                q_norm=norm(attn + 'q_norm.weight'),
                k_norm=norm(attn + 'k_norm.weight'),
                o_weight=cat(matmul_parts(config, n, 'o')),
                o_bias=maybe(attn + 'o_proj.bias'),
                gate_up_weight=cat(matmul_parts(config, n, 'gate_up')),
                gate_up_bias=cat(matmul_parts(config, n, 'gate_up', 'bias')),
                down_weight=cat(matmul_parts(config, n, 'down')),
                down_bias=maybe(mlp + 'down_proj.bias'),
                rope=config.uses_rope(n),
                local_rope=bool(config.local_rope_layers and config.local_rope_layers[n]),
                window=config.layer_windows[n],
                sinks=weights[attn + 'sinks'].float().to(self.device) if config.attention_sinks else None,
                **norms,
            ))
            self.layers[-1].prepare(self.kernels)
        self.lm_head_params = prepare_matmul(self.kernels, self.lm_head, None) if self.last_stage else None
        self.build_rope()

    def _setup(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
               kernel_backend: str | None, layers: range | None = None) -> None:
        """What every model of this backend keeps of its config, dtype, device and kernels; ``layers``: the
        decoder layers it holds (a pipeline stage's; None: all)."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f'dtype {dtype} is not supported; use float32, bfloat16 or float16')
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.kernels: Kernels = get_kernels(self.device, kernel_backend)
        self.num_layers = config.num_layers
        # pipeline parallelism (pipeline_parallel.py): the layers of this stage; the first stage embeds the
        # tokens, the last one norms and turns hidden states into logits
        self.layer_ids = range(config.num_layers) if layers is None else layers
        if not (0 <= self.layer_ids.start < self.layer_ids.stop <= config.num_layers and self.layer_ids.step == 1):
            raise ValueError(f'layers {self.layer_ids} are not a run of the model\'s {config.num_layers} layers')
        self.first_stage = self.layer_ids.start == 0
        self.last_stage = self.layer_ids.stop == config.num_layers
        self.num_heads = config.num_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        self.scale = config.attention_scale
        # tensor parallelism (distributed.TensorParallel): this rank's heads, columns of I and rows of the
        # vocabulary (lmd.weights.tensor_parallel), summed and gathered over the ranks; None: all of them
        self.tp = None

    def build_rope(self, session_len: int | None = None) -> None:
        """The RoPE table for sequences up to ``session_len`` (default: the model's context); LongRoPE
        picks its factors by it (``lmd.weights.rope``). Gemma 3's sliding layers read a table of their own."""
        self.cos_sin_cache = build_cos_sin_cache(self.config, self.dtype, self.device, session_len)
        self.cos_sin_local = (build_cos_sin_cache(self.config, self.dtype, self.device, session_len, local=True)
                              if self.config.local_rope_layers else None)

    # -- KV cache -------------------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int, block_size: int, quant_policy: int = 0) -> list[tuple]:
        """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hk, D]; zero-filled for
        kernels that read padded contexts, so masked padding never multiplies garbage
        (0 * NaN) into the output. quant_policy 8 / 4: per layer (k_cache, v_cache, k_params,
        v_params), the caches uint8 [num_blocks, block_size, Hk, D * bits / 8] and the params
        float32 [num_blocks, block_size, Hk, 2] (scale, zero; kernels/torch_ops.py)."""
        if quant_policy not in (0, 4, 8):
            raise ValueError(f'quant_policy={quant_policy} is invalid: use 0 (no KV quantization), 8 or 4')
        if quant_policy == 4 and self.head_dim % 2:
            raise ValueError(f'quant_policy=4 packs two codes a byte: head_dim {self.head_dim} must be even')
        # The native kernels read only slots that were written, so on the CPU the cache
        # can stay untouched (pages are committed as they fill, not all at start).
        alloc = partial(torch.empty if self.kernels.name == 'native' else torch.zeros, device=self.device)
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        if not quant_policy:
            return [(alloc(shape, dtype=self.dtype), alloc(shape, dtype=self.dtype)) for _ in self.layer_ids]
        codes = (*shape[:3], self.head_dim * quant_policy // 8)
        return [(alloc(codes, dtype=torch.uint8), alloc(codes, dtype=torch.uint8),
                 alloc((*shape[:3], 2), dtype=torch.float32), alloc((*shape[:3], 2), dtype=torch.float32))
                for _ in self.layer_ids]

    def kv_cache_bytes_per_block(self, block_size: int, quant_policy: int = 0) -> int:
        """K and V of every layer (``lmd.weights.memory.kv_block_bytes``)."""
        return kv_block_bytes(self.config, block_size, self.dtype, quant_policy)

    # -- forward --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                handed: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, H] after the final norm; writes the new
        tokens' K/V into ctx.kv_caches at ctx.slot_mapping.

        A pipeline stage's model runs its layers only: a later stage starts from ``handed``, [2, T, H] the
        residual stream and the last block's output not yet added to it, which a stage before the last
        returns in place of the normed hidden states."""
        kern = self.kernels
        rms_norm, add_rms_norm, linear = kern.rms_norm, kern.add_rms_norm, kern.linear
        paged_attention = kern.paged_attention
        act_and_mul = kern.silu_and_mul if self.config.mlp_activation == 'silu' else kern.gelu_tanh_and_mul
        eps, scale, softcap = self.eps, self.scale, self.softcap
        num_tokens = input_ids.shape[0]
        num_heads, num_kv_heads, q_size = self.num_heads, self.num_kv_heads, self.q_size
        slot_mapping = ctx.slot_mapping

        tp = self.tp
        # the residual stream is updated in place: add_rms_norm(delta, residual) adds, then normalises
        if handed is not None:
            residual, delta = handed[0], handed[1]
        else:
            residual = F.embedding(input_ids, self.embed_tokens) if tp is None else tp.embedding(input_ids,
                                                                                                  self.embed_tokens)
            if self.embed_scale is not None:
                residual = residual * self.embed_scale
            delta = None
        lora = ctx.lora
        for i, layer, cache in zip(self.layer_ids, self.layers, ctx.kv_caches):
            k_cache, v_cache = cache[0], cache[1]
            kv_params = {} if len(cache) == 2 else dict(k_params=cache[2], v_params=cache[3])
            # attention block
            if layer.input_norm is None:  # no pre-norm (OLMo 2): the residual stream itself
                x = residual if delta is None else residual.add_(delta)
            elif delta is None:
                x = rms_norm(residual, layer.input_norm, eps)
            else:
                x = add_rms_norm(delta, residual, layer.input_norm, eps)
            qkv = linear(x, layer.qkv)
            if lora is not None:
                lora.add(i, 'qkv', x, qkv)
            cos_sin = self.cos_sin_local if layer.local_rope else self.cos_sin_cache
            if layer.q_norm is None and layer.rope:
                q = kern.rope_fill_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads,
                                      num_kv_heads, **kv_params)
            else:  # Qwen3 normalises q and k per head before RoPE; SmolLM3's NoPE layers skip it
                q = self._split_rope_fill(layer, qkv, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                          kv_params)
            o = paged_attention(q, k_cache, v_cache, ctx, scale, window=layer.window, softcap=softcap,
                                sinks=layer.sinks, **kv_params)
            o = o.reshape(num_tokens, q_size)
            delta = linear(o, layer.o)
            if lora is not None:
                lora.add(i, 'o', o, delta)
            if tp is not None:
                tp.all_reduce(delta)
            if layer.attn_out_norm is not None:
                delta = rms_norm(delta, layer.attn_out_norm, eps)
            # MLP block
            if layer.post_norm is None:
                x = residual.add_(delta)
            else:
                x = add_rms_norm(delta, residual, layer.post_norm, eps)
            if layer.moe is None and lora is None:
                delta = linear(act_and_mul(linear(x, layer.gate_up)), layer.down)
            elif layer.moe is None:
                gate_up = linear(x, layer.gate_up)
                lora.add(i, 'gate_up', x, gate_up)
                act = act_and_mul(gate_up)
                delta = linear(act, layer.down)
                lora.add(i, 'down', act, delta)
            else:
                delta = layer.moe(x)
            if tp is not None:
                tp.all_reduce(delta)
            if layer.mlp_out_norm is not None:
                delta = rms_norm(delta, layer.mlp_out_norm, eps)
        if not self.last_stage:
            return torch.stack((residual, delta))
        return add_rms_norm(delta, residual, self.norm, eps)

    def _split_rope_fill(self, layer: DecoderLayer, qkv: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_params: dict) -> torch.Tensor:
        """rope_fill_kv step by step: q and k normalised per head (q_norm), then rotated (rope)."""
        kern = self.kernels
        num_tokens, q_size, kv_size = qkv.shape[0], self.q_size, self.kv_size
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None and self.config.qk_norm_all_heads:  # OLMo 2: over all heads at once
            q = kern.rms_norm(qkv[:, :q_size], layer.q_norm, self.eps).view_as(q)
            k = kern.rms_norm(qkv[:, q_size:q_size + kv_size], layer.k_norm, self.eps).view_as(k)
        elif layer.q_norm is not None:
            q = kern.rms_norm(q, layer.q_norm, self.eps)
            k = kern.rms_norm(k, layer.k_norm, self.eps)
        if layer.rope:
            q, k = kern.apply_rotary(q, k, positions, cos_sin)
        kern.fill_kv_cache(k, v, k_cache, v_cache, slot_mapping, **kv_params)
        return q.contiguous()  # a view into qkv where nothing touched it

    __call__ = forward

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (already normed by forward) -> float32 logits [N, vocab] (soft-capped: Gemma 2)."""
        logits = self.kernels.linear(hidden, self.lm_head_params)
        logits = (logits if self.tp is None else self.tp.gather_vocab(logits)).float()
        cap = self.config.logit_softcap
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits
