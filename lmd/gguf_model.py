"""Read a GGUF file into HF form: config dict, float32 state dict (HF names), tokenizer.

GGUF (llama.cpp's format) keeps the architecture facts as ``{arch}.*`` metadata,
the tokenizer as ``tokenizer.ggml.*`` arrays (read by ``gguf_tokenizer.py``), and tensors
under llama.cpp names, often block-quantized. Everything here is dequantized to float32 with
``gguf.quants.dequantize`` (exact for Q4_0/Q4_1/Q8_0/F16/BF16: the float value of
each quantized code is what llama.cpp itself computes).

Layouts:
- GGUF tensor shapes are listed fastest-dim first (``ne0, ne1``); the numpy view
  is ``[ne1, ne0]`` = ``[out_features, in_features]``, the same as an HF Linear.
- llama.cpp's converter for the ``llama`` arch permutes the rows of ``attn_q`` and
  ``attn_k`` of each head from HF's half-split rope layout (pairs ``i, i+d/2``) to
  GPT-J's interleaved one (pairs ``2i, 2i+1``); ``unpermute_rope`` inverts it.
  Qwen2/Qwen3 GGUFs use NeoX rope in llama.cpp and are stored unpermuted.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from .errors import ModelFormatError
from .gguf_tokenizer import build_tokenizer

# GGUF general.architecture -> (HF architecture, HF model_type, rows of q/k permuted by llama.cpp).
# A 'llama' file with experts (``llama.expert_count``) is a Mixtral (``MIXTRAL``).
GGUF_ARCHITECTURES = {
    'llama': ('LlamaForCausalLM', 'llama', True),
    'mistral': ('MistralForCausalLM', 'mistral', True),
    'qwen2': ('Qwen2ForCausalLM', 'qwen2', False),
    'qwen3': ('Qwen3ForCausalLM', 'qwen3', False),
    'phi3': ('Phi3ForCausalLM', 'phi3', False),
    'smollm3': ('SmolLM3ForCausalLM', 'smollm3', True),
    'gemma2': ('Gemma2ForCausalLM', 'gemma2', False),
    'gemma3': ('Gemma3ForCausalLM', 'gemma3_text', False),
    'qwen2moe': ('Qwen2MoeForCausalLM', 'qwen2_moe', False),
    'qwen3moe': ('Qwen3MoeForCausalLM', 'qwen3_moe', False),
    'olmo2': ('Olmo2ForCausalLM', 'olmo2', False),
    'glm4': ('Glm4ForCausalLM', 'glm4', False),  # interleaved RoPE in HF and llama.cpp alike: rows as HF's
    'gpt-oss': ('GptOssForCausalLM', 'gpt_oss', False),
    'deepseek2': ('DeepseekV2ForCausalLM', 'deepseek_v2', False),
}
MIXTRAL = ('MixtralForCausalLM', 'mixtral', True)
_GEMMA_ARCHS = ('gemma2', 'gemma3')
_MOE_ARCHS = ('qwen2moe', 'qwen3moe')

_TOP_LEVEL_NAMES = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}

# blk.N.<gguf> -> model.layers.N.<hf>
_BLOCK_NAMES = {
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'attn_q_norm': 'self_attn.q_norm',
    'attn_k_norm': 'self_attn.k_norm',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
    'attn_norm': 'input_layernorm',
    'ffn_norm': 'post_attention_layernorm',
}
# where an architecture names a block tensor otherwise: Phi-3 keeps q/k/v and gate/up fused (its
# ffn_up is HF's gate_up_proj, gate rows first); OLMo 2 and GLM-4 below; Gemma norms the attention's output
# (post_attention_norm), before the MLP (ffn_norm) and the MLP's output (post_ffw_norm); a MoE
# layer's router (ffn_gate_inp) and experts stacked into one tensor per matmul (``*_exps``
# [E, N, K]: ``STACKED_EXPERTS`` names, one HF tensor per expert), Qwen2-MoE's shared expert and its gate
_GEMMA_NAMES = {'post_attention_norm': 'post_attention_layernorm', 'ffn_norm': 'pre_feedforward_layernorm',
                'post_ffw_norm': 'post_feedforward_layernorm'}
_QWEN_MOE_NAMES = {'ffn_gate_inp': 'mlp.gate', 'ffn_gate_exps': 'mlp.experts.gate_proj',
                   'ffn_up_exps': 'mlp.experts.up_proj', 'ffn_down_exps': 'mlp.experts.down_proj',
                   'ffn_gate_shexp': 'mlp.shared_expert.gate_proj', 'ffn_up_shexp': 'mlp.shared_expert.up_proj',
                   'ffn_down_shexp': 'mlp.shared_expert.down_proj', 'ffn_gate_inp_shexp': 'mlp.shared_expert_gate'}
_ARCH_BLOCK_NAMES = {
    'phi3': {'attn_qkv': 'self_attn.qkv_proj', 'ffn_up': 'mlp.gate_up_proj'},
    # OLMo 2 norms only the attention's and the MLP's outputs; GLM-4 norms before and after both,
    # its ffn_up HF's fused gate_up_proj
    'olmo2': {'post_attention_norm': 'post_attention_layernorm', 'post_ffw_norm': 'post_feedforward_layernorm'},
    'glm4': {'post_attention_norm': 'post_self_attn_layernorm', 'ffn_norm': 'post_attention_layernorm',
             'post_ffw_norm': 'post_mlp_layernorm', 'ffn_up': 'mlp.gate_up_proj'},
    'gemma2': _GEMMA_NAMES,
    'gemma3': _GEMMA_NAMES,
    'qwen2moe': _QWEN_MOE_NAMES,
    'qwen3moe': _QWEN_MOE_NAMES,
    'mixtral': {'ffn_gate_inp': 'block_sparse_moe.gate', 'ffn_gate_exps': 'block_sparse_moe.experts.w1',
                'ffn_up_exps': 'block_sparse_moe.experts.w3', 'ffn_down_exps': 'block_sparse_moe.experts.w2'},
    # DeepSeek-V2: latent attention (kv_b_proj split per head into k_b, transposed, and v_b: ``_deepseek_kv_b``
    # joins them again), dense first layers, routed experts beside fused shared ones
    'deepseek2': {**_QWEN_MOE_NAMES, 'ffn_gate_shexp': 'mlp.shared_experts.gate_proj',
                  'ffn_up_shexp': 'mlp.shared_experts.up_proj', 'ffn_down_shexp': 'mlp.shared_experts.down_proj',
                  'attn_q_a': 'self_attn.q_a_proj', 'attn_q_a_norm': 'self_attn.q_a_layernorm',
                  'attn_q_b': 'self_attn.q_b_proj', 'attn_kv_a_mqa': 'self_attn.kv_a_proj_with_mqa',
                  'attn_kv_a_norm': 'self_attn.kv_a_layernorm', 'attn_kv_b': 'self_attn.kv_b_proj',
                  'attn_k_b': 'self_attn.k_b_proj', 'attn_v_b': 'self_attn.v_b_proj'},
    # gpt-oss: a biased router, biased experts (their gate and up split apart: ``_gpt_oss_experts`` interleaves
    # them again into HF's stacked tensors), the attention sinks, one norm before the MLP
    'gpt-oss': {'ffn_gate_inp': 'mlp.router', 'ffn_gate_exps': 'mlp.experts.gate_proj',
                'ffn_up_exps': 'mlp.experts.up_proj', 'ffn_down_exps': 'mlp.experts.down_proj',
                'attn_sinks': 'self_attn.sinks', 'post_attention_norm': 'post_attention_layernorm'},
}
# HF's name of a stacked expert tensor (as hf_tensor_name gives it) -> (prefix, matmul): expert e's
# own tensor is f'{prefix}{e}.{matmul}.weight'
STACKED_EXPERTS = re.compile(r'^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.)([a-z0-9_]+)\.weight$')
_BLOCK_RE = re.compile(r'^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$')
# tensors that are config, not weights: a LongRoPE model's factors (Phi-3), read into rope_scaling
ROPE_FACTOR_TENSORS = {'rope_factors_long.weight': 'long_factor', 'rope_factors_short.weight': 'short_factor'}


@dataclass
class GGUFModel:
    """What a GGUF holds, in HF form. Unpacks as ``config, state_dict, tokenizer, tokenizer_config``."""
    config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer: 'tokenizers.Tokenizer'  # noqa: F821
    tokenizer_config: dict
    generation_config: dict

    def __iter__(self):
        return iter((self.config, self.state_dict, self.tokenizer, self.tokenizer_config))


# --------------------------------------------------------------------------- reading

def open_gguf(path: str):
    """A ``gguf.GGUFReader`` over ``path``, every tensor checked to lie inside the file; a missing,
    foreign, damaged or truncated file is a ModelFormatError."""
    import gguf
    if not os.path.isfile(path):
        raise ModelFormatError(f'{path}: no such GGUF file')
    with open(path, 'rb') as f:
        magic = f.read(4)
    if magic != b'GGUF':
        raise ModelFormatError(f'{path}: not a GGUF file (starts with {magic!r}, expected b"GGUF")')
    try:
        reader = gguf.GGUFReader(path, 'r')
    except Exception as e:  # the reader raises ValueError/IndexError/... on a damaged header
        raise ModelFormatError(f'{path}: damaged or truncated GGUF file ({type(e).__name__}: {e})') from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.size * t.data.itemsize != t.n_bytes:
            raise ModelFormatError(
                f'{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to '
                f'{t.data_offset + t.n_bytes}, the file has {size}')
    return reader


def gguf_metadata(reader, path: str) -> dict:
    """Every metadata field of ``open_gguf``'s reader as a Python value, by key."""
    meta = {}
    for name, field in reader.fields.items():
        try:
            meta[name] = field.contents()
        except Exception as e:
            raise ModelFormatError(f'{path}: cannot read metadata {name!r} ({e})') from None
    return meta


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows per head go interleaved -> half-split.

    llama.cpp: ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2).reshape(w.shape)``.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_arch(meta: dict) -> str:
    """The architecture of a GGUF as lmd reads it: ``general.architecture``, except a 'llama' file with
    experts, which is a 'mixtral'."""
    arch = meta.get('general.architecture')
    return 'mixtral' if arch == 'llama' and meta.get('llama.expert_count') else arch


