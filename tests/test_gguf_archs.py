"""GGUF files of SmolLM3, Gemma 2 / 3, OLMo 2, GLM-4 and the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE,
gpt-oss, DeepSeek-V2), written as llama.cpp's converter writes them, read by both engines and compared with
HF float32 on the same weights (Phi-3's: tests/test_gguf_families.py). gpt-oss: gate and up split apart,
MXFP4 experts, sinks as ``attn_sinks.weight``; DeepSeek-V2: MQA-style lengths, ``kv_b_proj`` split per head
into ``attn_k_b`` (transposed) and ``attn_v_b``.

What the converter does that the reader undoes: q/k rows permuted to interleaved RoPE pairs (the
'llama' layout: SmolLM3, Mixtral); Gemma's RMSNorm weights stored as (1 + w); the experts of a layer
stacked into one tensor per matmul (``ffn_gate_exps`` [E, I, H] ...), here in Q8_0 blocks, Qwen2-MoE's
shared expert and its [1, H] gate beside them; a Mixtral is a 'llama' file with ``expert_count``. And
what it leaves unsaid, which the reader fills in as llama.cpp assumes it: Gemma's score scale
(head_dim ** -0.5), Gemma 3's local RoPE base 10000 and sliding pattern (5 in 6), SmolLM3's NoPE
layer every 4th. The reference is transformers' model loaded from the directory the GGUF converts to,
on the dequantized Q8_0 experts; the PyTorch engine runs those too, TurboMind the Q8_0 blocks themselves.
"""
from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from lmd.gguf_tokenizer import build_tokenizer
from lmd.model_config import ModelConfig
from lmd.model_loader import load_weights
from lmd.model_path import prepare_model_dir
from lmd.pytorch_backend.models import build_model
from lmd.turbomind.model import TurbomindModel
from lmd.weights.turbomind_layout import load_fused
from test_families import tokens
from test_model_loading import add_tiny_tokenizer
from test_models import hf_logits, run_chunked
from test_turbomind_model import BLOCK_SIZE, tm_chunked
from tiny_models import tiny_hf_model

BASE = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=256, eos_token_id=257)
MOE = dict(num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
# family -> (GGUF arch, HF config class, HF model class, config fields)
FAMILIES = {
    'smollm3': ('smollm3', 'SmolLM3Config', 'SmolLM3ForCausalLM',
                dict(num_hidden_layers=4, intermediate_size=96, no_rope_layer_interval=4, tie_word_embeddings=True)),
    'gemma2': ('gemma2', 'Gemma2Config', 'Gemma2ForCausalLM',
               dict(num_hidden_layers=2, intermediate_size=96, sliding_window=8, query_pre_attn_scalar=16)),
    'gemma3': ('gemma3', 'Gemma3TextConfig', 'Gemma3ForCausalLM',
               dict(num_hidden_layers=6, intermediate_size=96, sliding_window=8, query_pre_attn_scalar=16,
                    rope_theta=100000.0, rope_local_base_freq=10000.0)),
    'olmo2': ('olmo2', 'Olmo2Config', 'Olmo2ForCausalLM', dict(num_hidden_layers=2, intermediate_size=96)),
    'glm4': ('glm4', 'Glm4Config', 'Glm4ForCausalLM',
             dict(num_hidden_layers=2, intermediate_size=96, partial_rotary_factor=0.5, attention_bias=True)),
    'mixtral': ('llama', 'MixtralConfig', 'MixtralForCausalLM',
                dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    'qwen2_moe': ('qwen2moe', 'Qwen2MoeConfig', 'Qwen2MoeForCausalLM',
                  dict(MOE, shared_expert_intermediate_size=48, norm_topk_prob=False)),
    'qwen3_moe': ('qwen3moe', 'Qwen3MoeConfig', 'Qwen3MoeForCausalLM', dict(MOE, norm_topk_prob=True)),
    # sliding and full layers alternating, YaRN, sinks, biased router and experts (MXFP4 in the file)
    'gpt_oss': ('gpt-oss', 'GptOssConfig', 'GptOssForCausalLM',
                dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=8, rope_parameters={'rope_type': 'yarn', 'rope_theta': 150000.0, 'factor': 32.0,
                                                        'beta_fast': 32.0, 'beta_slow': 1.0, 'truncate': False,
                                                        'original_max_position_embeddings': 64})),
    # latent attention through the low-rank q pair, YaRN with mscale, a dense first layer, greedy routing (what
    # llama.cpp runs for V2) scaled, two shared experts
    'deepseek_v2': ('deepseek2', 'DeepseekV2Config', 'DeepseekV2ForCausalLM',
                    dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=32,
                         q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, topk_method='greedy',
                         routed_scaling_factor=2.0, rope_parameters=dict(
                             rope_type='yarn', rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             mscale=0.707, mscale_all_dim=0.707, beta_fast=32.0, beta_slow=1.0))),
}
PERMUTED = ('llama', 'smollm3')  # archs whose q/k rows llama.cpp permutes
EXPERT = re.compile(r'^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.)(\d+)\.([a-z0-9_]+)\.weight$')


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row permutation of q / k: each head's half-split RoPE pairs made interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """The saved checkpoint's tensors by HF name, a layer's experts stacked under
    ``...experts.<matmul>`` [E, N, K] as llama.cpp's converter stacks them."""
    flat = {k: v.float().numpy() for k, v in load_file(os.path.join(model_dir, 'model.safetensors')).items()}
    out, experts = {}, {}
    for name, a in flat.items():
        m = EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = a
        else:
            out[name] = a
    out.update({name: np.stack([parts[e] for e in range(len(parts))]) for name, parts in experts.items()})
    return out


