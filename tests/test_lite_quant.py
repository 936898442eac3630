"""lmd.lite: calibration, AWQ (W4A16) and SmoothQuant (W8A8) on tiny random models.

The models are tiny HF Llama / Qwen2 / Qwen3 / Mistral models with SmolLM2's tokenizer (so the
built-in pydoc calibration text tokenizes as it does for the real model). The quantizers' output
checkpoints are loaded by TurboMind and its teacher-forced logits compared with HF float32 on the
float model; the AWQ layout is also checked exactly against HF on the weights it stands for.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from lmd.lite.awq import auto_awq, dequantize_w4, fake_quantize_w4, quantize_rtn, quantize_w4, search_scale
from lmd.lite.calib_data import calib_text, calib_tokens
from lmd.lite.calibrate import LINEARS, STATS_FILE, calibrate
from lmd.lite.smooth_quant import smooth_quant
from lmd.turbomind.quant import _awq_unpack, awq_pack, dequantize_w4a16, dequantize_w8a8, from_awq, quantize_w8, to_awq
from safetensors.torch import load_file
from test_turbomind_formats import tm_logits
from tiny_models import tiny_hf_model

from lmd.cli import main
from lmd.errors import ModelFormatError, ModelNotFoundError
from lmd.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2's tokenizer
TINY = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ARCHS = {'llama': ('LlamaConfig', 'LlamaForCausalLM', {}),
         'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM', dict(tie_word_embeddings=True)),   # q/k/v biases, tied head
         'qwen3': ('Qwen3Config', 'Qwen3ForCausalLM', dict(head_dim=32)),                # q_norm / k_norm
         'mistral': ('MistralConfig', 'MistralForCausalLM', dict(num_key_value_heads=4))}  # no GQA: o_proj scaled
CALIB = dict(calib_samples=8, calib_seqlen=64, batch_size=4)
CALIB_FLAGS = ['--calib-samples', '8', '--calib-seqlen', '64']


def save_tiny(path: str, smollm2_dir: str, arch: str = 'llama', outliers: bool = False, **overrides):
    """A tiny random model of ``arch`` saved as an HF directory with SmolLM2's tokenizer; returns it.
    ``outliers``: four hidden channels of every norm weight 20x larger, as real models have, and q/k
    weights 8x smaller (random q/k that large make softmax a hard argmax that any error flips)."""
    cfg_name, model_name, extra = ARCHS[arch]
    model, _ = tiny_hf_model(cfg_name, model_name, seed=5, **{**TINY, **extra, **overrides})
    if outliers:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm.weight[:4] *= 20
                layer.post_attention_layernorm.weight[:4] *= 20
                layer.self_attn.q_proj.weight /= 8
                layer.self_attn.k_proj.weight /= 8
    model.save_pretrained(path)
    for name in ('tokenizer.json', 'tokenizer_config.json', 'generation_config.json'):
        shutil.copy(os.path.join(smollm2_dir, name), path)
    return model


@pytest.fixture(scope='module')
def tiny_dirs(tmp_path_factory, smollm2_dir):
    """arch -> (directory, HF float32 model) of the tiny models, written once."""
    root = tmp_path_factory.mktemp('tiny')
    return {arch: (str(root / arch), save_tiny(str(root / arch), smollm2_dir, arch)) for arch in ARCHS}


def tokens(n: int = 27, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@torch.no_grad()
def rel_error(model_dir: str, ref_model, toks: list[int]) -> float:
    """||TurboMind logits - HF float32 logits|| / ||HF float32 logits||, teacher-forced."""
    ref = ref_model(torch.tensor([toks])).logits[0]
    return ((tm_logits(model_dir, toks) - ref).norm() / ref.norm()).item()


# ---- formats --------------------------------------------------------------------------------------------

@pytest.mark.parametrize('sym', [False, True])
def test_awq_pack_round_trip(sym):
    w = torch.randn(48, 256) * torch.rand(1, 256) * 3
    q, scales, zeros = quantize_w4(w, 64, sym)
    assert q.max() <= 15 and zeros.max() <= 15 and scales.dtype == torch.float16
    assert torch.equal(_awq_unpack(awq_pack(q.T)), q.T)
    packed = to_awq(q, scales, zeros)
    assert [list(t.shape) for t in packed.values()] == [[256, 6], [4, 6], [4, 48]]  # qweight, qzeros, scales
    deq = fake_quantize_w4(w, 64, sym)
    assert torch.equal(deq, dequantize_w4(q, scales, zeros))  # the searches' shortcut: the same bits
    assert torch.equal(dequantize_w4a16(*from_awq(packed['qweight'], packed['qzeros'], packed['scales'])), deq)
    # round to nearest: within half a step of w (plus the fp16 rounding of the scale)
    step = scales.float().repeat_interleave(64, 1)
    assert ((deq - w).abs() <= step * 0.5 + 1e-3 * w.abs() + 1e-6).all()
    with pytest.raises(ValueError, match='N = 12 is not a multiple of 8'):
        to_awq(*quantize_w4(torch.randn(12, 64), 32))


def test_int8_round_trip():
    w = torch.randn(40, 96) * torch.rand(40, 1) * 5
    qweight, scales = quantize_w8(w)
    assert qweight.dtype == torch.int8 and scales.shape == (40,)
    assert qweight.abs().amax(1).eq(127).all()  # each row's largest weight is full scale
    assert ((dequantize_w8a8(qweight, scales) - w).abs() <= scales[:, None] / 2 + 1e-6).all()


def test_scale_search_beats_rtn_on_outlier_channels():
    torch.manual_seed(0)
    x = torch.randn(2048, 256)
    x[:, :8] *= 30                                       # a few channels carry large activations
    w = torch.randn(64, 256) * 0.1
    train, held = x[:1024], x[1024:]
    s, ratio, errors = search_scale(train.T @ train / len(train), w, train.abs().mean(0), group_size=64)
    assert ratio > 0 and len(errors) == 20
    ref = held @ w.T
    awq_err = ((held / s) @ fake_quantize_w4(w * s, 64).T - ref).pow(2).mean()
    rtn_err = (held @ fake_quantize_w4(w, 64).T - ref).pow(2).mean()
    assert awq_err < 0.7 * rtn_err, (awq_err, rtn_err)


@torch.no_grad()
def test_scale_search_beats_rtn_on_a_real_layer(smollm2_dir):
    """SmolLM2's layer-3 gate/up weights on the inputs the model really hands them (prose, its
    post-attention norm's output): the searched scales quantize with less output error than RTN,
    measured on held-out text."""
    import transformers

    from lmd.lite.calib_data import builtin_text
    from lmd.tokenizer import Tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    mlp, seen = model.model.layers[3].mlp, []
    hook = mlp.register_forward_pre_hook(lambda _, args: seen.append(args[0][0]))
    tok = Tokenizer(smollm2_dir)
    for split in ('calib', 'eval'):
        model(torch.tensor([tok.encode(builtin_text(split)[:4000], add_special_tokens=False)[:512]]))
    hook.remove()
    train, held = seen
    w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    s, ratio, _ = search_scale(train.T @ train / len(train), w, train.abs().mean(0), group_size=64)
    ref = held @ w.T
    awq_err = ((held / s) @ fake_quantize_w4(w * s, 64).T - ref).pow(2).mean()
    rtn_err = (held @ fake_quantize_w4(w, 64).T - ref).pow(2).mean()
    assert ratio > 0 and awq_err < 0.95 * rtn_err, (ratio, awq_err, rtn_err)  # measured 0.89


# ---- calibration ----------------------------------------------------------------------------------------

def test_calib_text_sources(tmp_path, smollm2_dir, monkeypatch):
    (tmp_path / 'a.txt').write_text('Hello there. ' * 400)
    (tmp_path / 'a.jsonl').write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert calib_text(str(tmp_path / 'a.jsonl')) == 'one\n\ntwo'
    windows = calib_tokens(Tokenizer(smollm2_dir), str(tmp_path / 'a.txt'), 3, 100)
    assert windows.shape == (3, 100) and windows.dtype == torch.long
    tok = Tokenizer(smollm2_dir)
    windows = calib_tokens(tok, 'pydoc', 4, 512)  # spread over the text: four different passages of it
    assert windows.shape == (4, 512) and all(tok.decode(w[1:-1]) in calib_text('pydoc') for w in windows)
    assert len({tok.decode(w) for w in windows}) == 4
    with pytest.raises(ValueError, match=r'\d+ windows of 512 fit, 1000 were asked for'):
        calib_tokens(Tokenizer(smollm2_dir), str(tmp_path / 'a.txt'), 1000, 512)
    (tmp_path / 'empty.txt').write_text('  \n')
    with pytest.raises(ValueError, match='the text is empty'):
        calib_text(str(tmp_path / 'empty.txt'))
    (tmp_path / 'bad.jsonl').write_text('{"text": "one"}\n{"txt": "two"}\n')
    with pytest.raises(ValueError, match=r'bad.jsonl, line 2: expected an object with a string "text" field'):
        calib_text(str(tmp_path / 'bad.jsonl'))
    (tmp_path / 'bad.jsonl').write_text('not json\n')
    with pytest.raises(ValueError, match='line 1: not a JSON object'):
        calib_text(str(tmp_path / 'bad.jsonl'))
    with pytest.raises(FileNotFoundError, match='no such file'):
        calib_text(str(tmp_path / 'missing.txt'))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    with pytest.raises(ValueError, match="Hub could not be reached .* pass a local .txt or .jsonl file, or 'pydoc'"):
        calib_text('someone/some-dataset')


@torch.no_grad()
def test_calibrate_stats(tmp_path, tiny_dirs, smollm2_dir):
    model_dir, model = tiny_dirs['qwen3']
    path = calibrate(model_dir, str(tmp_path / 'calib'), **CALIB)
    assert path == str(tmp_path / 'calib' / STATS_FILE) and os.listdir(tmp_path / 'calib') == [STATS_FILE]
    stats = load_file(path)
    cfg = model.config
    assert stats['key_min'].shape == stats['value_max'].shape == (2, cfg.num_key_value_heads)
    assert (stats['key_min'] < stats['key_max']).all()
    for i in range(2):
        for name in LINEARS:
            in_features = model.model.layers[i].get_submodule(name).in_features
            absmax, absmean = (stats[f'model.layers.{i}.{name}.input_{s}'] for s in ('absmax', 'absmean'))
            assert absmax.shape == absmean.shape == (in_features,) and (absmax >= absmean).all()
    # the layer-by-layer run saw what the whole model's forward gives each layer
    toks = calib_tokens(Tokenizer(model_dir), 'pydoc', 8, 64)
    hidden = model(toks, output_hidden_states=True).hidden_states
    for i in range(2):
        layer = model.model.layers[i]
        x = layer.input_layernorm(hidden[i])
        assert torch.allclose(stats[f'model.layers.{i}.self_attn.q_proj.input_absmax'], x.abs().amax((0, 1)), rtol=1e-3)
        k = layer.self_attn.k_norm(layer.self_attn.k_proj(x).unflatten(-1, (cfg.num_key_value_heads, -1)))
        assert torch.allclose(stats['key_max'][i], k.amax((0, 1, 3)), rtol=1e-3)


# ---- AWQ ------------------------------------------------------------------------------------------------

def _dequantized_reference(model_dir: str, ref_model):
    """``ref_model`` with the weights the AWQ checkpoint in ``model_dir`` stands for."""
    weights, state = load_file(os.path.join(model_dir, 'model.safetensors')), {}
    for name, t in weights.items():
        if name.endswith('.qweight'):
            base = name[:-len('.qweight')]
            packed = t, weights[base + '.qzeros'], weights[base + '.scales']
            state[base + '.weight'] = dequantize_w4a16(*from_awq(*packed))
        elif not name.endswith(('.qzeros', '.scales')):
            state[name] = t.float()
    ref_model.load_state_dict(state, strict=not ref_model.config.tie_word_embeddings)
    return ref_model


@pytest.mark.parametrize('arch', ['qwen2', 'qwen3', 'mistral'])
def test_awq_checkpoint_runs_in_turbomind(tmp_path, tiny_dirs, arch):
    import copy
    model_dir, model = tiny_dirs[arch]
    out = auto_awq(model_dir, str(tmp_path / 'awq'), w_group_size=32, **CALIB)
    cfg = json.load(open(os.path.join(out, 'config.json')))
    assert cfg['quantization_config'] == {'quant_method': 'awq', 'version': 'gemm', 'bits': 4, 'group_size': 32,
                                          'zero_point': True}
    assert cfg['torch_dtype'] == 'float16'
    assert {'tokenizer.json', 'generation_config.json'} <= set(os.listdir(out))
    weights = load_file(os.path.join(out, 'model.safetensors'))
    assert weights['model.layers.1.mlp.down_proj.qweight'].shape == (256, 128 // 8)
    assert weights['model.layers.1.mlp.down_proj.scales'].shape == (256 // 32, 128)
    assert all(t.dtype == torch.float16 for n, t in weights.items() if not n.endswith(('qweight', 'qzeros')))
    if model.config.tie_word_embeddings:  # the head stays tied to the float16 embedding
        assert not any(n.startswith('lm_head') for n in weights) and cfg['tie_word_embeddings']
    else:
        assert weights['lm_head.weight'].dtype == torch.float16 and 'lm_head.qweight' not in weights
    toks = tokens()
    # random weights quantize badly at 4 bits (no structure): 0.33-0.40 here, so the bound vs the float
    # model is loose; the layout itself is checked exactly against HF on the dequantized weights
    assert rel_error(out, model, toks) < 0.5
    assert rel_error(out, _dequantized_reference(out, copy.deepcopy(model)), toks) < 1e-4


def test_awq_beats_rtn_on_a_model_with_outlier_channels(tmp_path, smollm2_dir):
    model = save_tiny(str(tmp_path / 'model'), smollm2_dir, outliers=True)
    rtn = quantize_rtn(str(tmp_path / 'model'), str(tmp_path / 'rtn'), w_group_size=32)
    ratios = []
    out = auto_awq(str(tmp_path / 'model'), str(tmp_path / 'awq'), w_group_size=32, **CALIB,
                   log=lambda i, groups: ratios.extend(g['ratio'] for g in groups))
    assert len(ratios) == 2 * 4 and max(ratios) > 0  # o_proj's group too, its scales tied under GQA
    toks = tokens()
    awq_err, rtn_err = rel_error(out, model, toks), rel_error(rtn, model, toks)
    assert awq_err < 0.85 * rtn_err, (awq_err, rtn_err)


@torch.no_grad()
def test_tied_o_proj_scales_keep_the_float_output():
    """Under GQA o_proj's input channel (h, d) reads v_proj's output (kv(h), d): folding one scale per
    v output, spread over the query heads that read it, leaves the layer's output as it was."""
    from lmd.lite.scales import fold_scales, smooth_groups
    model, _ = tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', vocab_size=64, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2)
    layer = model.model.layers[0]
    assert [g.name for g in smooth_groups(layer)] == ['self_attn.q_proj', 'mlp.gate_proj', 'mlp.down_proj']
    group = smooth_groups(layer, tied=True)[1]
    assert group.name == 'self_attn.o_proj' and group.expand.tolist()[:16] == [*range(8), *range(8)]
    assert group.expand.tolist()[32:40] == list(range(8, 16))  # heads 4..7 read KV head 1
    ids = torch.randint(0, 64, (1, 12))
    want = model(ids).logits
    fold_scales(group.producer, group.linears, torch.rand(16) * 3 + 0.2, group.expand)
    assert (model(ids).logits - want).abs().max().item() < 1e-4


