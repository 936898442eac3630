"""The C++ model (``_turbomind.LlamaModel``) built from HF-named weights.

Weights are fused by the weights layer (``lmd.weights.schema.fuse_weights``: q/k/v into one
``qkv``, gate/up into one ``gate_up``; quantized matmuls as ``<name>.qweight/.scales[/.mins]``,
``lmd.weights.quant_layouts``), packed here into the panels TurboMind's GEMM reads
(``pack_matmuls``) and handed to C++ as DLPack views; this object keeps the torch tensors
alive for as long as the C++ model reads them. The KV cache lives in C++, and so do the LoRA
adapters' weights (``set_adapter`` copies them; the model's twins share them). A directory
``lmd convert --backend turbomind`` wrote holds the fused tensors already
(``lmd.weights.turbomind_layout``; ``TurbomindModel.from_fused``).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch.utils.dlpack import to_dlpack

from lmd.model_config import ModelConfig
from lmd.weights.dtype import DTYPE_NAMES
from lmd.weights.moe import EXPERT_STACKS, MOE_MATMULS
from lmd.weights.quant_layouts import gguf_as_w8a16
from lmd.weights.rope import build_cos_sin_cache
from lmd.weights.schema import MATMUL_SUFFIXES, fuse_weights, linear_formats

from lmd.kernels import ops, pack_w4a16_panels, pack_w8a16_panels

from . import _turbomind

if TYPE_CHECKING:
    from lmd.lora import LoraAdapter

SMALL_TENSOR_BYTES = 16 << 20
# the float matmuls [N, K] of a layer, dense or sparse (lmd.weights.moe), that run packed
_MATMUL_SUFFIXES = MATMUL_SUFFIXES + tuple(f'.{name}' for name in MOE_MATMULS)


def _narrowed(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` as float16 when that holds every value exactly (GGUF's fp16 block scales
    and minimums), else itself."""
    half = t.half()
    return half if torch.equal(half.float(), t) else t