def split_gpt_oss_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gpt-oss's stacked experts as llama.cpp's converter writes them: ``gate_up_proj`` [E, H, 2 I] transposed
    and split into gate (even columns) and up (odd), their bias alike; ``down_proj`` [E, I, H] transposed."""
    out = {}
    for name, a in tensors.items():
        if name.endswith('experts.gate_up_proj'):
            p = name.removesuffix('gate_up_proj')
            t = a.transpose(0, 2, 1)
            out[p + 'gate_proj.weight'], out[p + 'up_proj.weight'] = t[:, 0::2], t[:, 1::2]
        elif name.endswith('experts.gate_up_proj_bias'):
            p = name.removesuffix('gate_up_proj_bias')
            out[p + 'gate_proj.bias'], out[p + 'up_proj.bias'] = a[:, 0::2], a[:, 1::2]
        elif name.endswith('experts.down_proj'):
            out[name + '.weight'] = a.transpose(0, 2, 1)
        elif name.endswith('experts.down_proj_bias'):
            out[name.removesuffix('_bias') + '.bias'] = a
        else:
            out[name] = a
    return out


def split_kv_b(tensors: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """DeepSeek-V2's ``kv_b_proj`` [Hq (nope + v), L] as llama.cpp's converter writes it for its absorbed
    attention: per head, ``k_b_proj`` [Hq, L, nope] (the key rows, transposed) and ``v_b_proj`` [Hq, v, L]."""
    out = {}
    nope, v = cfg['qk_nope_head_dim'], cfg['v_head_dim']
    for name, a in tensors.items():
        if name.endswith('kv_b_proj.weight'):
            kv_b = a.reshape(cfg['num_attention_heads'], nope + v, a.shape[-1])
            out[name.replace('kv_b_proj', 'k_b_proj')] = kv_b[:, :nope].transpose(0, 2, 1)
            out[name.replace('kv_b_proj', 'v_b_proj')] = kv_b[:, nope:]
        else:
            out[name] = a
    return out


def write_gguf(model_dir: str, arch: str, path: str) -> None:
    """The HF model in ``model_dir`` as llama.cpp's converter writes it: F32 tensors, experts in Q8_0."""
    with open(os.path.join(model_dir, 'config.json')) as f:
        cfg = json.load(f)
    layers, heads, kv_heads = cfg['num_hidden_layers'], cfg['num_attention_heads'], cfg['num_key_value_heads']
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(cfg['max_position_embeddings'])
    w.add_embedding_length(cfg['hidden_size'])
    w.add_feed_forward_length(cfg['intermediate_size'])
    w.add_head_count(heads)
    if arch == 'deepseek2':  # latent attention written as MQA over [latent | rope key], as the converter does
        L, rope_dims = cfg['kv_lora_rank'], cfg['qk_rope_head_dim']
        w.add_head_count_kv(1)
        w.add_key_length(L + rope_dims)
        w.add_value_length(L)
        w.add_key_length_mla(cfg['qk_nope_head_dim'] + rope_dims)
        w.add_value_length_mla(cfg['v_head_dim'])
        w.add_kv_lora_rank(L)
        if cfg.get('q_lora_rank'):
            w.add_q_lora_rank(cfg['q_lora_rank'])
        w.add_rope_dimension_count(rope_dims)
        w.add_leading_dense_block_count(cfg['first_k_dense_replace'])
        w.add_expert_shared_count(cfg['n_shared_experts'])
        w.add_expert_weights_scale(cfg['routed_scaling_factor'])
        w.add_rope_scaling_yarn_log_mul(0.1 * cfg['rope_parameters']['mscale_all_dim'])
    else:
        w.add_head_count_kv(kv_heads)
        w.add_key_length(cfg['head_dim'])
        w.add_value_length(cfg['head_dim'])
    w.add_layer_norm_rms_eps(cfg['rms_norm_eps'])
    rope = cfg.get('rope_parameters') or {}
    rope = rope.get('full_attention', rope)
    w.add_rope_freq_base(rope.get('rope_theta', cfg.get('rope_theta', 10000.0)))
    rotary = rope.get('partial_rotary_factor', cfg.get('partial_rotary_factor'))
    if rotary:
        w.add_rope_dimension_count(int(cfg['head_dim'] * rotary))
    if rope.get('rope_type') == 'yarn':
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope['factor'])
        w.add_rope_scaling_orig_ctx_len(rope['original_max_position_embeddings'])
    if arch == 'gpt-oss':
        w.add_sliding_window(cfg['sliding_window'])
        w.add_expert_feed_forward_length(cfg['intermediate_size'])
    if arch.startswith('gemma'):
        w.add_sliding_window(cfg['sliding_window'])
        if cfg.get('attn_logit_softcapping'):
            w.add_attn_logit_softcapping(cfg['attn_logit_softcapping'])
        if cfg.get('final_logit_softcapping'):
            w.add_final_logit_softcapping(cfg['final_logit_softcapping'])
    experts = cfg.get('num_experts') or cfg.get('num_local_experts') or cfg.get('n_routed_experts')
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg['num_experts_per_tok'])
        if 'moe_intermediate_size' in cfg:
            w.add_expert_feed_forward_length(cfg['moe_intermediate_size'])
        if cfg.get('shared_expert_intermediate_size'):
            w.add_expert_shared_feed_forward_length(cfg['shared_expert_intermediate_size'])
    add_tiny_tokenizer(w, cfg['vocab_size'])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace('-', '_')], layers)
    tensors = hf_tensors(model_dir)
    if arch == 'gpt-oss':
        tensors = split_gpt_oss_experts(tensors)
    if arch == 'deepseek2':
        tensors = split_kv_b(tensors, cfg)
    for name, a in tensors.items():
        if name == 'lm_head.weight' and cfg.get('tie_word_embeddings'):
            continue
        base, kind = name.rsplit('.', 1) if name.endswith(('.weight', '.bias')) else (name, 'weight')
        if arch in PERMUTED and base.endswith(('q_proj', 'k_proj')):
            a = permute(a, heads if base.endswith('q_proj') else kv_heads)
        if arch.startswith('gemma') and name.endswith('norm.weight'):
            a = a + 1.0
        gguf_name = f'{names.get_name(base)}.{kind}'
        if a.ndim == 3 and '.experts.' in name:  # stacked experts: quantized, as real files hold them (gpt-oss's in MXFP4)
            qtype = gguf.GGMLQuantizationType.MXFP4 if arch == 'gpt-oss' else gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope='module')