def test_bad_awq_arguments(tmp_path, tiny_dirs, smollm2_dir):
    model_dir, _ = tiny_dirs['llama']
    with pytest.raises(ValueError, match='--w-bits 3 is not supported'):
        quantize_rtn(model_dir, str(tmp_path / 'o'), w_bits=3)
    with pytest.raises(ValueError, match='--w-group-size 48 is invalid: it must be a multiple of 32'):
        quantize_rtn(model_dir, str(tmp_path / 'o'), w_group_size=48)
    save_tiny(str(tmp_path / 'odd'), smollm2_dir, hidden_size=192, intermediate_size=384)  # like SmolLM2's 576
    with pytest.raises(ValueError, match=r'--w-group-size 128 does not divide the 192 in_features of '
                                         r'model.layers.0.self_attn.q_proj; sizes that fit every layer: 64, 32'):
        quantize_rtn(str(tmp_path / 'odd'), str(tmp_path / 'o'), w_group_size=128)
    with pytest.raises(ModelNotFoundError, match='does not exist'):
        auto_awq(str(tmp_path / 'nowhere'), str(tmp_path / 'o'))
    os.makedirs(tmp_path / 'empty')
    with pytest.raises(ModelFormatError, match='no config.json'):
        auto_awq(str(tmp_path / 'empty'), str(tmp_path / 'o'))
    with pytest.raises(ModelFormatError, match='already quantized .awq.'):
        quantize_rtn(quantize_rtn(model_dir, str(tmp_path / 'q'), w_group_size=32), str(tmp_path / 'o'))
    with pytest.raises(ValueError, match='--dtype .float64. is invalid'):
        quantize_rtn(model_dir, str(tmp_path / 'o'), dtype='float64')
    (tmp_path / 'mine').mkdir()
    (tmp_path / 'mine' / 'notes.txt').write_text('keep me')
    with pytest.raises(ValueError, match='holds files that are not an earlier lmd lite output'):
        quantize_rtn(model_dir, str(tmp_path / 'mine'), w_group_size=32)
    assert os.listdir(tmp_path / 'mine') == ['notes.txt'] and not os.path.exists(tmp_path / 'o')


