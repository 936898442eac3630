"""``lmd.lite.eval_ppl``: the same perplexity from every backend, equal to one computed by hand
from HF transformers' logits; clear errors for text too short and settings that cannot run."""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import transformers

from lmd.lite.calib_data import builtin_text
from lmd.lite.eval_ppl import eval_ppl
from tiny_models import tiny_hf_model

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json')
WINDOW, NUM_WINDOWS = 32, 3


@pytest.fixture(scope='module')
def tiny_dir(smollm2_dir, tmp_path_factory):
    """A tiny random Llama over SmolLM2's tokenizer (its vocabulary), saved with that tokenizer."""
    vocab = transformers.AutoTokenizer.from_pretrained(smollm2_dir).vocab_size
    model, _ = tiny_hf_model('LlamaConfig', 'LlamaForCausalLM', seed=4, vocab_size=vocab, hidden_size=64,
                             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, rms_norm_eps=1e-6)
    path = tmp_path_factory.mktemp('tiny_ppl')
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(smollm2_dir, name)):
            shutil.copy(os.path.join(smollm2_dir, name), path)
    return str(path), model


@pytest.fixture(scope='module')
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp('text') / 'eval.txt'
    path.write_text(builtin_text('eval')[:4000], encoding='utf-8')
    return str(path)


@torch.no_grad()
def hand_ppl(model, model_dir: str, text: str, window: int, num_windows: int) -> float:
    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)['input_ids']
    nll = []
    for w in range(num_windows):
        chunk = torch.tensor(ids[w * window:(w + 1) * window])
        logits = model(chunk[None]).logits[0]
        nll.append(torch.nn.functional.cross_entropy(logits[:-1].double(), chunk[1:], reduction='none'))
    return math.exp(torch.cat(nll).mean().item())


@pytest.mark.parametrize('backend', ['turbomind', 'pytorch', 'hf'])
def test_ppl_equals_hand_computed_from_hf_logits(tiny_dir, text_file, backend):
    path, model = tiny_dir
    want = hand_ppl(model, path, open(text_file, encoding='utf-8').read(), WINDOW, NUM_WINDOWS)
    got = eval_ppl(path, text_file, backend=backend, window=WINDOW, num_windows=NUM_WINDOWS)
    assert (got['tokens'], got['windows'], got['window']) == (NUM_WINDOWS * (WINDOW - 1), NUM_WINDOWS, WINDOW)
    assert abs(got['ppl'] / want - 1) < 1e-4, (got['ppl'], want)
    assert got['nll'] == pytest.approx(math.log(got['ppl']))
    assert got['seconds'] > 0 and got['backend'] == backend


def test_quantized_kv_cache_agrees_across_engines(tiny_dir, text_file):
    path, _ = tiny_dir
    float_ppl = eval_ppl(path, text_file, window=WINDOW, num_windows=NUM_WINDOWS)['ppl']
    for bits in (8, 4):
        tm, pt = (eval_ppl(path, text_file, backend=b, quant_policy=bits, window=WINDOW,
                           num_windows=NUM_WINDOWS)['ppl'] for b in ('turbomind', 'pytorch'))
        assert abs(tm / pt - 1) < 1e-4, (bits, tm, pt)
        assert tm != float_ppl and abs(tm / float_ppl - 1) < (0.01 if bits == 8 else 0.2), (bits, tm, float_ppl)


def test_bad_input_is_a_clear_error(tiny_dir, text_file, tmp_path):
    path, _ = tiny_dir
    with pytest.raises(ValueError, match=r'has \d+ tokens, fewer than num_windows \* window = 500 \* 32 .* '
                                         r'\d+ windows of 32 tokens fit'):
        eval_ppl(path, text_file, window=WINDOW, num_windows=500)
    with pytest.raises(ValueError, match="backend='vllm' is invalid"):
        eval_ppl(path, text_file, backend='vllm')
    with pytest.raises(ValueError, match="quant_policy=8 needs backend 'turbomind' or 'pytorch'"):
        eval_ppl(path, text_file, backend='hf', quant_policy=8)
    with pytest.raises(ValueError, match='window=1 is invalid'):
        eval_ppl(path, text_file, window=1)
    with pytest.raises(FileNotFoundError, match='no_such.txt'):
        eval_ppl(path, str(tmp_path / 'no_such.txt'))
    empty = tmp_path / 'empty.txt'
    empty.write_text('  \n')
    with pytest.raises(ValueError, match='is empty'):
        eval_ppl(path, str(empty))


def test_smollm2_turbomind_equals_hf(smollm2_dir):
    """The default model and text, 2 windows of 128, float32: TurboMind within 1e-3 of HF."""
    tm = eval_ppl('smollm2', model_format='hf', window=128, num_windows=2)
    hf = eval_ppl(smollm2_dir, backend='hf', window=128, num_windows=2)
    assert abs(tm['ppl'] / hf['ppl'] - 1) < 1e-3, (tm, hf)
    assert 5 < hf['ppl'] < 100  # real English prose under a real model