def gguf_models(tmp_path_factory):
    """family -> (HF float32 model on the GGUF's dequantized weights, the GGUF's converted directory, the
    directory of the HF model the GGUF was written from)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            arch, cfg_name, model_name, extra = FAMILIES[family]
            model, _ = tiny_hf_model(cfg_name, model_name, 0, **BASE, **extra)
            if family == 'gpt_oss':  # sinks large enough to matter
                with torch.no_grad():
                    for layer in model.model.layers:
                        layer.self_attn.sinks.normal_(0, 2.0)
            src = str(tmp_path_factory.mktemp(family))
            model.save_pretrained(src, safe_serialization=True)
            path = os.path.join(src, f'tiny-{family}.gguf')
            write_gguf(src, arch, path)
            model_dir = prepare_model_dir(path)
            ref = getattr(transformers, model_name).from_pretrained(model_dir, attn_implementation='eager',
                                                                    dtype=torch.float32).eval()
            cache[family] = (ref, model_dir, src)
        return cache[family]
    return get


@pytest.mark.parametrize('family', list(FAMILIES))
def test_config_and_weights_come_back(gguf_models, family):
    """The converted directory is the HF model again: its config's family facts, and every weight (the
    experts as their Q8_0 blocks dequantize)."""
    ref, model_dir, source_dir = gguf_models(family)
    config = ModelConfig.from_dir(model_dir)
    assert config.architecture == FAMILIES[family][2]
    source = ref.config
    if family.startswith('gemma'):
        assert config.layer_windows == tuple(8 if t == 'sliding_attention' else 0 for t in source.layer_types)
        assert config.attention_scale == 16 ** -0.5 and config.norm_offset == 1.0
    if family == 'gemma3':
        assert config.layer_windows == (8,) * 5 + (0,) and config.rope_local_theta == 10000.0
    if family == 'smollm3':
        assert config.rope_layers == (True, True, True, False)
    if config.moe is not None:
        assert (config.moe.num_experts, config.moe.top_k) == (4, 2)
        assert config.moe.norm_topk_prob == (family not in ('qwen2_moe', 'deepseek_v2'))
        assert config.moe.shared_intermediate_size == {'qwen2_moe': 48, 'deepseek_v2': 64}.get(family, 0)
    if family == 'deepseek_v2':
        assert (config.mla.kv_lora_rank, config.mla.q_lora_rank, config.mla.v_head_dim) == (32, 24, 24)
        assert config.moe.routed_scaling_factor == 2.0 and config.moe.sparse_layers == (False, True, True)
    weights = load_weights(model_dir, torch.float32)
    original = load_file(os.path.join(source_dir, 'model.safetensors'))
    assert set(weights) == set(original) - ({'lm_head.weight'} if config.tie_word_embeddings else set())
    for name, t in weights.items():
        want = original[name].float()
        # the experts went through Q8_0: within half a step, (block max) / 127 / 2, of each value, and the step's
        # own float16 rounding times 127 (2^-11 * 127 of a step); gpt-oss's through MXFP4 (a power-of-two scale,
        # the top of the block clamped at 6 of it): within half the max
        step = 1 if family == 'gpt_oss' else 127
        tol = want.abs().max().item() / step * 0.57 if '.experts.' in name and 'bias' not in name else 1e-6
        assert (t - want).abs().max().item() <= tol, name


@pytest.mark.parametrize('engine', ['pytorch', 'turbomind'])
@pytest.mark.parametrize('family', list(FAMILIES))
def test_logits_match_hf(gguf_models, family, engine):
    """Teacher-forced logits past the sliding window (40 tokens, window 8), prefill in chunks then decode."""
    ref, model_dir, _ = gguf_models(family)
    toks = tokens(40, seed=5)
    want = hf_logits(ref, toks)
    config = ModelConfig.from_dir(model_dir)
    if engine == 'turbomind':
        tensors, _ = load_fused(model_dir, config, torch.float32)
        if family == 'gpt_oss':  # MXFP4 experts: dequantized, stacked
            assert tensors['layers.0.experts.gate_up'].shape == (4, 64, 64)
        elif config.moe is not None:  # the experts run on their Q8_0 blocks, one matmul an expert
            n = config.moe.sparse_layers.index(True)
            assert f'layers.{n}.experts.gate_up' not in tensors
            assert tensors[f'layers.{n}.experts.gate_up.1.gguf_types'].tolist() == [gguf.GGMLQuantizationType.Q8_0]
        got = tm_chunked(TurbomindModel.from_fused(config, tensors, torch.float32, 64, BLOCK_SIZE), toks, [7, 4])
    else:  # as the engine loads it: the Q8_0 experts run as W8A16, one matmul an expert (DeepSeek-V2's: float)
        from lmd.pytorch_backend.loading import load_model_weights
        weights, quantized, _ = load_model_weights(model_dir, config, None, torch.float32)
        if config.moe is not None and config.mla is None and family != 'gpt_oss':
            assert any('.experts.1.' in name for name in quantized)
        got = run_chunked(build_model(config, weights, torch.float32, quantized=quantized), toks, [7, 4])
    assert want.abs().max() > 1.0
    diff = (got - want).abs().max().item()
    assert diff < 1e-3, f'{engine} {family}: max |logit diff| vs HF = {diff}'


def test_gpt_4o_pre_tokenizer_splits_as_o200k():
    """A gpt-oss file's BPE pre-tokenizer ('gpt-4o'): CamelCase split, contractions kept on their word,
    digits in threes (GPT-2's regex, the fallback, would keep 'HelloWorld' whole and split "'s" off)."""
    tokens = [chr(c) for c in range(33, 127)] + ["ab"]
    tk, _ = build_tokenizer({'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.tokens': tokens,
                             'tokenizer.ggml.merges': ['a b'], 'tokenizer.ggml.pre': 'gpt-4o'}, 'x.gguf')
    pieces = [p for p, _ in tk.pre_tokenizer.pre_tokenize_str("HelloWorld it's 12345")]
    assert pieces == ['Hello', 'World', "\u0120it's", '\u0120', '123', '45']
