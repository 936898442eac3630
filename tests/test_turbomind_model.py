"""TurboMind's C++ model (lmd.turbomind.model) against HF transformers (float32 eager) and
the PyTorch backend, step by step over a paged cache with shuffled blocks: prompts
prefilled in chunks, then teacher-forced decode steps, alone and batched."""
from __future__ import annotations

import pytest
import torch

from lmd.model_config import ModelConfig
from lmd.model_loader import load_weights
from lmd.pytorch_backend.models import build_model
from lmd.turbomind.model import TurbomindModel
from test_models import ARCHS, hf_logits, make_hf_model, random_tokens, run_chunked

BLOCK_SIZE = 4


class Runner:
    """Drives a TurbomindModel: allocates blocks per sequence, builds each step's rows."""

    def __init__(self, model: TurbomindModel, num_blocks: int, seed: int = 1):
        self.model = model
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]], all_logits: bool = True) -> list[torch.Tensor]:
        """chunks: (seq_id, new token ids); each sequence's logits for all its new tokens
        (or, without all_logits, only its last one)."""
        bs = self.model.block_size
        ids, positions, slots, owners, logit_rows = [], [], [], [], []
        for sid, toks in chunks:
            table = self.tables.setdefault(sid, [])
            start = self.lens.get(sid, 0)
            for j, tok in enumerate(toks):
                pos = start + j
                if pos // bs >= len(table):
                    table.append(self.free.pop())
                if all_logits or j == len(toks) - 1:
                    logit_rows.append(len(ids))
                ids.append(tok)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                owners.append(sid)
            self.lens[sid] = start + len(toks)
        max_blocks = max(len(t) for t in self.tables.values())
        tables = torch.zeros(len(ids), max_blocks, dtype=torch.int32)
        for row, sid in enumerate(owners):
            tables[row, :len(self.tables[sid])] = torch.tensor(self.tables[sid], dtype=torch.int32)
        row_lens = torch.tensor(positions, dtype=torch.int32) + 1
        logits = self.model.forward(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), tables, row_lens,
                                    torch.tensor(logit_rows, dtype=torch.int64))
        sizes = [len(t) if all_logits else 1 for _, t in chunks]
        return list(logits.split(sizes))


def tm_model(config: ModelConfig, weights, dtype=torch.float32, num_blocks: int = 64) -> TurbomindModel:
    return TurbomindModel(config, weights, dtype, num_blocks, BLOCK_SIZE)


def tm_chunked(model: TurbomindModel, tokens: list[int], prefill_chunks: list[int], seed: int = 1) -> torch.Tensor:
    runner = Runner(model, model.cpp.num_blocks, seed)
    out, pos = [], 0
    for n in prefill_chunks:
        out += runner.step([(0, tokens[pos:pos + n])])
        pos += n
    while pos < len(tokens):
        out += runner.step([(0, [tokens[pos]])])
        pos += 1
    return torch.cat(out)


@pytest.mark.parametrize('arch', list(ARCHS))
def test_teacher_forced_logits_match_hf_and_pytorch_backend(arch):
    hf_model, config, weights = make_hf_model(arch)
    tokens = random_tokens(11 + 16, seed=3)
    ours = tm_chunked(tm_model(config, weights), tokens, prefill_chunks=[7, 4])
    ref = hf_logits(hf_model, tokens)
    assert (ours - ref).abs().max().item() < 1e-3
    torch_backend = run_chunked(build_model(config, weights, torch.float32, kernel_backend='torch'), tokens, [7, 4])
    assert (ours - torch_backend).abs().max().item() < 1e-4


@pytest.mark.parametrize('arch', ['llama', 'qwen3'])
def test_batched_rows_equal_each_sequence_alone(arch):
    """A step mixing prefill chunks and decodes gives each sequence bitwise what it gets alone."""
    _, config, weights = make_hf_model(arch)
    model = tm_model(config, weights)
    seqs = [random_tokens(n, seed=10 + n) for n in (5, 9, 14)]
    runner = Runner(model, 64, seed=7)
    got = [[] for _ in seqs]
    for i, lg in enumerate(runner.step([(0, seqs[0][:5]), (1, seqs[1][:9]), (2, seqs[2][:6])])):
        got[i].append(lg)
    for i, lg in enumerate(runner.step([(2, seqs[2][6:])])):
        got[2].append(lg)
    for i in range(3):
        alone = tm_chunked(model, seqs[i], [len(seqs[i])], seed=100 + i)
        assert torch.equal(torch.cat(got[i]), alone), f'seq {i}'


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('arch', ['llama', 'qwen2', 'qwen3'])
def test_half_precision_close_to_float32(arch, dtype):
    hf_model, config, weights = make_hf_model(arch)
    tokens = random_tokens(9 + 6, seed=5)
    ours = tm_chunked(tm_model(config, weights, dtype), tokens, prefill_chunks=[5, 4])
    ref = hf_logits(hf_model, tokens)
    assert torch.isfinite(ours).all()
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


