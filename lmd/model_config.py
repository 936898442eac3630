"""The architecture facts both engines read from an HF ``config.json``."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ModelFormatError

# HF architecture name -> our family name; all are decoder-only Llama-style models (Phi-3 stores
# q/k/v and gate/up fused; SmolLM3 leaves RoPE out of some layers; Gemma adds norms, GeGLU, soft-capping;
# OLMo 2 norms only outputs; GLM rotates interleaved pairs of part of each head).
SUPPORTED_ARCHITECTURES = {
    'LlamaForCausalLM': 'llama',
    'MistralForCausalLM': 'mistral',
    'Qwen2ForCausalLM': 'qwen2',
    'Qwen3ForCausalLM': 'qwen3',
    'SmolLM3ForCausalLM': 'smollm3',
    'Phi3ForCausalLM': 'phi3',
    'Gemma2ForCausalLM': 'gemma2',
    'Gemma3ForCausalLM': 'gemma3',
    'Olmo2ForCausalLM': 'olmo2',
    'GlmForCausalLM': 'glm',
    'Glm4ForCausalLM': 'glm4',
    # mixture of experts (``MoeConfig``), in both engines
    'MixtralForCausalLM': 'mixtral',
    'Qwen2MoeForCausalLM': 'qwen2_moe',
    'Qwen3MoeForCausalLM': 'qwen3_moe',
    # experts on every layer with biases and a clamped SwiGLU, attention sinks (``ModelConfig.attention_sinks``)
    'GptOssForCausalLM': 'gpt_oss',
    # multi-head latent attention (``MlaConfig``) and experts with grouped routing, in both engines
    'DeepseekV2ForCausalLM': 'deepseek_v2',
}
# families whose config switches its sliding window on and off (use_sliding_window, HF's default False)
_WINDOW_SWITCHED = ('qwen2', 'qwen3', 'smollm3', 'qwen2_moe', 'qwen3_moe')
_GEMMA = ('gemma2', 'gemma3')
# the norm and RoPE switches of OLMo 2 and GLM (HF's olmo2, glm, glm4 modeling): OLMo 2 has no pre-norms,
# RMS-normalises the attention's and the MLP's outputs and q / k over all their heads at once; GLM
# rotates adjacent pairs (GPT-J style), GLM-4 also norms both outputs
_FAMILY_SWITCHES = {
    'olmo2': dict(pre_norms=False, sandwich_norms=True, qk_norm_all_heads=True),
    'glm': dict(rope_interleaved=True),
    'glm4': dict(rope_interleaved=True, sandwich_norms=True),
}
# Gemma's sliding layers when config.json has no layer_types: all but every n-th (HF's
# sliding_window_pattern; Gemma 2 alternates, its first layer sliding)
_SLIDING_PATTERN = {'gemma2': 2, 'gemma3': 6}

# config.json's quantization_config.quant_method -> lmd's model_format (LMDeploy's and vLLM's names);
# the layouts are described in lmd/weights/quant_layouts.py and source_format.py.
QUANT_METHODS = {'awq': 'awq', 'smooth_quant': 'w8a8', 'gptq': 'gptq', 'compressed-tensors': 'compressed-tensors',
                 'fp8': 'fp8', 'mxfp4': 'mxfp4'}
QUANTIZED_FORMATS = frozenset(QUANT_METHODS.values())


class ModelConfigError(ModelFormatError):
    """config.json is missing, malformed or names an architecture lmd does not run."""


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token
    (softmax, then top-k; their weights renormalised to sum 1 with ``norm_topk_prob``; gpt-oss the other
    way round, ``topk_method`` 'topk_softmax'), beside an
    always-on shared expert gated by a sigmoid where ``shared_intermediate_size`` > 0 (Qwen2-MoE)."""
    num_experts: int
    top_k: int
    intermediate_size: int         # each expert's
    norm_topk_prob: bool
    shared_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]  # per layer: the MoE MLP (False: a dense MLP of ModelConfig.intermediate_size)
    # DeepSeek-V2's routing ('greedy' or 'group_limited_greedy'): the top-k weights times
    # ``routed_scaling_factor``; 'group_limited_greedy' picks the ``topk_groups`` of ``num_groups`` expert
    # groups with the best expert first, then top-k inside them
    routed_scaling_factor: float = 1.0
    topk_method: str = 'greedy'
    num_groups: int = 1
    topk_groups: int = 1
    shared_gate: bool = True       # the shared expert's output scaled by sigmoid(gate(x)) (Qwen2-MoE); False: added as is
    # gpt-oss: 'topk_softmax' routing (top-k of the router's logits, then a softmax over those k), a bias on
    # the router and on each expert's matmuls, and its clamped SwiGLU: gate = min(gate, limit),
    # up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: silu(gate) * up
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek-V2's multi-head latent attention: q from ``q_proj`` (or the low-rank ``q_a_proj`` ->
    RMSNorm -> ``q_b_proj`` where ``q_lora_rank`` is set), per head ``qk_nope_head_dim`` plain dims and
    ``qk_rope_head_dim`` rotated ones; every head's keys and values come from one per-token latent,
    ``kv_lora_rank`` dims (RMS-normed) plus one shared rotated key of ``qk_rope_head_dim``: that row is what
    the KV cache holds (``lmd.weights.mla``)."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float           # (nope + rope) ** -0.5, times YaRN's mscale(mscale_all_dim) squared

    @property
    def cache_dim(self) -> int:
        """Elements of one token's cached row: the normed latent, then the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # HF name, e.g. 'LlamaForCausalLM'
    family: str                  # SUPPORTED_ARCHITECTURES' values: 'llama' | 'mistral' | ... | 'phi3'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None    # e.g. {'rope_type': 'llama3', 'factor': 8.0, ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool         # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool                # RMSNorm on q and k per head before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str             # the checkpoint's dtype: 'float32' | 'bfloat16' | 'float16'
    quantization_config: dict | None = None
    rope_layers: tuple[bool, ...] = ()  # per layer: RoPE on q and k (SmolLM3's NoPE layers: False); (): every layer
    sliding_window: int | None = None   # each token attends to at most this many (itself included); None: all
    moe: MoeConfig | None = None        # Mixtral's, Qwen2/3-MoE's, DeepSeek-V2's, gpt-oss's experts; None: dense
    mla: MlaConfig | None = None        # DeepSeek-V2's latent attention; None: q/k/v heads
    # Gemma's switches (HF's Gemma2/Gemma3 modeling); the defaults are Llama's
    norm_offset: float = 0.0            # every RMSNorm scales by (norm_offset + weight): Gemma's 1 + w
    sandwich_norms: bool = False        # RMSNorm on the attention's and the MLP's outputs too
    mlp_activation: str = 'silu'        # the gated MLP's act(gate) * up: 'silu' or 'gelu_tanh' (GeGLU)
    embed_scale: float = 1.0            # embeddings times this (Gemma: sqrt(hidden_size), in the model dtype)
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2 power; None: head_dim's
    attn_softcap: float = 0.0           # attention scores -> tanh(s / cap) * cap (Gemma 2); 0: none
    logit_softcap: float = 0.0          # final logits likewise
    rope_local_theta: float | None = None  # the sliding layers' own RoPE base, unscaled (Gemma 3); None: one table
    # OLMo 2's and GLM's switches (_FAMILY_SWITCHES); the defaults are Llama's
    pre_norms: bool = True              # RMSNorm on the attention's and the MLP's inputs (OLMo 2: none)
    qk_norm_all_heads: bool = False     # qk_norm over all of q's / k's heads at once (OLMo 2), not per head
    rope_interleaved: bool = False      # RoPE rotates pairs (2i, 2i + 1), not (i, i + rot / 2): GLM
    attention_sinks: bool = False       # a learned logit per head joins each softmax's denominator (gpt-oss)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a sliding-window layer: those config.json's ``layer_types`` names
        ``'sliding_attention'``; without ``layer_types``, every layer (Mistral, Phi-3), Qwen2's from
        ``max_window_layers`` on, Gemma's all but every ``sliding_window_pattern``-th."""
        types = self.raw.get('layer_types')
        if types is not None:
            return tuple(t == 'sliding_attention' for t in types)
        if self.family in _SLIDING_PATTERN:
            pattern = int(self.raw.get('sliding_window_pattern') or _SLIDING_PATTERN[self.family])
            return tuple((i + 1) % pattern != 0 for i in range(self.num_layers))
        first = self.raw.get('max_window_layers', 0) if self.family == 'qwen2' else 0
        return tuple(i >= first for i in range(self.num_layers))

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, the sliding window of its attention (a query attends to its last ``w`` tokens,
        itself included, as HF masks ``kv > q - w``), or 0 for full attention: ``sliding_window`` on the
        ``sliding_layers``."""
        window = self.sliding_window or 0
        return tuple(window if s else 0 for s in self.sliding_layers)

    @property
    def local_rope_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it rotates by the local table (``rope_local_theta``: Gemma 3's sliding
        layers) rather than the model's; () where there is one table."""
        return self.sliding_layers if self.rope_local_theta is not None else ()

    @property
    def attention_scale(self) -> float:
        """What q · k is multiplied by before the softmax (and the soft-cap)."""
        if self.mla is not None:
            return self.mla.softmax_scale
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_window(self) -> int:
        """The window every layer keeps to when all of them slide (a sequence's blocks before it are
        never read again, so the block managers give them back), else 0."""
        windows = self.layer_windows
        return min(windows) if windows and all(windows) else 0

    @property
    def model_format(self) -> str:
        """The weight format config.json declares: one of ``QUANTIZED_FORMATS`` (quantization_config), or 'hf'."""
        return QUANT_METHODS[self.quantization_config['quant_method']] if self.quantization_config else 'hf'

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (``moe``)."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    def uses_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates q and k."""
        return not self.rope_layers or self.rope_layers[layer]

    @staticmethod
    def from_dict(cfg: dict[str, Any], where: str = 'config.json') -> 'ModelConfig':
        archs = cfg.get('architectures') or []
        # a backbone saved alone (``Qwen3Model``: sentence-transformers saves embedders so) is its causal LM's
        causal = [a[:-len('Model')] + 'ForCausalLM' if isinstance(a, str) and a.endswith('Model') else a for a in archs]
        arch = next((a for a in archs + causal if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f'{where}: architecture {archs or cfg.get("model_type")!r} is not supported; '
                f'lmd runs {", ".join(SUPPORTED_ARCHITECTURES)}')
        family = SUPPORTED_ARCHITECTURES[arch]
        quant = cfg.get('quantization_config')
        if quant is not None and (not isinstance(quant, dict) or quant.get('quant_method') not in QUANT_METHODS):
            method = quant.get('quant_method') if isinstance(quant, dict) else quant
            raise ModelConfigError(
                f'{where}: quantization_config.quant_method {method!r} is not supported; lmd reads '
                + ', '.join(repr(m) for m in QUANT_METHODS) + ' checkpoints')
        try:
            hidden = int(cfg['hidden_size'])
            num_heads = int(cfg['num_attention_heads'])
            eos = cfg.get('eos_token_id')
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            rope_scaling = cfg.get('rope_scaling') or None
            rope_theta = cfg.get('rope_theta')
            rope_params = cfg.get('rope_parameters')  # transformers >= 5 nests rope settings here
            local_theta = cfg.get('rope_local_base_freq', 10000.0) if family == 'gemma3' else None
            if isinstance(rope_params, dict) and 'full_attention' in rope_params:  # per layer type (Gemma 3)
                local_theta = rope_params.get('sliding_attention', {}).get('rope_theta', local_theta)
                rope_params = rope_params['full_attention']
            if isinstance(rope_params, dict):
                rope_theta = rope_theta or rope_params.get('rope_theta')
                if rope_scaling is None and rope_params.get('rope_type', 'default') != 'default':
                    rope_scaling = dict(rope_params)
            dtype = str(cfg.get('torch_dtype') or cfg.get('dtype') or 'float32').replace('torch.', '')
            return ModelConfig(
                architecture=arch,
                family=family,
                vocab_size=int(cfg['vocab_size']),
                hidden_size=hidden,
                intermediate_size=int(cfg['intermediate_size']),
                num_layers=int(cfg['num_hidden_layers']),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get('num_key_value_heads') or num_heads),
                # DeepSeek-V2: the rotated dims (HF's head_dim, the RoPE table's width)
                head_dim=int(cfg['qk_rope_head_dim'] if family == 'deepseek_v2' else
                             cfg.get('head_dim') or hidden // num_heads),
                rms_norm_eps=float(cfg.get('rms_norm_eps', 1e-6)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get('max_position_embeddings', 4096)),
                tie_word_embeddings=bool(cfg.get('tie_word_embeddings', family in _GEMMA)),
                attention_bias=bool(cfg.get('attention_bias', cfg.get('qkv_bias',
                                                                       family in ('qwen2', 'qwen2_moe', 'gpt_oss')))),
                qk_norm=family in ('qwen3', 'qwen3_moe', 'gemma3', 'olmo2'),
                bos_token_id=cfg.get('bos_token_id'),
                eos_token_ids=eos_ids,
                torch_dtype=dtype if dtype in ('float32', 'bfloat16', 'float16') else 'float32',
                quantization_config=cfg.get('quantization_config'),
                rope_layers=_rope_layers(cfg, family),
                sliding_window=_sliding_window(cfg, family),
                moe=_moe_config(cfg, family),
                mla=_mla_config(cfg, rope_scaling) if family == 'deepseek_v2' else None,
                attention_sinks=family == 'gpt_oss',
                raw=dict(cfg),
                **(_gemma_fields(cfg, family, hidden, local_theta) if family in _GEMMA else {}),
                **_FAMILY_SWITCHES.get(family, {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelConfigError(f'{where}: malformed model config ({type(e).__name__}: {e})') from None

    @staticmethod
    def from_dir(model_dir: str) -> 'ModelConfig':
        path = os.path.join(model_dir, 'config.json')
        if not os.path.isfile(path):
            raise ModelConfigError(f'{model_dir} has no config.json; is it a model directory?')
        try:
            with open(path, encoding='utf-8') as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelConfigError(f'{path}: cannot read it as JSON ({e})') from None
        return ModelConfig.from_dict(cfg, where=path)


def _rope_layers(cfg: dict, family: str) -> tuple[bool, ...]:
    """SmolLM3's per-layer RoPE flags: ``no_rope_layers[i]`` is 1 where layer i uses RoPE (HF's
    ``use_rope = config.no_rope_layers[layer_idx]``), else every ``no_rope_layer_interval``-th layer
    goes without; () for the other families (every layer rotates)."""
    if family != 'smollm3':
        return ()
    num_layers = int(cfg['num_hidden_layers'])
    flags = cfg.get('no_rope_layers')
    if flags is None:
        interval = int(cfg.get('no_rope_layer_interval', 4))
        flags = [(i + 1) % interval != 0 for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f'no_rope_layers has {len(flags)} entries for {num_layers} layers')
    return tuple(bool(f) for f in flags)


def _sliding_window(cfg: dict, family: str) -> int | None:
    """The attention window HF applies, or None: ``sliding_window`` where the family's config has no
    switch for it (Mistral, Phi-3), else only with ``use_sliding_window``."""
    window = cfg.get('sliding_window')
    if family in _WINDOW_SWITCHED and not cfg.get('use_sliding_window', False):
        return None
    return int(window) if window else None


def _gemma_fields(cfg: dict, family: str, hidden: int, local_theta: float | None) -> dict:
    """Gemma's ``ModelConfig`` switches as HF's Gemma2/Gemma3 read them (a soft-cap missing from
    config.json takes HF's default: Gemma 2 caps, Gemma 3 does not)."""
    act = cfg.get('hidden_activation') or cfg.get('hidden_act') or 'gelu_pytorch_tanh'
    if act not in ('gelu_pytorch_tanh', 'gelu_tanh'):
        raise ValueError(f'hidden_activation {act!r} is not supported: Gemma runs GeGLU (gelu_pytorch_tanh)')
    caps = (50.0, 30.0) if family == 'gemma2' else (None, None)
    return dict(norm_offset=1.0, sandwich_norms=True, mlp_activation='gelu_tanh', embed_scale=hidden ** 0.5,
                query_pre_attn_scalar=float(cfg.get('query_pre_attn_scalar', 256)),
                attn_softcap=float(cfg.get('attn_logit_softcapping', caps[0]) or 0.0),
                logit_softcap=float(cfg.get('final_logit_softcapping', caps[1]) or 0.0),
                rope_local_theta=None if local_theta is None else float(local_theta))


_MOE_FAMILIES = ('mixtral', 'qwen2_moe', 'qwen3_moe', 'deepseek_v2', 'gpt_oss')


def _moe_config(cfg: dict, family: str) -> MoeConfig | None:
    """The experts as transformers reads them (None for a dense family): Mixtral's ``num_local_experts``
    of ``intermediate_size`` on every layer, its top-k weights always renormalised; Qwen's
    ``num_experts`` of ``moe_intermediate_size`` on the layers ``(i + 1) % decoder_sparse_step == 0``
    outside ``mlp_only_layers``, renormalised with ``norm_topk_prob``, Qwen2-MoE's shared expert beside
    them. ``router_jitter_noise`` and the auxiliary loss are training settings; other settings lmd does
    not run raise ValueError."""
    if family not in _MOE_FAMILIES:
        return None
    num_layers = int(cfg['num_hidden_layers'])
    quant_method = (cfg.get('quantization_config') or {}).get('quant_method')
    if family == 'gpt_oss' and quant_method == 'mxfp4':  # its experts dequantized at load (lmd.weights.mxfp4)
        return _gpt_oss_moe_config(cfg, num_layers)
    # the other families' experts run quantized, one matmul each
    if family == 'gpt_oss' and cfg.get('quantization_config'):
        raise ValueError(f'gpt-oss checkpoints quantized by {quant_method!r} are not supported (its experts come '
                         "stacked: lmd reads them in bfloat16 or as 'mxfp4'); use the original checkpoint")
    if family == 'deepseek_v2' and cfg.get('quantization_config'):
        raise ValueError('quantized deepseek_v2 checkpoints are not supported yet (its latent attention runs in '
                         'float); use a float checkpoint')
    if cfg.get('hidden_act', 'silu') != 'silu':
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported: the experts run SwiGLU ('silu')")
    if family == 'qwen2_moe' and cfg.get('use_sliding_window') and 'layer_types' not in cfg:
        raise ValueError('use_sliding_window without layer_types is not supported for Qwen2-MoE')
    if family == 'deepseek_v2':
        return _deepseek_moe_config(cfg, num_layers)
    if family == 'gpt_oss':
        return _gpt_oss_moe_config(cfg, num_layers)
    if family == 'mixtral':
        num_experts, intermediate = int(cfg['num_local_experts']), int(cfg['intermediate_size'])
        norm_topk_prob, shared, sparse = True, 0, (True,) * num_layers
    else:
        num_experts = int(cfg.get('num_experts') or cfg['num_local_experts'])
        intermediate = int(cfg['moe_intermediate_size'])
        norm_topk_prob = bool(cfg.get('norm_topk_prob', False))
        shared = int(cfg.get('shared_expert_intermediate_size', 5632)) if family == 'qwen2_moe' else 0
        step, dense = int(cfg.get('decoder_sparse_step', 1)), set(cfg.get('mlp_only_layers') or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    top_k = int(cfg['num_experts_per_tok'])
    if not 1 <= top_k <= num_experts:
        raise ValueError(f'num_experts_per_tok {top_k} must be in [1, {num_experts}] (the number of experts)')
    return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=intermediate,
                     norm_topk_prob=norm_topk_prob, shared_intermediate_size=shared, sparse_layers=sparse)


def _deepseek_moe_config(cfg: dict, num_layers: int) -> MoeConfig:
    """DeepSeek-V2's experts: ``n_routed_experts`` of ``moe_intermediate_size`` on the layers from
    ``first_k_dense_replace`` on (every ``moe_layer_freq``-th, as DeepSeek's own code; transformers has
    no such setting and DeepSeek ships 1), ``n_shared_experts`` always-on experts fused into one of
    ``n_shared_experts * moe_intermediate_size`` without a gate, routing by softmax then top-k
    ('greedy') or top-k within the best ``topk_group`` of ``n_group`` groups ('group_limited_greedy'),
    the weights times ``routed_scaling_factor``."""
    num_experts, intermediate = int(cfg['n_routed_experts']), int(cfg['moe_intermediate_size'])
    top_k = int(cfg['num_experts_per_tok'])
    if not 1 <= top_k <= num_experts:
        raise ValueError(f'num_experts_per_tok {top_k} must be in [1, {num_experts}] (n_routed_experts)')
    if cfg.get('norm_topk_prob'):
        raise ValueError('norm_topk_prob=true is not supported for DeepSeek-V2: transformers ignores it while '
                         "DeepSeek's code renormalises instead of scaling; its checkpoints ship false")
    method = cfg.get('topk_method') or 'greedy'
    groups, topk_groups = 1, 1
    if method == 'group_limited_greedy':
        groups, topk_groups = int(cfg['n_group']), int(cfg['topk_group'])
        if num_experts % groups or not 1 <= topk_groups <= groups or top_k > topk_groups * (num_experts // groups):
            raise ValueError(f'group_limited_greedy needs n_group {groups} dividing n_routed_experts {num_experts}, '
                             f'topk_group {topk_groups} in [1, n_group] and num_experts_per_tok {top_k} within '
                             'the experts of topk_group groups')
    elif method != 'greedy':
        raise ValueError(f"topk_method {method!r} is not supported: DeepSeek-V2 routes by 'greedy' or "
                         "'group_limited_greedy'")
    first, freq = int(cfg.get('first_k_dense_replace') or 0), int(cfg.get('moe_layer_freq') or 1)
    return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=intermediate, norm_topk_prob=False,
                     shared_intermediate_size=intermediate * int(cfg.get('n_shared_experts') or 0),
                     sparse_layers=tuple(i >= first and i % freq == 0 for i in range(num_layers)),
                     routed_scaling_factor=float(cfg.get('routed_scaling_factor', 1.0)), topk_method=method,
                     num_groups=groups, topk_groups=topk_groups, shared_gate=False)


def _gpt_oss_moe_config(cfg: dict, num_layers: int) -> MoeConfig:
    """gpt-oss's experts (HF's GptOssMLP): ``num_local_experts`` of ``intermediate_size`` on every layer, the
    router's top-k logits softmaxed (their weights sum to 1), biases on the router and the experts, the
    SwiGLU clamped at ``swiglu_limit`` with ``swiglu_alpha`` in its sigmoid."""
    num_experts, top_k = int(cfg['num_local_experts']), int(cfg['num_experts_per_tok'])
    if not 1 <= top_k <= num_experts:
        raise ValueError(f'num_experts_per_tok {top_k} must be in [1, {num_experts}] (num_local_experts)')
    limit = float(cfg.get('swiglu_limit', 7.0))
    if not limit > 0:
        raise ValueError(f'swiglu_limit {limit} must be > 0 (gpt-oss clamps its SwiGLU there)')
    return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=int(cfg['intermediate_size']),
                     norm_topk_prob=True, shared_intermediate_size=0, sparse_layers=(True,) * num_layers,
                     topk_method='topk_softmax', router_bias=True, expert_bias=True, swiglu_limit=limit,
                     swiglu_alpha=float(cfg.get('swiglu_alpha', 1.702)))


def _mla_config(cfg: dict, rope_scaling: dict | None) -> MlaConfig:
    """DeepSeek-V2's attention sizes, and its softmax scale as transformers' ``yarn_apply_mscale``: under
    a scaled RoPE with ``mscale_all_dim``, (nope + rope) ** -0.5 times (0.1 mscale_all_dim ln(factor) + 1)
    squared. Biases on its matmuls (``attention_bias``) are not supported."""
    if cfg.get('attention_bias') or cfg.get('mlp_bias'):
        raise ValueError('attention_bias / mlp_bias are not supported for DeepSeek-V2 (its checkpoints have none)')
    q_lora = cfg.get('q_lora_rank')
    nope, rope = int(cfg['qk_nope_head_dim']), int(cfg['qk_rope_head_dim'])
    if rope % 2:
        raise ValueError(f'qk_rope_head_dim {rope} must be even (its dims rotate in pairs)')
    scale = (nope + rope) ** -0.5
    p = rope_scaling or {}
    factor, mscale_all_dim = float(p.get('factor') or 1.0), float(p.get('mscale_all_dim') or 0.0)
    if (p.get('rope_type') or p.get('type') or 'default') != 'default' and mscale_all_dim and factor > 1:
        scale *= (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2
    return MlaConfig(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(cfg['kv_lora_rank']),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(cfg['v_head_dim']),
                     softmax_scale=scale)
