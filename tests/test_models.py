"""PyTorch-backend models vs HF transformers (float32 eager) on tiny random models.

Every architecture runs over a paged cache with block_size 4 and shuffled block
ids: a prompt prefilled in two chunks, then 16 teacher-forced decode steps;
logits at every position must match HF's. Batches of sequences of different
lengths (mixed prefill and decode) must match each sequence alone.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig
from lmd.pytorch_backend.context import StepContext
from lmd.pytorch_backend.models import build_model
from tiny_models import tiny_hf_model

BLOCK_SIZE = 4
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6)

ARCHS = {
    'llama': ('LlamaConfig', 'LlamaForCausalLM', dict(tie_word_embeddings=True)),
    'llama3_rope': ('LlamaConfig', 'LlamaForCausalLM', dict(
        rope_theta=5000.0, rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                                         'high_freq_factor': 4.0, 'original_max_position_embeddings': 16})),
    'mistral': ('MistralConfig', 'MistralForCausalLM', dict(sliding_window=None)),
    'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM', dict(tie_word_embeddings=True)),
    'qwen3': ('Qwen3Config', 'Qwen3ForCausalLM', dict(head_dim=24)),
}


def make_hf_model(arch: str, seed: int = 0):
    cfg_name, model_name, extra = ARCHS[arch]
    model, hf_config = tiny_hf_model(cfg_name, model_name, seed, **TINY, **extra)
    config = ModelConfig.from_dict(hf_config.to_dict())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop('lm_head.weight', None)
    return model, config, weights


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


class PagedRunner:
    """Builds a StepContext by hand: each sequence owns blocks taken from a shuffled pool."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = BLOCK_SIZE, seed: int = 1):
        self.model = model
        self.block_size = block_size
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (seq_id, new token ids) per sequence; returns each one's float32 logits."""
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for sid, toks in chunks:
            table = self.tables.setdefault(sid, [])
            start = self.lens.get(sid, 0)
            for j, tok in enumerate(toks):
                pos = start + j
                if pos // self.block_size >= len(table):
                    table.append(self.free.pop())
                ids.append(tok)
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            self.lens[sid] = start + len(toks)
            query_lens.append(len(toks))
            context_lens.append(start + len(toks))
        max_blocks = max(len(self.tables[sid]) for sid, _ in chunks)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for i, (sid, _) in enumerate(chunks):
            tables[i, :len(self.tables[sid])] = torch.tensor(self.tables[sid], dtype=torch.int32)
        ql = torch.tensor(query_lens, dtype=torch.int32)
        dev = self.model.device  # the step's tensors live where the model does (tests/test_gpu.py: CUDA)
        ctx = StepContext(
            kv_caches=self.kv_caches, block_size=self.block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=ql.to(dev), cu_query_lens=torch.nn.functional.pad(ql.cumsum(0), (1, 0)).to(dev, torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev), block_tables=tables.to(dev),
            is_decode=all(n == 1 for n in query_lens),
            query_lens_list=query_lens, context_lens_list=context_lens)
        hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), ctx)
        assert hidden.shape == (len(ids), self.model.config.hidden_size)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.cpu().split(query_lens))


def run_chunked(model, tokens: list[int], prefill_chunks: list[int], seed: int = 1) -> torch.Tensor:
    """Prefill tokens in the given chunk sizes, then decode the rest one token at a time."""
    runner = PagedRunner(model, seed=seed)
    out, pos = [], 0
    for n in prefill_chunks:
        out += runner.step([(0, tokens[pos:pos + n])])
        pos += n
    while pos < len(tokens):
        out += runner.step([(0, [tokens[pos]])])
        pos += 1
    return torch.cat(out)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY['vocab_size'], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# 'torch' is the reference backend, 'native' the CPU default (TurboMind's C++ kernels)
CPU_BACKENDS = ['torch', 'native']


@pytest.mark.parametrize('backend', CPU_BACKENDS)
@pytest.mark.parametrize('arch', list(ARCHS))
def test_chunked_prefill_and_decode_match_hf(arch, backend):
    hf_model, config, weights = make_hf_model(arch)
    model = build_model(config, weights, torch.float32, kernel_backend=backend)
    tokens = random_tokens(11 + 16, seed=3)
    ours = run_chunked(model, tokens, prefill_chunks=[7, 4])
    ref = hf_logits(hf_model, tokens)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-3, f'{arch}: max |logit diff| vs HF = {diff}'


