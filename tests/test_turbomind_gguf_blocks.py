"""TurboMind on GGUF files whose matmuls mix block types: a tiny Llama written with every type the
kernels run (random blocks, so every bit pattern of codes and scales; needs nothing but gguf), and
SmolLM2 as llama.cpp's quantizer writes it: SmolLM2 in Q4_K_M, whose 576-wide
rows make it a mixed file (Q5_0 for most matmuls, attn_v in Q5_0 or Q8_0, ffn_down in Q4_K or Q6_K,
the tied Q8_0 embedding as the head). A matmul all of Q4_0 / Q4_1 / Q4_K runs on the W4A16 panels, one
all of Q5_0 / Q8_0 / Q6_K (one group size) on the W8A16 panels, both exactly the file's weights; every
other one, and all of them under int8 activations, on the file's blocks as stored (ops.linear_gguf; the
kernels against their reference in test_gguf_kernels.py), a fused q/k/v in parts of one type each.
Against HF transformers in float32 on the same file (dequantized by gguf.quants): the teacher-forced
logits, and 32 greedy tokens through the engine; the PyTorch engine likewise."""
from __future__ import annotations

import os

import pytest
import torch

from lmd.engine import SamplingParams
from lmd.gguf_quantize import llama_cpp_missing
from lmd.messages import PytorchEngineConfig, TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.pytorch_backend import PytorchEngine
from lmd.turbomind.model import TurbomindModel
from lmd.weights.turbomind_layout import load_fused
from test_pytorch_engine import generate
from test_turbomind_formats import hf_logits, tokens
from test_turbomind_model import tm_chunked

