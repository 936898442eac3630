"""Inputs the kernel tests share (tests/test_kernels.py on the CPU, tests/test_gpu.py on CUDA):
random paged caches over shuffled blocks with their StepContext, RoPE tables, the attention cases."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lmd.pytorch_backend.context import StepContext


def make_ctx(query_lens, context_lens, block_size, num_kv_heads, head_dim, dtype, seed=0, num_blocks=None):
    """Random caches and a StepContext over shuffled, non-contiguous blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = num_blocks or sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(query_lens), max(blocks_per_seq), dtype=torch.int32)
    slots = []
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        ids = [perm.pop() for _ in range(blocks_per_seq[i])]
        tables[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for p in range(ctx_len - q_len, ctx_len):
            slots.append(ids[p // block_size] * block_size + p % block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    ql = torch.tensor(query_lens, dtype=torch.int32)
    ctx = StepContext(
        kv_caches=[(k_cache, v_cache)], block_size=block_size, slot_mapping=torch.tensor(slots),
        query_lens=ql, cu_query_lens=F.pad(ql.cumsum(0), (1, 0)).to(torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=tables,
        is_decode=all(n == 1 for n in query_lens),
        query_lens_list=list(query_lens), context_lens_list=list(context_lens))
    return ctx, k_cache, v_cache


def cos_sin(max_pos, rot_dim, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    f = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((f.cos(), f.sin()), -1).to(dtype)


ATTN_CASES = [
    # (query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim)
    ([1], [1], 4, 4, 2, 16),                        # decode, first token
    ([1], [37], 4, 9, 3, 64),                       # decode, SmolLM2 heads
    ([1, 1, 1], [5, 17, 2], 4, 4, 2, 24),           # batched decode, padded block tables
    ([1, 1], [33, 16], 16, 4, 4, 32),               # MHA, bigger blocks
    ([7], [7], 4, 4, 2, 16),                        # prefill from scratch
    ([4, 1, 6], [11, 9, 6], 4, 6, 2, 16),           # mixed: chunked prefill, decode, fresh prefill
]