def _hf_names(arch: str) -> tuple[str, str, bool] | None:
    return MIXTRAL if arch == 'mixtral' else GGUF_ARCHITECTURES.get(arch)


def rope_permuted_heads(meta: dict) -> tuple[int, int] | None:
    """(q heads, kv heads) when llama.cpp permuted the rows of q and k (``unpermute_rope`` undoes
    it), else None; ``meta`` is ``gguf_metadata``'s."""
    arch = meta.get('general.architecture')
    if arch not in GGUF_ARCHITECTURES or not GGUF_ARCHITECTURES[arch][2]:
        return None
    n_head = int(meta.get(f'{arch}.attention.head_count', 0))
    n_kv = meta.get(f'{arch}.attention.head_count_kv', n_head)
    return n_head, int(n_kv[0] if isinstance(n_kv, list) else n_kv)


def hf_tensor_name(name: str, path: str, arch: str = 'llama') -> str | None:
    """The HF name of llama.cpp tensor ``name`` of a GGUF of ``arch`` (``gguf_arch``; a stacked expert
    tensor's name is one of ``STACKED_EXPERTS``); None for a tensor that is config
    (``ROPE_FACTOR_TENSORS``); ModelFormatError for one lmd cannot place."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    if name in ROPE_FACTOR_TENSORS:
        return None
    m = _BLOCK_RE.match(name)
    block_names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    if m and m.group(2) in block_names:
        return f'model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}'
    if name == 'rope_freqs.weight':
        raise ModelFormatError(
            f'{path}: has rope_freqs (Llama-3.1-style rope scaling factors); lmd cannot convert '
            'that GGUF yet, use the original HF checkpoint')
    raise ModelFormatError(f'{path}: unexpected tensor {name!r} for this architecture')


def _state_dict(reader, path: str, permute_heads: tuple[int, int] | None, arch: str) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize
    out = {}
    for t in reader.tensors:
        hf = hf_tensor_name(t.name, path, arch)
        if hf is None:
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelFormatError(
                f'{path}: tensor {t.name!r} uses GGUF type {t.tensor_type.name}, '
                'which gguf cannot dequantize') from None
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if permute_heads is not None and hf.endswith(('q_proj.weight', 'q_proj.bias')):
            w = unpermute_rope(w, permute_heads[0])
        elif permute_heads is not None and hf.endswith(('k_proj.weight', 'k_proj.bias')):
            w = unpermute_rope(w, permute_heads[1])
        if not (w.flags.writeable and w.flags.c_contiguous):  # F32/F16 tensors are views of the file map
            w = np.array(w, order='C')
        if arch in _GEMMA_ARCHS and hf.endswith('norm.weight'):
            w -= 1.0  # llama.cpp stores Gemma's RMSNorm scale (1 + w); HF keeps w
        if hf.endswith('shared_expert_gate.weight'):
            w = w.reshape(1, -1)  # HF's [1, H]
        if hf.endswith('self_attn.sinks.weight'):
            hf = hf.removesuffix('.weight')  # HF's sinks [Hq] are a parameter of their own
        stacked = STACKED_EXPERTS.match(hf)
        if stacked and arch != 'gpt-oss':  # [E, N, K] -> one [N, K] tensor per expert
            prefix, matmul = stacked.groups()
            out.update({f'{prefix}{e}.{matmul}.weight': torch.from_numpy(np.array(w[e])) for e in range(len(w))})
        else:
            out[hf] = torch.from_numpy(w)
    if arch == 'deepseek2':
        return _deepseek_kv_b(out)
    return _gpt_oss_experts(out) if arch == 'gpt-oss' else out


def _deepseek_kv_b(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DeepSeek-V2 GGUF's ``attn_k_b`` [Hq, L, nope] and ``attn_v_b`` [Hq, v, L] (llama.cpp splits
    ``kv_b_proj`` for its absorbed attention) joined again into HF's ``kv_b_proj`` [Hq (nope + v), L], each
    head's key rows then its value rows. Older files keep ``attn_kv_b`` whole."""
    for k_name in [n for n in state if n.endswith('self_attn.k_b_proj.weight')]:
        k_b = state.pop(k_name)
        v_b = state.pop(k_name.replace('k_b_proj', 'v_b_proj'))
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [Hq, nope + v, L]
        state[k_name.replace('k_b_proj', 'kv_b_proj')] = kv_b.reshape(-1, kv_b.shape[-1]).contiguous()
    return state