def test_nan_weight_is_named_and_nothing_written(tmp_path, smollm2_dir):
    model = save_tiny(str(tmp_path / 'model'), smollm2_dir)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float('nan')
    model.save_pretrained(str(tmp_path / 'model'))
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.scales' has \d+ NaN/Inf values"):
        quantize_rtn(str(tmp_path / 'model'), str(tmp_path / 'out'), w_group_size=32)
    assert sorted(os.listdir(tmp_path)) == ['model']


def test_interrupted_write_leaves_no_complete_looking_dir(tmp_path, tiny_dirs, monkeypatch):
    model_dir, _ = tiny_dirs['llama']
    import safetensors.torch

    def fail_midway(tensors, path, metadata=None):
        with open(path, 'wb') as f:
            f.write(b'half a file')
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, 'save_file', fail_midway)
    with pytest.raises(KeyboardInterrupt):
        quantize_rtn(model_dir, str(tmp_path / 'out'), w_group_size=32)
    assert os.listdir(tmp_path) == []
    # an earlier output survives a failed rerun, and a good rerun replaces it
    monkeypatch.undo()
    quantize_rtn(model_dir, str(tmp_path / 'out'), w_group_size=64)
    monkeypatch.setattr(safetensors.torch, 'save_file', fail_midway)
    with pytest.raises(KeyboardInterrupt):
        quantize_rtn(model_dir, str(tmp_path / 'out'), w_group_size=32)
    assert os.listdir(tmp_path) == ['out']
    assert json.load(open(tmp_path / 'out' / 'config.json'))['quantization_config']['group_size'] == 64
    monkeypatch.undo()
    quantize_rtn(model_dir, str(tmp_path / 'out'), w_group_size=32)
    assert json.load(open(tmp_path / 'out' / 'config.json'))['quantization_config']['group_size'] == 32
    assert os.listdir(tmp_path) == ['out']
    # published with the modes a plain mkdir / open gives, not the private temp directory's
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / 'out').st_mode & 0o777 == 0o777 & ~umask
    assert os.stat(tmp_path / 'out' / 'model.safetensors').st_mode & 0o777 == 0o666 & ~umask