# the tiny model's matmuls: each layer its own mix (hidden 256 and 512 so k-quant rows fit)
# (float activations: a matmul all of Q5_0 / Q8_0 / Q6_K, one group size, runs as W8A16 in panels; the
# Q4_K_M file below fuses Q5_0 and Q8_0 parts so)
TINY_TYPES = [
    {'q_proj': 'Q4_K', 'k_proj': 'Q5_K', 'v_proj': 'Q6_K', 'o_proj': 'Q5_0', 'gate_proj': 'Q4_1',
     'up_proj': 'Q5_1', 'down_proj': 'IQ4_NL'},
    {'q_proj': 'Q8_0', 'k_proj': 'Q8_0', 'v_proj': 'Q4_0', 'o_proj': 'Q6_K', 'gate_proj': 'Q4_K',
     'up_proj': 'Q4_K', 'down_proj': 'Q5_K'},
]
TINY_FORMATS = {'lm_head': 'w8a16', 'layers.0.qkv': 'gguf', 'layers.0.o': 'w8a16', 'layers.0.gate_up': 'gguf',
                'layers.0.down': 'gguf', 'layers.1.qkv': 'gguf', 'layers.1.o': 'w8a16', 'layers.1.gate_up': 'w4a16',
                'layers.1.down': 'gguf'}


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
    assert model.linear_formats == TINY_FORMATS  # the Q6_K head in W8A16 (groups of 16) too
    assert model.tensors['layers.0.qkv.gguf_types'].tolist() == [12, 13, 14]  # Q6_K among other types: blocks
    assert model.tensors['layers.1.qkv.gguf_types'].tolist() == [8, 2]  # Q4_0 has no W8A16 form here
    assert model.tensors['layers.0.o.scales'].dtype == torch.float16  # Q5_0's fp16 d, exactly
    assert model.tensors['layers.1.o.scales'].shape == (16, 256 // 16, 16)  # Q6_K: groups of 16, float32
    int8_formats = tm(tiny_mixed_dir, int8=True).linear_formats  # llama.cpp's arithmetic: every block as stored
    assert int8_formats == {n: 'w4a16' if f == 'w4a16' else 'gguf' for n, f in TINY_FORMATS.items()}
    toks = [t % 250 for t in tokens(24, seed=3)]
    want = hf_logits(hf, toks)
    for int8 in (False, True):
        got = tm_chunked(tm(tiny_mixed_dir, int8), toks, prefill_chunks=[9, 7])
        err = (got - want).abs().max().item() / (want.max() - want.min()).item()
        assert err < (0.04 if int8 else 1e-5), (int8, err)


@pytest.mark.parametrize('kernel_backend', ['native', 'torch'])
def test_the_pytorch_engine_runs_a_mixed_file(tiny_mixed_dir, kernel_backend):
    """The same file in the PyTorch engine: its matmuls as TurboMind runs them with float activations (the
    native kernels: W8A16 panels, W4A16 panels, blocks through ops.linear_gguf; torch: dequantized)."""
    import transformers

    from lmd.pytorch_backend.kernels import native, torch_ops
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_mixed_dir, dtype=torch.float32).eval()
    toks = [t % 250 for t in tokens(24, seed=3)]
    want = hf_logits(hf, toks)[10:]
    config = PytorchEngineConfig(session_len=64, cache_max_entry_count=0.05, kernel_backend=kernel_backend)
    with PytorchEngine(tiny_mixed_dir, config) as engine:
        assert engine.model_format == 'gguf'
        layers = engine.runner.model.layers
        if kernel_backend == 'native':
            assert isinstance(layers[0].o, native.NativeQuantLinear)  # Q5_0 as W8A16
            assert [type(p).__name__ for p in layers[1].qkv.parts] == ['NativeGgufLinear'] * 2  # Q8_0, Q4_0
        else:
            assert isinstance(layers[0].qkv.parts[0], torch_ops.GgufLinear)
        got = engine.teacher_forced_logits(toks[:11], toks[11:])
        out, _ = generate(engine, [toks[:12]], SamplingParams(max_new_tokens=12))
    assert (got - want).abs().max().item() < 1e-5 * (want.max() - want.min()).item()
    ref = list(toks[:12])
    with torch.no_grad():
        for _ in range(12):
            ref.append(int(hf_logits(hf, ref)[-1].argmax()))
    assert out[0] == ref[12:]


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
def test_every_matmul_runs_on_the_files_codes(q4km_dir):
    model = tm(q4km_dir)  # float activations: Q5_0 / Q8_0 / Q6_K as W8A16 panels, Q4_K as W4A16
    formats = model.linear_formats
    assert {f for n, f in formats.items() if n.endswith('.down')} == {'w8a16', 'w4a16'}  # Q6_K / Q4_K
    assert all(f == 'w8a16' for n, f in formats.items() if not n.endswith('.down'))  # the tied Q8_0 head too
    downs = [model.tensors[n + '.scales'] for n, f in formats.items() if n.endswith('.down') and f == 'w8a16']
    assert all(s.dtype == torch.float32 and s.shape[1] == 1536 // 16 for s in downs)  # Q6_K: d sc every 16
    assert model.tensors['layers.0.qkv.scales'].dtype == torch.float16  # Q5_0 / Q8_0: their fp16 d
    blocks = tm(q4km_dir, int8=True)  # int8 activations: llama.cpp's arithmetic on the blocks as stored
    types = {int(t) for n, v in blocks.tensors.items() if n.endswith('.gguf_types') for t in v}
    assert types == {6, 8, 14}  # Q5_0, Q8_0, Q6_K
    assert any(len(v) == 2 for n, v in blocks.tensors.items() if n.endswith('qkv.gguf_types'))  # Q5_0 + Q8_0 parts
    # at the file's own widths: 22 / 34 / 144 / 210 bytes a block, not widened
    raw = sum(v.numel() for n, v in blocks.tensors.items() if '.gguf.' in n)
    assert raw < 0.7 * 4 * sum(blocks.config.hidden_size * n for n in (3 * 576, 576, 2 * 1536, 1536)) * 30 / 4


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
    config = PytorchEngineConfig(session_len=128, cache_max_entry_count=0.05)
    with PytorchEngine(q4km_dir, config) as engine:  # the same matmuls in the PyTorch engine
        assert engine.model_format == 'gguf'
        pt = engine.teacher_forced_logits(toks[:24], toks[24:])
        out, _ = generate(engine, [prompt], SamplingParams(max_new_tokens=32))
    assert (pt - want[23:]).abs().max().item() < 1e-3 * (want.max() - want.min()).item()
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