@pytest.mark.parametrize('backend', CPU_BACKENDS)
@pytest.mark.parametrize('arch', ['llama', 'qwen3'])
def test_batch_matches_each_sequence_alone(arch, backend):
    hf_model, config, weights = make_hf_model(arch)
    model = build_model(config, weights, torch.float32, kernel_backend=backend)
    seqs = [random_tokens(n, seed=10 + n) for n in (5, 9, 14)]
    decode = [random_tokens(4, seed=20 + i) for i in range(3)]
    runner = PagedRunner(model, seed=7)
    got = [[] for _ in seqs]
    # step 1: all three prefill (seq 2 only its first 6 tokens)
    for i, lg in enumerate(runner.step([(0, seqs[0]), (1, seqs[1]), (2, seqs[2][:6])])):
        got[i].append(lg)
    # step 2: seqs 0 and 1 decode while seq 2 prefills the rest (a mixed step)
    for i, lg in enumerate(runner.step([(0, decode[0][:1]), (1, decode[1][:1]), (2, seqs[2][6:])])):
        got[i].append(lg)
    # steps 3..: all decode together, each at a different context length
    for t in range(3):
        chunk = [(0, decode[0][1 + t:2 + t]), (1, decode[1][1 + t:2 + t]), (2, decode[2][t:t + 1])]
        for i, lg in enumerate(runner.step(chunk)):
            got[i].append(lg)
    for i in range(3):
        full = seqs[i] + (decode[i][:4] if i < 2 else decode[i][:3])
        ours = torch.cat(got[i])
        alone = run_chunked(model, full, prefill_chunks=[len(seqs[i])], seed=100 + i)
        assert ours.shape == alone.shape
        assert (ours - alone).abs().max().item() < 1e-4, f'seq {i}: batched differs from alone'
        diff = (ours - hf_logits(hf_model, full)).abs().max().item()
        assert diff < 1e-3, f'seq {i}: max |logit diff| vs HF = {diff}'


@pytest.mark.parametrize('backend', CPU_BACKENDS)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('arch', ['llama', 'qwen2', 'qwen3'])
def test_half_precision_close_to_float32(arch, dtype, backend):
    hf_model, config, weights = make_hf_model(arch)
    model = build_model(config, weights, dtype, kernel_backend=backend)
    assert model.dtype == dtype and model.kv_cache_bytes_per_block(4) == 2 * 2 * 4 * 2 * config.head_dim * 2
    tokens = random_tokens(9 + 6, seed=5)
    ours = run_chunked(model, tokens, prefill_chunks=[5, 4])
    ref = hf_logits(hf_model, tokens)
    assert torch.isfinite(ours).all()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 0.05, f'{arch} {dtype}: max |diff| / max |logit| = {rel}'
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, f'{arch} {dtype}: greedy agreement {agree}'


def test_model_attributes_and_cache_shapes():
    _, config, weights = make_hf_model('qwen3')
    model = build_model(config, weights, torch.float32)
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size) == (2, 2, 24, 128)
    caches = model.allocate_kv_cache(num_blocks=5, block_size=4)
    assert len(caches) == 2
    for k, v in caches:
        assert k.shape == v.shape == (5, 4, 2, 24) and k.dtype == torch.float32
    assert model.kv_cache_bytes_per_block(4) == 2 * 2 * 4 * 2 * 24 * 4


def test_bad_weights_raise_model_format_error():
    _, config, weights = make_hf_model('qwen2')
    bad = dict(weights)
    bad['model.layers.1.self_attn.k_proj.weight'] = torch.zeros(3, 64)
    with pytest.raises(ModelFormatError, match=r"k_proj.weight.*\[3, 64\].*expected \[32, 64\]"):
        build_model(config, bad, torch.float32)
    missing = dict(weights)
    del missing['model.layers.0.mlp.up_proj.weight']
    with pytest.raises(ModelFormatError, match='missing tensor .model.layers.0.mlp.up_proj.weight'):
        build_model(config, missing, torch.float32)
    extra = dict(weights, **{'model.layers.0.mlp.extra.weight': torch.zeros(2)})
    with pytest.raises(ModelFormatError, match='unexpected tensor .model.layers.0.mlp.extra.weight'):
        build_model(config, extra, torch.float32)
    # a tied checkpoint that still carries lm_head, and an old rotary buffer, both load
    ok = dict(weights, **{'lm_head.weight': weights['model.embed_tokens.weight'].clone(),
                          'model.layers.0.self_attn.rotary_emb.inv_freq': torch.zeros(8)})
    build_model(config, ok, torch.float32)


@pytest.mark.parametrize('rope_parameters', [
    {'rope_type': 'default', 'rope_theta': 10000.0},
    {'rope_type': 'linear', 'factor': 4.0, 'rope_theta': 10000.0},
    {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
     'original_max_position_embeddings': 64, 'rope_theta': 500000.0},
    {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 64, 'rope_theta': 10000.0},
])
def test_rope_frequencies_match_hf(rope_parameters):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from lmd.pytorch_backend.models.rope import compute_inv_freq
    hf_config = transformers.LlamaConfig(**TINY, rope_parameters=dict(rope_parameters))
    hf_config.architectures = ['LlamaForCausalLM']
    rope_type = rope_parameters['rope_type']
    if rope_type == 'default':
        inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        scale = 1.0
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, 'cpu')
    ours, our_scale = compute_inv_freq(ModelConfig.from_dict(hf_config.to_dict()))
    torch.testing.assert_close(ours, inv.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(scale)


def test_unsupported_rope_type_is_a_clear_error():
    import dataclasses
    _, config, weights = make_hf_model('llama')
    config = dataclasses.replace(config, rope_scaling={'rope_type': 'dynamic', 'factor': 2.0})
    with pytest.raises(ModelFormatError, match="'dynamic' is not supported"):
        build_model(config, weights, torch.float32)
