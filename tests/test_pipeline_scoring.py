"""``pipeline.get_logits`` / ``get_ppl`` (LMDeploy's names) on both engines against HF transformers
in float32, on tiny random models: every position's teacher-forced logits, the mean NLL of each
sequence, scoring beside a generation that it leaves untouched, and clear errors for bad ids."""
from __future__ import annotations

import math
import os
import random
import shutil

import pytest
import torch
import transformers

from lmd import GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig, pipeline
from lmd.engine import token_nll
from tiny_models import tiny_hf_model

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json')
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6)
ARCHS = {  # a tied embedding without biases; an untied one with q/k/v biases
    'llama': ('LlamaConfig', 'LlamaForCausalLM', dict(tie_word_embeddings=True)),
    'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM', dict(tie_word_embeddings=False)),
}
CONFIGS = {'turbomind': TurbomindEngineConfig, 'pytorch': PytorchEngineConfig}
SESSION_LEN = 160


@pytest.fixture(scope='module')
def tiny_dirs(smollm2_dir, tmp_path_factory):
    """arch -> (HF model, its directory with SmolLM2's tokenizer, whose vocabulary it has)."""
    vocab = transformers.AutoTokenizer.from_pretrained(smollm2_dir).vocab_size
    out = {}
    for arch, (config_class, model_class, extra) in ARCHS.items():
        model, _ = tiny_hf_model(config_class, model_class, seed=7, vocab_size=vocab, **TINY, **extra)
        path = tmp_path_factory.mktemp(f'tiny_{arch}')
        model.save_pretrained(path, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(smollm2_dir, name)):
                shutil.copy(os.path.join(smollm2_dir, name), path)
        out[arch] = (model, str(path))
    return out


@pytest.fixture(scope='module', params=[(b, a) for b in CONFIGS for a in ARCHS], ids=lambda p: f'{p[0]}-{p[1]}')
def scored(request, tiny_dirs):
    """(backend, HF model, pipeline): blocks of 16 so the sequences below end mid-block."""
    backend, arch = request.param
    model, path = tiny_dirs[arch]
    config = CONFIGS[backend](session_len=SESSION_LEN, cache_block_seq_len=16, num_cache_blocks=24, dtype='float32')
    pipe = pipeline(path, backend_config=config, backend=backend)
    yield backend, model, pipe
    pipe.close()


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def test_get_logits_match_hf(scored):
    backend, model, pipe = scored
    vocab = model.config.vocab_size
    rng = random.Random(3)
    seqs = [random_ids(rng, n, vocab) for n in (1, 37, SESSION_LEN)]
    got = pipe.get_logits(seqs)
    assert isinstance(got, list) and len(got) == len(seqs)
    for ids, logits in zip(seqs, got):
        want = hf_logits(model, ids)
        assert logits.dtype == torch.float32 and logits.device.type == 'cpu'
        assert logits.shape == want.shape == (len(ids), vocab)
        assert (logits - want).abs().max().item() < 1e-3, (backend, len(ids))
    # one sequence alone: a list of one, the same numbers (each is scored from an empty cache)
    single = pipe.get_logits(seqs[1])
    assert len(single) == 1 and torch.equal(single[0], got[1])


def test_get_ppl_is_the_mean_nll_hf_gives(scored):
    backend, model, pipe = scored
    rng = random.Random(4)
    seqs = [random_ids(rng, n, model.config.vocab_size) for n in (2, 50, 97)]
    got = pipe.get_ppl(seqs)
    assert isinstance(got, list) and len(got) == len(seqs)
    for ids, nll in zip(seqs, got):
        logits = hf_logits(model, ids)
        want = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item()
        assert abs(nll - want) < 1e-4, (backend, len(ids), nll, want)
        # LMDeploy's meaning: the loss in nats, not its exp; and the same arithmetic as get_logits + token_nll
        assert nll == token_nll(pipe.get_logits(ids)[0], ids).sum().item() / (len(ids) - 1)
        assert 0 < nll < 2 * math.log(model.config.vocab_size)
    assert pipe.get_ppl(seqs[1]) == [got[1]]


def test_scoring_beside_a_generation_leaves_it_alone(scored):
    """get_logits between the tokens of a running generation: the generation's tokens equal those
    of the same generation alone, the scores equal those of an idle engine, and no block leaks."""
    backend, model, pipe = scored
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True, do_sample=False)
    prompt = 'Perplexity is measured on held-out text.'
    alone = pipe(prompt, gen, do_preprocess=False).token_ids
    ids = random_ids(random.Random(5), 90, model.config.vocab_size)
    idle = pipe.get_logits(ids)[0]
    tokens, scores = [], []
    for r in pipe.stream_infer(prompt, gen, do_preprocess=False):
        tokens.extend(r.token_ids)
        if len(scores) < 3:
            scores.append(pipe.get_logits(ids)[0])
    assert tokens == alone, backend
    assert all(torch.equal(s, idle) for s in scores), backend
    stats = pipe.async_engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks


def test_bad_ids_are_clear_errors(scored):
    _, model, pipe = scored
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match='non-empty list of token ids'):
        pipe.get_logits([])
    with pytest.raises(ValueError, match=rf'token id {vocab} is outside the vocabulary \[0, {vocab}\)'):
        pipe.get_logits([1, 2, vocab])
    with pytest.raises(ValueError, match=rf'{SESSION_LEN + 1} tokens are more than session_len={SESSION_LEN}'):
        pipe.get_ppl([1] * (SESSION_LEN + 1))
    with pytest.raises(ValueError, match=r'input_ids\[1\] must be a list of at least 2 token ids'):
        pipe.get_ppl([[1, 2], [3]])
    with pytest.raises(TypeError, match='sequence of int token ids'):
        pipe.get_logits([1.5, 2])
    assert pipe.get_ppl([5, 6]) and pipe.async_engine.is_alive()  # still serving