def pack_matmuls(tensors: dict[str, torch.Tensor], w8a16_panels: bool = True) -> dict[str, torch.Tensor]:
    """Every float matmul weight [N, K] of ``fuse_weights``' output -> the panels the C++ GEMM
    reads, [ceil(N / 16), K, 16] (``ops.pack_linear``; lib/kernels/csrc/cpu/gemm.h), under the same
    name, in place: each row-major copy is let go as soon as its panels exist; W4A16 ones
    (``<name>.qweight/.scales/.mins``) likewise into their panels (``ops.pack_w4a16``), the
    scales and mins in float16 where that loses nothing (a quarter fewer bytes per weight), and
    W8A16 ones (``<name>.qweight/.scales``, int8, scales [N, K / G]) into theirs (``ops.pack_w8a16``;
    kept as rows with ``w8a16_panels=False``, for the int8-activation kernel, which reads rows; but the
    lm_head's, whose float-activation panels cost less than that kernel: 1.4 against 2.25 ms of a SmolLM2
    decode step), and with
    them GGUF blocks whose types have a W8A16 form (``gguf_as_w8a16``: Q5_0, Q8_0, Q6_K; the other
    types, and all under int8 activations, stay blocks for ``ops.linear_gguf``). A tied
    lm_head (the ``embed`` tensor itself) becomes the only copy of the embedding: C++ reads its
    rows out of the panels. The small tensors left (norms, biases) get memory of their own, so
    that none keeps a memory-mapped checkpoint resident once its weights are packed."""
    tied = 'lm_head' in tensors and tensors['lm_head'] is tensors.get('embed')
    if tied:
        del tensors['embed']
    w4a16 = [n[:-len('.mins')] for n in tensors if n.endswith('.mins') and tensors[n].dim() == 2]
    for base in w4a16:
        q, s, m = (tensors[f'{base}.{f}'] for f in ('qweight', 'scales', 'mins'))
        s, m = _narrowed(s), _narrowed(m)
        if s.dtype != m.dtype:
            s, m = s.float(), m.float()
        tensors[f'{base}.qweight'], tensors[f'{base}.scales'], tensors[f'{base}.mins'] = pack_w4a16_panels(q, s, m)
    for base in [n[:-len('.gguf_types')] for n in tensors if n.endswith('.gguf_types')] if w8a16_panels else []:
        types = tensors[f'{base}.gguf_types']
        widened = gguf_as_w8a16([(tensors[f'{base}.gguf.{i}'], types[i:i + 1]) for i in range(len(types))])
        if widened is not None:
            for i in range(len(types)):
                del tensors[f'{base}.gguf.{i}']
            del tensors[f'{base}.gguf_types']
            tensors[f'{base}.qweight'], tensors[f'{base}.scales'] = widened
    w8a16 = [n[:-len('.scales')] for n in tensors if n.endswith('.scales') and tensors[n].dim() == 2
             and f"{n[:-len('.scales')]}.mins" not in tensors and (w8a16_panels or n == 'lm_head.scales')]
    for base in w8a16:
        tensors[f'{base}.qweight'], tensors[f'{base}.scales'] = pack_w8a16_panels(tensors[f'{base}.qweight'],
                                                                                  tensors[f'{base}.scales'])
    for name in list(tensors):
        w = tensors[name]
        if name.startswith('layers.') and name.endswith(EXPERT_STACKS):  # [E, N, K] -> [E, P, K, 16]
            packed = torch.empty(w.shape[0], (w.shape[1] + 15) // 16, w.shape[2], 16, dtype=w.dtype)
            for expert, panels in zip(w, packed):
                ops.pack_linear(to_dlpack(expert), to_dlpack(panels))
            tensors[name] = packed
        elif name == 'lm_head' or (name.startswith('layers.') and name.endswith(_MATMUL_SUFFIXES)):
            packed = torch.empty((w.shape[0] + 15) // 16, w.shape[1], 16, dtype=w.dtype)
            ops.pack_linear(to_dlpack(w), to_dlpack(packed))
            tensors[name] = packed
        elif w.dim() < 3 and w.numel() * w.element_size() < SMALL_TENSOR_BYTES:
            tensors[name] = w.clone()
    return tensors


def _moe_config(config: ModelConfig) -> dict:
    """``LlamaModel``'s config of the experts (turbomind/csrc/models/moe.h): Qwen rounds the routing
    weights to the model dtype, Mixtral and DeepSeek-V2 keep them in float32 (as transformers does)."""
    moe = config.moe
    return dict(num_experts=moe.num_experts, top_k=moe.top_k, intermediate_size=moe.intermediate_size,
                norm_topk_prob=moe.norm_topk_prob, round_weights=config.family not in ('mixtral', 'deepseek_v2'),
                shared_intermediate_size=moe.shared_intermediate_size, sparse_layers=list(moe.sparse_layers),
                topk_softmax=moe.topk_method == 'topk_softmax', swiglu_limit=moe.swiglu_limit or 0.0,
                swiglu_alpha=moe.swiglu_alpha, routed_scaling_factor=moe.routed_scaling_factor,
                num_groups=moe.num_groups, topk_groups=moe.topk_groups, shared_gated=moe.shared_gate)


class TurbomindModel:
    """A Llama-family model in C++; ``forward`` runs one step given per-row cache addressing."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 num_blocks: int, block_size: int, quantized: dict[str, tuple] | None = None,
                 quant_policy: int = 0, int8_activations: bool = False, session_len: int | None = None):
        """HF-named ``weights`` (and ``quantized`` ones, see ``fuse_weights``), fused here.
        ``quant_policy``: 0 keeps the KV cache in ``dtype``; 8 / 4 quantizes it to int8 / int4
        per token and head (asymmetric, a float32 scale and zero each). ``int8_activations``:
        the W4A16 and W8A16 matmuls quantize x to int8 per 32 k (``TurbomindEngineConfig``), but a
        W8A16 lm_head, which keeps float x (``pack_matmuls``).
        ``session_len``: the longest sequence served (LongRoPE picks its factors by it; default:
        the model's context)."""
        if dtype not in DTYPE_NAMES:
            raise ValueError(f'dtype {dtype} is not supported; use float32, bfloat16 or float16')
        self._build(config, fuse_weights(config, weights, dtype, quantized), dtype, num_blocks, block_size,
                    quant_policy, int8_activations, session_len)

    @classmethod
    def from_fused(cls, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                   num_blocks: int, block_size: int, quant_policy: int = 0,
                   int8_activations: bool = False, session_len: int | None = None) -> 'TurbomindModel':
        """From tensors ``fuse_weights`` made (e.g. read back from a converted directory)."""
        if dtype not in DTYPE_NAMES:
            raise ValueError(f'dtype {dtype} is not supported; use float32, bfloat16 or float16')
        self = cls.__new__(cls)
        self._build(config, dict(tensors), dtype, num_blocks, block_size, quant_policy, int8_activations,
                    session_len)
        return self

    def _build(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
               num_blocks: int, block_size: int, quant_policy: int = 0, int8_activations: bool = False,
               session_len: int | None = None) -> None:
        if session_len is not None:
            tensors['cos_sin'] = build_cos_sin_cache(config, dtype, 'cpu', session_len)
        self.config = config
        self.dtype = dtype
        self.block_size = block_size
        self.quant_policy = quant_policy
        self.tensors = pack_matmuls(tensors, w8a16_panels=not int8_activations)  # kept: C++ reads their memory
        self.linear_formats = linear_formats(config, self.tensors)
        cfg = dict(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_layers=config.num_layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps,
                   qk_norm=config.qk_norm, qk_norm_all_heads=config.qk_norm_all_heads, pre_norms=config.pre_norms,
                   int8_activations=int8_activations,
                   use_rope=[config.uses_rope(n) for n in range(config.num_layers)],
                   windows=list(config.layer_windows), attn_scale=config.attention_scale,
                   attn_softcap=config.attn_softcap, logit_softcap=config.logit_softcap,
                   embed_scale=0.0 if config.embed_scale == 1.0 else config.embed_scale,
                   gelu=config.mlp_activation == 'gelu_tanh', local_rope=list(config.local_rope_layers))
        if config.moe is not None:
            cfg['moe'] = _moe_config(config)
        if config.mla is not None:  # DeepSeek-V2's latent attention (turbomind/csrc/models/mla.h)
            mla = config.mla
            cfg['mla'] = dict(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                              qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
                              v_head_dim=mla.v_head_dim)
        self.int8_activations = int8_activations
        self._cpp_config = cfg
        self.cpp = self._new_cpp(num_blocks)

    def _new_cpp(self, num_blocks: int):
        handles = {k: ops.HostTensor(to_dlpack(v)) for k, v in self.tensors.items()}
        return _turbomind.LlamaModel(self._cpp_config, handles, DTYPE_NAMES[self.dtype], num_blocks, self.block_size,
                                     self.quant_policy)

    def with_own_cache(self, num_blocks: int) -> 'TurbomindModel':
        """These weights (shared, not copied) over a KV cache of ``num_blocks`` blocks of its own: its
        ``forward`` may run on another thread beside this model's (the C++ scratch buffers are per
        thread) and never touches this model's cache (``TurbomindEngine.get_logits``)."""
        twin = copy.copy(self)
        twin.cpp = self._new_cpp(num_blocks)
        twin.cpp.share_adapters(self.cpp)  # and the LoRA adapters, as they are loaded and unloaded
        return twin

    def set_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (``lmd.lora.load_lora_adapter``) in slot ``slot``: its A and B in the model
        dtype, copied into C++ memory of the adapter's own (so this object keeps no tensors for it; a
        step in flight keeps the weights it reads alive itself). ValueError when it does not fit."""
        if len(adapter.layers) != self.config.num_layers:
            raise ValueError(f'adapter {adapter.name!r} has {len(adapter.layers)} layers; the model has '
                             f'{self.config.num_layers}')
        layers = [{name: (to_dlpack(w.a.to(self.dtype).contiguous()), to_dlpack(w.b.to(self.dtype).contiguous()))
                   for name, w in layer.items()} for layer in adapter.layers]
        try:
            self.cpp.set_adapter(slot, layers)
        except ValueError as e:
            raise ValueError(f'adapter {adapter.name!r} does not fit the model: {e}') from None

    def clear_adapter(self, slot: int) -> None:
        """Empty slot ``slot``: rows naming it run the base model; its weights go once no step reads them."""
        self.cpp.clear_adapter(slot)

    @property
    def num_w4a16(self) -> int:
        """Matmuls of the layers that run in W4A16."""
        return sum(f == 'w4a16' for n, f in self.linear_formats.items() if n != 'lm_head')

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                row_tables: torch.Tensor, row_lens: torch.Tensor, logit_rows: torch.Tensor,
                row_adapters: torch.Tensor | None = None) -> torch.Tensor:
        """All int tensors contiguous (int64, except row_tables/row_lens int32); float32 logits [R, V].
        ``row_adapters``: None, or int32 [T], each row's LoRA adapter slot (``set_adapter``; -1: none)."""
        return self._step(self.cpp.forward, self.config.vocab_size, row_adapters, token_ids, positions, slots,
                          row_tables, row_lens, logit_rows)

    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      row_tables: torch.Tensor, row_lens: torch.Tensor, logit_rows: torch.Tensor,
                      row_adapters: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` without the head: float32 [R, hidden_size], the final norm's output of logit_rows."""
        return self._step(self.cpp.hidden_states, self.config.hidden_size, row_adapters, token_ids, positions, slots,
                          row_tables, row_lens, logit_rows)

    @staticmethod
    def _step(run, width: int, row_adapters: torch.Tensor | None, *tensors: torch.Tensor) -> torch.Tensor:
        """``run`` (a step of the C++ model) on the tensors' DLPack views, into float32 [rows of the last, width]."""
        out = torch.empty((tensors[-1].numel(), width), dtype=torch.float32)
        run(*(to_dlpack(t) for t in tensors), to_dlpack(out),
            row_adapters=None if row_adapters is None else to_dlpack(row_adapters))
        return out
