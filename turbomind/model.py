"""The C++ model (``_turbomind.LlamaModel``) built from HF-named weights.

Weights are fused as TurboMind's kernels want them (q/k/v into one ``qkv``, gate/up
into one ``gate_up``) and handed to C++ as DLPack views; this object keeps the torch
tensors alive for as long as the C++ model reads them. The KV cache lives in C++.
"""
from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from lmd.model_config import ModelConfig
from lmd.pytorch_backend.models.llama import check_weights
from lmd.pytorch_backend.models.rope import build_cos_sin_cache

from . import _turbomind

DTYPE_NAMES = {torch.float32: 'float32', torch.bfloat16: 'bfloat16', torch.float16: 'float16'}


W4A16_GROUP_SIZE = 32  # the group of GGUF Q4_0 / Q4_1, the one W4A16 source wired in so far
W8A16_GROUP_SIZE = 32  # the group of GGUF Q8_0


def fuse_weights(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 w4a16: dict[str, tuple] | None = None,
                 head_w8a16: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """HF names -> TurboMind's names (``embed``, ``norm``, ``lm_head``, ``layers.{i}.qkv`` ...).

    ``w4a16``: HF weight name -> (qweight, scales, mins) (``quant.read_gguf_w4a16``); a fused
    matmul whose parts are all there runs in W4A16 (``<name>.qweight`` ...), else in float.
    ``head_w8a16``: (qweight int8, scales) of the lm_head (``quant.gguf_head_w8a16_for``); the
    embedding lookup keeps the float rows.
    """
    check_weights(config, weights)
    w4a16 = w4a16 or {}

    def get(name: str) -> torch.Tensor | None:
        t = weights.get(name)
        return None if t is None else t.to(dtype).contiguous()

    def cat(names: list[str]) -> torch.Tensor | None:
        if names[0] not in weights:
            return None
        return torch.cat([weights[n].to(dtype) for n in names], dim=0).contiguous()

    def linear(name: str, parts: list[str]) -> None:
        if all(p in w4a16 for p in parts):
            for i, field in enumerate(('qweight', 'scales', 'mins')):
                out[f'{name}.{field}'] = torch.cat([w4a16[p][i] for p in parts], dim=0).contiguous()
        else:
            out[name] = cat(parts)

    out = {'embed': get('model.embed_tokens.weight'), 'norm': get('model.norm.weight'),
           'cos_sin': build_cos_sin_cache(config, dtype, 'cpu')}
    if head_w8a16 is not None:
        out['lm_head.qweight'], out['lm_head.scales'] = (t.contiguous() for t in head_w8a16)
    else:
        out['lm_head'] = out['embed'] if config.tie_word_embeddings else get('lm_head.weight')
    for n in range(config.num_layers):
        p, q = f'model.layers.{n}.', f'layers.{n}.'
        attn, mlp = p + 'self_attn.', p + 'mlp.'
        out[q + 'input_norm'] = get(p + 'input_layernorm.weight')
        linear(q + 'qkv', [attn + f'{x}_proj.weight' for x in 'qkv'])
        out[q + 'qkv_bias'] = cat([attn + f'{x}_proj.bias' for x in 'qkv'])
        out[q + 'q_norm'] = get(attn + 'q_norm.weight')
        out[q + 'k_norm'] = get(attn + 'k_norm.weight')
        linear(q + 'o', [attn + 'o_proj.weight'])
        out[q + 'o_bias'] = get(attn + 'o_proj.bias')
        out[q + 'post_norm'] = get(p + 'post_attention_layernorm.weight')
        linear(q + 'gate_up', [mlp + 'gate_proj.weight', mlp + 'up_proj.weight'])
        out[q + 'gate_up_bias'] = cat([mlp + 'gate_proj.bias', mlp + 'up_proj.bias'])
        linear(q + 'down', [mlp + 'down_proj.weight'])
        out[q + 'down_bias'] = get(mlp + 'down_proj.bias')
    quantized = {k.rsplit('.', 1)[0] for k in out if k.endswith('.qweight')}
    for name in quantized:  # the W4A16 kernel takes a float32 bias
        if out.get(name + '_bias') is not None:
            out[name + '_bias'] = out[name + '_bias'].float()
    return {k: v for k, v in out.items() if v is not None}


class TurbomindModel:
    """A Llama-family model in C++; ``forward`` runs one step given per-row cache addressing."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 num_blocks: int, block_size: int, w4a16: dict[str, tuple] | None = None,
                 head_w8a16: tuple[torch.Tensor, torch.Tensor] | None = None):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f'dtype {dtype} is not supported; use float32, bfloat16 or float16')
        self.config = config
        self.dtype = dtype
        self.block_size = block_size
        self.tensors = fuse_weights(config, weights, dtype, w4a16, head_w8a16)  # kept: C++ reads their memory
        self.num_w4a16 = sum(k.endswith('.qweight') and k != 'lm_head.qweight' for k in self.tensors)
        cfg = dict(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_layers=config.num_layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps,
                   qk_norm=config.qk_norm, w4a16_group_size=W4A16_GROUP_SIZE,
                   w8a16_group_size=W8A16_GROUP_SIZE)
        handles = {k: _turbomind.ops.HostTensor(to_dlpack(v)) for k, v in self.tensors.items()}
        self.cpp = _turbomind.LlamaModel(cfg, handles, DTYPE_NAMES[dtype], num_blocks, block_size)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                row_tables: torch.Tensor, row_lens: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """All int tensors contiguous (int64, except row_tables/row_lens int32); float32 logits [R, V]."""
        logits = torch.empty((logit_rows.numel(), self.config.vocab_size), dtype=torch.float32)
        self.cpp.forward(to_dlpack(token_ids), to_dlpack(positions), to_dlpack(slots), to_dlpack(row_tables),
                         to_dlpack(row_lens), to_dlpack(logit_rows), to_dlpack(logits))
        return logits