def _gpt_oss_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gpt-oss GGUF's experts as HF stores them: llama.cpp's ``ffn_{gate,up}_exps`` [E, I, H] (and their
    biases [E, I]) interleaved again into ``gate_up_proj`` [E, H, 2 I] (``gate_up_proj_bias`` [E, 2 I]),
    ``ffn_down_exps`` [E, H, I] transposed back into ``down_proj`` [E, I, H]."""
    pattern = re.compile(r'^(model\.layers\.\d+\.mlp\.experts\.)gate_proj\.weight$')
    for prefix in [m.group(1) for m in map(pattern.match, list(state)) if m]:
        gate, up, down = (state.pop(f'{prefix}{n}_proj.weight') for n in ('gate', 'up', 'down'))
        gate_up = torch.stack([gate, up], dim=2).flatten(1, 2)  # [E, 2 I, H]: rows gate0, up0, gate1 ...
        state[prefix + 'gate_up_proj'] = gate_up.transpose(1, 2).contiguous()
        state[prefix + 'down_proj'] = down.transpose(1, 2).contiguous()
        gate_b, up_b = (state.pop(f'{prefix}{n}_proj.bias') for n in ('gate', 'up'))
        state[prefix + 'gate_up_proj_bias'] = torch.stack([gate_b, up_b], dim=2).flatten(1, 2).contiguous()
        state[prefix + 'down_proj_bias'] = state.pop(prefix + 'down_proj.bias')
    return state


def _config(meta: dict, state_dict: dict, path: str, factors: dict | None = None) -> dict:
    """The HF config.json of the GGUF; ``factors``: its LongRoPE factor lists by rope_scaling key."""
    arch = gguf_arch(meta)
    if _hf_names(arch) is None:
        raise ModelFormatError(
            f'{path}: GGUF architecture {arch!r} is not supported; lmd reads {", ".join(GGUF_ARCHITECTURES)}')
    hf_arch, model_type, _ = _hf_names(arch)
    key_arch = meta.get('general.architecture')  # a Mixtral's keys are llama.*

    def get(key, default=None, required=False):
        full = f'{key_arch}.{key}'
        if full not in meta:
            if required:
                raise ModelFormatError(f'{path}: GGUF metadata {full!r} is missing')
            return default
        return meta[full]

    hidden = int(get('embedding_length', required=True))
    num_heads = int(get('attention.head_count', required=True))
    num_kv_heads = get('attention.head_count_kv', num_heads)
    if isinstance(num_kv_heads, list):  # per-layer head counts: all layers equal in these archs
        num_kv_heads = num_kv_heads[0]
    head_dim = int(get('attention.key_length') or hidden // num_heads)
    tokens = meta.get('tokenizer.ggml.tokens')
    vocab_size = len(tokens) if tokens else int(state_dict['model.embed_tokens.weight'].shape[0])
    eos = meta.get('tokenizer.ggml.eos_token_id')
    cfg = {
        'architectures': [hf_arch],
        'model_type': model_type,
        'vocab_size': vocab_size,
        'hidden_size': hidden,
        'intermediate_size': int(get('feed_forward_length') or get('expert_feed_forward_length', required=True)),
        'num_hidden_layers': int(get('block_count', required=True)),
        'num_attention_heads': num_heads,
        'num_key_value_heads': int(num_kv_heads),
        'head_dim': head_dim,
        'hidden_act': 'silu',
        'rms_norm_eps': float(get('attention.layer_norm_rms_epsilon', 1e-6)),
        'rope_theta': float(get('rope.freq_base', 10000.0)),
        'max_position_embeddings': int(get('context_length', 4096)),
        'tie_word_embeddings': 'lm_head.weight' not in state_dict,
        'attention_bias': 'model.layers.0.self_attn.q_proj.bias' in state_dict,
        'bos_token_id': meta.get('tokenizer.ggml.bos_token_id'),
        'eos_token_id': eos,
        'torch_dtype': 'float32',
        'use_cache': True,
    }
    if model_type in ('llama', 'mistral'):
        cfg['mlp_bias'] = False
    # said even when absent: a family's default (SmolLM3's 128004) may lie outside the file's vocabulary
    cfg['pad_token_id'] = meta.get('tokenizer.ggml.padding_token_id')
    scaling = get('rope.scaling.type')
    if scaling in ('linear', 'yarn'):
        rope_scaling = {'rope_type': scaling, 'factor': float(get('rope.scaling.factor', 1.0))}
        if scaling == 'yarn':
            rope_scaling['original_max_position_embeddings'] = int(
                get('rope.scaling.original_context_length', cfg['max_position_embeddings']))
        cfg['rope_scaling'] = rope_scaling
    elif scaling not in (None, 'none'):
        raise ModelFormatError(f'{path}: rope scaling {scaling!r} is not supported')
    window = get('attention.sliding_window')
    if window and model_type in ('mistral', 'qwen2', 'qwen3', 'phi3', 'gemma2', 'gemma3_text'):
        cfg['sliding_window'] = int(window)
    if arch in _GEMMA_ARCHS:
        cfg.update(_gemma_config(arch, cfg, get))
    if arch in _MOE_ARCHS or arch == 'mixtral':
        cfg.update(_moe_config(arch, get))
    if arch == 'gpt-oss':
        cfg.update(_gpt_oss_config(cfg, get))
    if arch == 'deepseek2':
        cfg.update(_deepseek_config(cfg, get))
    if arch == 'smollm3':  # llama.cpp leaves RoPE out of every 4th layer, as SmolLM3's config does by default
        cfg['no_rope_layer_interval'] = 4
    rope_dims = get('rope.dimension_count')
    if rope_dims and int(rope_dims) < cfg['head_dim']:  # (DeepSeek-V2's head_dim is its rope dims)
        cfg['partial_rotary_factor'] = int(rope_dims) / cfg['head_dim']
    if factors:  # LongRoPE (Phi-3): llama.cpp keeps the factors as tensors, the original context as metadata
        original = int(get('rope.scaling.original_context_length', required=True))
        cfg['rope_scaling'] = {'rope_type': 'longrope', 'original_max_position_embeddings': original, **factors}
        cfg['original_max_position_embeddings'] = original
    return cfg


def _gemma_config(arch: str, cfg: dict, get) -> dict:
    """Gemma's config.json fields from a GGUF, with the values llama.cpp assumes where the file says
    nothing: scores scaled by head_dim ** -0.5 (hidden / heads for the 27B models, which llama.cpp knows
    by their layer count), Gemma 3's sliding layers 5 in 6 with their own RoPE base 10000."""
    heads, layers = cfg['num_attention_heads'], cfg['num_hidden_layers']
    big = (arch, layers) in (('gemma2', 46), ('gemma3', 62))
    out = {'hidden_activation': 'gelu_pytorch_tanh', 'hidden_act': 'gelu_pytorch_tanh',
           'query_pre_attn_scalar': cfg['hidden_size'] // heads if big else cfg['head_dim'],
           'final_logit_softcapping': get('final_logit_softcapping')}
    if arch == 'gemma2':
        out['attn_logit_softcapping'] = get('attn_logit_softcapping')
    else:
        out['rope_local_base_freq'] = float(get('rope.freq_base_swa', 10000.0))
        pattern = get('attention.sliding_window_pattern')
        if isinstance(pattern, list):  # per layer: whether it slides
            out['layer_types'] = ['sliding_attention' if p else 'full_attention' for p in pattern]
        else:
            out['sliding_window_pattern'] = int(pattern or 6)
    return out


