"""GGUF files of the families beyond Llama, as llama.cpp's converter writes them, in both engines.

Phi-3: q/k/v and gate/up stay fused (``attn_qkv``, an ``ffn_up`` holding gate then up), the rotary
part of a head is ``rope.dimension_count``, a LongRoPE model keeps its factors as the tensors
``rope_factors_long`` / ``rope_factors_short`` and its original context as metadata, the window as
``attention.sliding_window``. The tiny model here has all of them (window 8, sequences of 40), and
its fused qkv in Q8_0 blocks, which TurboMind multiplies as stored; against HF float32 on the same
(dequantized) weights.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lmd.gguf_model import read_gguf
from lmd.messages import TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.model_path import prepare_model_dir
from lmd.pytorch_backend.models import build_model
from lmd.weights.turbomind_layout import load_fused
from lmd.turbomind.model import TurbomindModel
from test_families import tokens
from test_model_loading import add_tiny_tokenizer
from test_models import hf_logits, run_chunked
from test_turbomind_model import BLOCK_SIZE, tm_chunked
from tiny_models import tiny_hf_model

ORIGINAL = 16
PHI3 = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=None,
            bos_token_id=256, eos_token_id=257, partial_rotary_factor=0.5, sliding_window=8,
            original_max_position_embeddings=ORIGINAL,
            rope_scaling={'rope_type': 'longrope', 'original_max_position_embeddings': ORIGINAL,
                          'short_factor': [1.0 + 0.1 * i for i in range(4)],
                          'long_factor': [1.0 + 1.2 * i for i in range(4)]})


def write_phi3_gguf(model, path: str) -> None:
    """``model`` as llama.cpp's Phi3MiniModel converter writes it (F32 tensors, qkv in Q8_0)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_scaling
    w = gguf.GGUFWriter(path, 'phi3')
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(ORIGINAL)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(int(head_dim * cfg.partial_rotary_factor))
    w.add_rope_freq_base(cfg.rope_parameters['rope_theta'])
    w.add_sliding_window(cfg.sliding_window)
    add_tiny_tokenizer(w, cfg.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        base, kind = name.rsplit('.', 1)
        a = t.detach().float().numpy().copy()
        if base.endswith('qkv_proj'):  # a quantized fused matmul: its blocks as the file stores them
            w.add_tensor(f'{names.get_name(base)}.{kind}', gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f'{names.get_name(base)}.{kind}', a)
    for key, factors in (('rope_factors_long', rope['long_factor']), ('rope_factors_short', rope['short_factor'])):
        w.add_tensor(f'{key}.weight', np.array(factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope='module')
def phi3(tmp_path_factory):
    """(HF model on the GGUF's dequantized weights, the GGUF's converted directory)."""
    model, _ = tiny_hf_model('Phi3Config', 'Phi3ForCausalLM', 0, **PHI3)
    path = str(tmp_path_factory.mktemp('phi3') / 'tiny-phi3.gguf')
    write_phi3_gguf(model, path)
    model_dir = prepare_model_dir(path)
    ref, _ = tiny_hf_model('Phi3Config', 'Phi3ForCausalLM', 0, **PHI3)
    ref.load_state_dict(read_gguf(path).state_dict)  # qkv as its Q8_0 blocks dequantize
    return ref, model_dir


def test_the_config_is_phi3s(phi3):
    ref, model_dir = phi3
    config = ModelConfig.from_dir(model_dir)
    assert config.architecture == 'Phi3ForCausalLM' and config.layer_windows == (8, 8)
    raw = config.raw
    assert raw['partial_rotary_factor'] == 0.5 and raw['original_max_position_embeddings'] == ORIGINAL
    assert raw['rope_scaling']['rope_type'] == 'longrope'
    for key in ('long_factor', 'short_factor'):
        assert raw['rope_scaling'][key] == pytest.approx(PHI3['rope_scaling'][key])


@pytest.mark.parametrize('engine', ['pytorch', 'turbomind'])
def test_logits_match_hf_past_the_window_and_the_original_context(phi3, engine):
    ref, model_dir = phi3
    toks = tokens(40, seed=9)
    want = hf_logits(ref, toks)
    config = ModelConfig.from_dir(model_dir)
    if engine == 'turbomind':
        tensors, fmt = load_fused(model_dir, config, torch.float32)
        assert fmt == 'gguf'
        model = TurbomindModel.from_fused(config, tensors, torch.float32, 64, BLOCK_SIZE, session_len=128)
        assert model.linear_formats['layers.0.qkv'] == 'w8a16'  # the Q8_0 blocks as W8A16 panels, exactly
        got = tm_chunked(model, toks, [7, 4])
    else:
        from lmd.model_loader import load_weights
        model = build_model(config, load_weights(model_dir, torch.float32), torch.float32)
        model.build_rope(128)
        got = run_chunked(model, toks, [7, 4])
    assert (got - want).abs().max().item() < 1e-3