def test_smollm2_teacher_forced_logits_match_hf(smollm2_dir):
    import transformers
    config = ModelConfig.from_dir(smollm2_dir)
    model = TurbomindModel(config, load_weights(smollm2_dir, torch.float32), torch.float32, 32, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokens = random_tokens(40, seed=9)
    tokens = [t + 100 for t in tokens]
    ours = tm_chunked(model, tokens, prefill_chunks=[24])
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def test_bad_rows_are_clear_errors():
    _, config, weights = make_hf_model('llama')
    model = tm_model(config, weights, num_blocks=8)
    runner = Runner(model, 8)
    with pytest.raises(ValueError, match='outside the vocabulary'):
        runner.step([(0, [1, 2, config.vocab_size])])
    ids = torch.tensor([1])
    one = torch.tensor([0])
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match='not a cache slot'):
        model.forward(ids, one, torch.tensor([8 * BLOCK_SIZE]), table, torch.tensor([1], dtype=torch.int32), one)
    with pytest.raises(ValueError, match=r'row_tables\[0, 0\] = 99 is not a block'):
        model.forward(ids, one, one, table + 99, torch.tensor([1], dtype=torch.int32), one)
    with pytest.raises(ValueError, match='missing weight layers.1.qkv'):
        from lmd.kernels import ops
        from lmd.turbomind import _turbomind
        tensors = {k: ops.HostTensor(torch.utils.dlpack.to_dlpack(v)) for k, v in model.tensors.items()
                   if k != 'layers.1.qkv'}
        cfg = dict(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_layers=config.num_layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps)
        _turbomind.LlamaModel(cfg, tensors, 'float32', 8, BLOCK_SIZE)
    # and the model still runs
    assert torch.isfinite(runner.step([(1, [1, 2, 3])])[0]).all()


def test_smollm2_gguf_runs_at_4_bits_without_loss(smollm2_dir):
    """The shipped Q4_1 weights in TurboMind's W4A16 layout dequantize bit for bit to the
    float weights lmd's GGUF reader produces, and the 4-bit model's logits match HF float32."""
    import transformers

    from lmd.turbomind.quant import dequantize_w4a16, gguf_w4a16_for
    config = ModelConfig.from_dir(smollm2_dir)
    weights = load_weights(smollm2_dir, torch.float32)
    w4a16 = gguf_w4a16_for(smollm2_dir)
    assert len(w4a16) == 7 * config.num_layers  # every matmul of every layer
    for name, parts in w4a16.items():
        assert torch.equal(dequantize_w4a16(*parts), weights[name]), name
    model = TurbomindModel(config, weights, torch.float32, 32, 16, quantized=w4a16)
    assert model.num_w4a16 == 4 * config.num_layers  # qkv, o, gate_up, down
    # GGUF's fp16 block scales and minimums stay 16-bit in the panels: 0.625 bytes a weight
    fused = [n for n, f in model.linear_formats.items() if f == 'w4a16']
    assert all(model.tensors[f'{n}.{p}'].dtype == torch.float16 for n in fused for p in ('scales', 'mins'))
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokens = [t + 100 for t in random_tokens(40, seed=9)]
    ours = tm_chunked(model, tokens, prefill_chunks=[24])
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def test_the_engine_runs_on_its_own_copy_of_the_kernels_pool():
    """_turbomind links its own lmd_kernels: its kernels' regions show in its thread_pool_stats,
    not in lmd.kernels' (two pools, two thread counts: lib/kernels/README.md, Threads)."""
    from lmd import kernels
    from lmd.turbomind import _turbomind
    _, config, weights = make_hf_model('llama')
    model = tm_model(config, weights)
    old = _turbomind.num_threads()
    _turbomind.set_num_threads(2)  # one thread runs no region at all; an earlier test may have left one
    try:
        mine, theirs = _turbomind.thread_pool_stats(), kernels._kernels.thread_pool_stats()
        tm_chunked(model, random_tokens(40, seed=5), prefill_chunks=[32])
        after = _turbomind.thread_pool_stats()
    finally:
        _turbomind.set_num_threads(old)
    ran = lambda s: s['regions'] + s['inline_regions']  # noqa: E731
    assert ran(after) > ran(mine)
    assert ran(kernels._kernels.thread_pool_stats()) == ran(theirs)