def _deepseek_config(cfg: dict, get) -> dict:
    """DeepSeek-V2's config.json fields from a GGUF. llama.cpp writes its latent attention as MQA (one KV
    head of ``key_length`` = L + rope), the per-head sizes in ``key_length_mla`` / ``value_length_mla``, and
    YaRN's mscale_all_dim as ``yarn_log_multiplier`` / 0.1 (mscale taken equal, as in DeepSeek-V2's
    checkpoints); it keeps no expert groups for V2, so routing is greedy, as llama.cpp runs it."""
    heads, rope = cfg['num_attention_heads'], int(get('rope.dimension_count', required=True))
    kv_lora = int(get('attention.kv_lora_rank', required=True))
    key_mla = get('attention.key_length_mla')
    if key_mla is None:  # an older file (kv_b_proj whole): key_length / value_length are the per-head sizes
        v_dim = int(get('attention.value_length', required=True))
        key_mla = int(get('attention.key_length', required=True))
    else:
        key_mla, v_dim = int(key_mla), int(get('attention.value_length_mla', required=True))
    q_lora = get('attention.q_lora_rank')
    experts = get('expert_count')
    out = {'num_key_value_heads': heads, 'head_dim': rope, 'kv_lora_rank': kv_lora, 'q_lora_rank': q_lora and int(q_lora),
           'qk_rope_head_dim': rope, 'qk_nope_head_dim': key_mla - rope, 'v_head_dim': v_dim,
           'attention_bias': False, 'first_k_dense_replace': int(get('leading_dense_block_count', 0))}
    if experts:
        group = get('expert_group_count')
        out.update(n_routed_experts=int(experts), num_experts_per_tok=int(get('expert_used_count', required=True)),
                   moe_intermediate_size=int(get('expert_feed_forward_length', required=True)),
                   n_shared_experts=int(get('expert_shared_count', 0)),
                   routed_scaling_factor=float(get('expert_weights_scale', 1.0)),
                   norm_topk_prob=bool(get('expert_weights_norm', False)),
                   topk_method='group_limited_greedy' if group else 'greedy', n_group=int(group or 1),
                   topk_group=int(get('expert_group_used_count', 1)))
    mscale = float(get('rope.scaling.yarn_log_multiplier', 0.0)) / 0.1
    out['rope_parameters'] = _rope_parameters(cfg, get, mscale=mscale, mscale_all_dim=mscale)
    return out