# ---- SmoothQuant ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('arch', ['qwen2', 'mistral'])
def test_w8a8_checkpoint_runs_in_turbomind(tmp_path, tiny_dirs, arch):
    model_dir, model = tiny_dirs[arch]
    out = smooth_quant(model_dir, str(tmp_path / 'w8a8'), **CALIB)
    cfg = json.load(open(os.path.join(out, 'config.json')))
    assert cfg['quantization_config'] == {'quant_method': 'smooth_quant', 'bits': 8,
                                          'activation_scheme': 'dynamic_per_token'}
    weights = load_file(os.path.join(out, 'model.safetensors'))
    assert weights['model.layers.0.self_attn.q_proj.weight'].dtype == torch.int8
    assert weights['model.layers.0.self_attn.q_proj.weight_scale'].shape == (128,)
    assert weights['model.layers.0.input_layernorm.weight'].dtype == torch.float16
    assert rel_error(out, model, tokens()) < 0.07  # 0.046 here


def test_bad_smooth_quant_arguments(tmp_path, tiny_dirs):
    model_dir, _ = tiny_dirs['llama']
    with pytest.raises(ValueError, match='--w-bits 4 is not supported: smooth_quant writes 8-bit'):
        smooth_quant(model_dir, str(tmp_path / 'o'), w_bits=4)
    with pytest.raises(ValueError, match=r'--alpha must be in \[0, 1\]'):
        smooth_quant(model_dir, str(tmp_path / 'o'), alpha=1.5)


# ---- CLI ------------------------------------------------------------------------------------------------

def test_cli_lite(tmp_path, tiny_dirs, capsys):
    model_dir, model = tiny_dirs['llama']
    out = str(tmp_path / 'awq')
    assert main(['lite', 'auto_awq', model_dir, '--work-dir', out, '--w-group-size', '64', *CALIB_FLAGS]) == 0
    assert f'wrote {out}' in capsys.readouterr().out
    assert json.load(open(os.path.join(out, 'config.json')))['quantization_config']['group_size'] == 64
    assert rel_error(out, model, tokens()) < 0.5
    assert main(['lite', 'auto_awq', model_dir, '--work-dir', out, '--w-bits', '3']) == 2
    assert capsys.readouterr().err == ('lmd: error: --w-bits 3 is not supported: auto_awq writes 4-bit weights '
                                        '(for 8-bit weights use lmd lite smooth_quant)\n')
    assert main(['lite', 'calibrate', model_dir, '--work-dir', out, '--calib-dataset', str(tmp_path / 'x.txt')]) == 2
    assert 'no such file' in capsys.readouterr().err
