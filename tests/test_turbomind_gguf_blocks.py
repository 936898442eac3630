"""TurboMind on GGUF files whose matmuls mix block types: a tiny Llama written with every type the
kernels run (random blocks, so every bit pattern of codes and scales; needs nothing but gguf), and
SmolLM2 as llama.cpp's quantizer writes it: SmolLM2 in Q4_K_M, whose 576-wide
rows make it a mixed file (Q5_0 for most matmuls, attn_v in Q5_0 or Q8_0, ffn_down in Q4_K or Q6_K,
the tied Q8_0 embedding as the head). Every matmul runs on the file's blocks as stored
(ops.linear_gguf; the kernels against their reference in test_gguf_kernels.py), a fused q/k/v in
parts of one type each, except those all of Q4_0 / Q4_1 / Q4_K, which map exactly onto the W4A16
panels. Against HF transformers in float32 on the same file (dequantized by
gguf.quants): the teacher-forced logits, and 32 greedy tokens through the engine."""
from __future__ import annotations

import os

import pytest
import torch

from lmd.engine import SamplingParams
from lmd.gguf_quantize import llama_cpp_missing
from lmd.messages import TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.turbomind.model import TurbomindModel
from lmd.weights.turbomind_layout import load_fused
from test_pytorch_engine import generate
from test_turbomind_formats import hf_logits, tokens
from test_turbomind_model import tm_chunked

# the tiny model's matmuls: each layer its own mix (hidden 256 and 512 so k-quant rows fit)
TINY_TYPES = [
    {'q_proj': 'Q4_K', 'k_proj': 'Q5_K', 'v_proj': 'Q6_K', 'o_proj': 'Q5_0', 'gate_proj': 'Q4_1',
     'up_proj': 'Q5_1', 'down_proj': 'IQ4_NL'},
    {'q_proj': 'Q8_0', 'k_proj': 'Q8_0', 'v_proj': 'Q4_0', 'o_proj': 'Q6_K', 'gate_proj': 'Q4_K',
     'up_proj': 'Q4_K', 'down_proj': 'Q5_K'},
]


@pytest.fixture(scope='module')
def tiny_mixed_dir(tmp_path_factory) -> str:
    from test_gguf_kernels import random_blocks
    from test_model_loading import _tiny_model, _write_tiny_gguf

    from lmd.model_path import prepare_model_dir
    model = _tiny_model('llama', tie=False, hidden_size=256, intermediate_size=512, head_dim=64)
    blocks = {}
    for layer, types in enumerate(TINY_TYPES):
        for name, t in model.model.layers[layer].named_parameters():
            part = name.split('.')[1]
            if part in types:
                hf = f'model.layers.{layer}.{name}'
                blocks[hf] = (random_blocks(types[part], t.shape[0], t.shape[1], seed=len(blocks)).numpy(), types[part])
    blocks['lm_head.weight'] = (random_blocks('Q6_K', 300, 256, seed=99).numpy(), 'Q6_K')
    path = str(tmp_path_factory.mktemp('mixed') / 'tiny-mixed.gguf')
    _write_tiny_gguf(model, 'llama', path, blocks)
    return prepare_model_dir(path)


def test_a_tiny_model_of_every_type_equals_hf(tiny_mixed_dir):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_mixed_dir, dtype=torch.float32).eval()
    model = tm(tiny_mixed_dir)
    formats = model.linear_formats
    assert formats.pop('layers.1.gate_up') == 'w4a16'  # Q4_K parts only: the W4A16 panels
    assert set(formats.values()) == {'gguf'}  # the Q6_K head too
    assert [v.tolist() for n, v in model.tensors.items() if n == 'layers.0.qkv.gguf_types'] == [[12, 13, 14]]
    toks = [t % 250 for t in tokens(24, seed=3)]
    want = hf_logits(hf, toks)
    for int8 in (False, True):
        got = tm_chunked(tm(tiny_mixed_dir, int8), toks, prefill_chunks=[9, 7])
        err = (got - want).abs().max().item() / (want.max() - want.min()).item()
        assert err < (0.04 if int8 else 1e-5), (int8, err)