def _gpt_oss_config(cfg: dict, get) -> dict:
    """gpt-oss's config.json fields from a GGUF, with what llama.cpp assumes where the file says nothing:
    sliding layers first, then full ones, alternating; its SwiGLU clamped at 7 with alpha 1.702; YaRN's
    beta_fast 32 and beta_slow 1 unless the file says (it holds the factor and original context)."""
    window = int(get('attention.sliding_window', 128))
    out = {'num_local_experts': int(get('expert_count', required=True)),
           'num_experts_per_tok': int(get('expert_used_count', required=True)),
           'intermediate_size': int(get('expert_feed_forward_length', cfg['intermediate_size'])),
           'sliding_window': window, 'attention_bias': True, 'swiglu_limit': 7.0, 'swiglu_alpha': 1.702,
           'layer_types': ['sliding_attention' if i % 2 == 0 else 'full_attention'
                           for i in range(cfg['num_hidden_layers'])]}
    out['rope_parameters'] = _rope_parameters(cfg, get, truncate=False)
    return out


def _rope_parameters(cfg: dict, get, **yarn) -> dict:
    """``cfg``'s RoPE said in full as transformers' ``rope_parameters`` (its ``rope_scaling`` taken out):
    for gpt-oss and DeepSeek-V2, whose transformers defaults are YaRN, a file without scaling says
    'default'. YaRN gets beta_fast / beta_slow (llama.cpp's 32 and 1 unless the file says) and ``yarn``."""
    scaling = cfg.pop('rope_scaling', None) or {'rope_type': 'default'}
    if scaling['rope_type'] == 'yarn':
        scaling.update(beta_fast=float(get('rope.scaling.yarn_beta_fast', 32.0)),
                       beta_slow=float(get('rope.scaling.yarn_beta_slow', 1.0)), **yarn)
    return {**scaling, 'rope_theta': cfg['rope_theta']}


def _moe_config(arch: str, get) -> dict:
    """The experts' config.json fields from a GGUF's ``expert_*`` keys (every layer sparse, as llama.cpp
    runs them); top-k weights renormalised as llama.cpp does unless the file says
    (``expert_weights_norm``): Mixtral and Qwen3-MoE yes, Qwen2-MoE no."""
    experts, used = int(get('expert_count', required=True)), int(get('expert_used_count', required=True))
    if arch == 'mixtral':
        return {'num_local_experts': experts, 'num_experts_per_tok': used}
    out = {'num_experts': experts, 'num_experts_per_tok': used,
           'moe_intermediate_size': int(get('expert_feed_forward_length', required=True)),
           'norm_topk_prob': bool(get('expert_weights_norm', arch == 'qwen3moe')),
           'decoder_sparse_step': 1, 'mlp_only_layers': []}
    if arch == 'qwen2moe':
        out['shared_expert_intermediate_size'] = int(get('expert_shared_feed_forward_length', 0))
    return out


# --------------------------------------------------------------------------- public

def _rope_factors(reader) -> dict[str, list[float]]:
    """A LongRoPE GGUF's factor tensors as rope_scaling's ``long_factor`` / ``short_factor`` lists."""
    return {ROPE_FACTOR_TENSORS[t.name]: [float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1)]
            for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS}