_llama_cpp_missing = llama_cpp_missing()
needs_llama_cpp = pytest.mark.skipif(
    _llama_cpp_missing is not None,
    reason=f'llama-cpp-python writes the Q4_K_M file (benchmark/setup_llamacpp.sh): {_llama_cpp_missing}')


@pytest.fixture(scope='module')
def q4km_dir(tmp_path_factory) -> str:
    from lmd.gguf_quantize import quantize_gguf
    from lmd.model_path import default_model_file, prepare_model_dir
    out = str(tmp_path_factory.mktemp('q4km'))
    return prepare_model_dir(quantize_gguf(default_model_file(), os.path.join(out, 'smollm2-Q4_K_M.gguf')))


@pytest.fixture(scope='module')
def hf(q4km_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(q4km_dir, dtype=torch.float32).eval()


def tm(model_dir: str, int8: bool = False) -> TurbomindModel:
    config = ModelConfig.from_dir(model_dir)
    tensors, fmt = load_fused(model_dir, config, torch.float32)
    assert fmt == 'gguf'
    return TurbomindModel.from_fused(config, tensors, torch.float32, 64, 4, int8_activations=int8)


@needs_llama_cpp
def test_every_matmul_runs_on_the_files_blocks(q4km_dir):
    model = tm(q4km_dir)
    formats = model.linear_formats
    assert {f for n, f in formats.items() if n.endswith('.down')} == {'gguf', 'w4a16'}  # Q6_K / Q4_K (panels)
    assert all(f == 'gguf' for n, f in formats.items() if not n.endswith(('.down', 'lm_head')))
    assert formats['lm_head'] == 'w8a16'  # the tied Q8_0 embedding
    types = {int(t) for n, v in model.tensors.items() if n.endswith('.gguf_types') for t in v}
    assert types == {6, 8, 14}  # Q5_0, Q8_0, Q6_K
    assert any(len(v) == 2 for n, v in model.tensors.items() if n.endswith('qkv.gguf_types'))  # Q5_0 + Q8_0 parts
    # at the file's own widths: 22 / 34 / 144 / 210 bytes a block, not widened
    raw = sum(v.numel() for n, v in model.tensors.items() if '.gguf.' in n)
    assert raw < 0.7 * 4 * sum(model.config.hidden_size * n for n in (3 * 576, 576, 2 * 1536, 1536)) * 30 / 4


@needs_llama_cpp
def test_logits_and_greedy_tokens_equal_hf_on_the_same_file(q4km_dir, hf):
    toks = [t + 100 for t in tokens(40, seed=7)]
    got = tm_chunked(tm(q4km_dir), toks, prefill_chunks=[24])
    want = hf_logits(hf, toks)
    err = (got - want).abs().max().item()
    assert err < 1e-3 * (want.max() - want.min()).item(), err
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    from lmd.turbomind.engine import TurbomindEngine
    prompt = toks[:12]
    with TurbomindEngine(q4km_dir, TurbomindEngineConfig(session_len=128, cache_max_entry_count=0.05)) as engine:
        out, _ = generate(engine, [prompt], SamplingParams(max_new_tokens=32))  # no stop tokens
    ref = list(prompt)
    with torch.no_grad():
        for _ in range(32):  # HF's greedy continuation, whole context each step
            ref.append(int(hf_logits(hf, ref)[-1].argmax()))
    assert out[0] == ref[12:]


@needs_llama_cpp
def test_int8_activations_predict_as_hf(q4km_dir, hf):
    """llama.cpp's arithmetic (x in Q8 blocks): close to HF, not equal (as for Q4_1 in
    test_turbomind_w4a8.py)."""
    toks = [t + 100 for t in tokens(64, seed=4)]
    got = tm_chunked(tm(q4km_dir, int8=True), toks, prefill_chunks=[48])
    want = hf_logits(hf, toks)
    assert (got - want).abs().max().item() < 0.04 * (want.max() - want.min()).item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.85