def read_gguf(path: str) -> GGUFModel:
    """Dequantize and rename a GGUF's tensors and rebuild its config and tokenizer."""
    path = os.path.abspath(os.path.expanduser(path))
    reader = open_gguf(path)
    meta = gguf_metadata(reader, path)
    arch = gguf_arch(meta)
    if _hf_names(arch) is None:
        raise ModelFormatError(
            f'{path}: GGUF architecture {arch!r} is not supported; lmd reads {", ".join(GGUF_ARCHITECTURES)}')
    state_dict = _state_dict(reader, path, rope_permuted_heads(meta), arch)
    if 'model.embed_tokens.weight' not in state_dict:
        raise ModelFormatError(f'{path}: GGUF has no token_embd.weight')
    config = _config(meta, state_dict, path, _rope_factors(reader))
    tokenizer, tok_cfg = build_tokenizer(meta, path)
    gen_cfg = {'bos_token_id': config['bos_token_id'], 'eos_token_id': config['eos_token_id']}
    if config['pad_token_id'] is not None:
        gen_cfg['pad_token_id'] = config['pad_token_id']
    return GGUFModel(config, state_dict, tokenizer, tok_cfg, gen_cfg)


def convert_gguf(path: str, out_dir: str) -> str:
    """Write ``path`` as an HF directory: model.safetensors (float32) + config/tokenizer files."""
    from safetensors.torch import save_file
    model = read_gguf(path)
    os.makedirs(out_dir, exist_ok=True)
    save_file(model.state_dict, os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
    model.tokenizer.save(os.path.join(out_dir, 'tokenizer.json'))
    for name, obj in (('config.json', model.config), ('tokenizer_config.json', model.tokenizer_config),
                      ('generation_config.json', model.generation_config)):
        with open(os.path.join(out_dir, name), 'w', encoding='utf-8') as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write('\n')
    return out_dir
