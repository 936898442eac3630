"""Runs one scheduled step through the model; owns the model and the KV cache tensors.

Device code stays here: the scheduler and block manager hand over block ids and
token counts, and this file turns them into tensors once per step.
"""
from __future__ import annotations

import logging
import os

import torch

from .context import StepContext
from .scheduler import SchedulerOutput

logger = logging.getLogger('lmd.pytorch_backend')

_GIB = 1 << 30


def available_memory_bytes(device: torch.device) -> int:
    """Memory the KV cache may come out of: free GPU memory, or the host's available RAM."""
    if device.type == 'cuda':
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open('/proc/meminfo', encoding='ascii') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def num_cache_blocks_for(model, device: torch.device, block_size: int, cache_max_entry_count: float,
                         max_cache_memory_gib: float | None, min_num_blocks: int) -> int:
    """How many blocks ``cache_max_entry_count`` of free memory holds (capped on CPU), at least ``min_num_blocks``."""
    budget = available_memory_bytes(device) * cache_max_entry_count
    if device.type == 'cpu' and max_cache_memory_gib is not None:
        budget = min(budget, max_cache_memory_gib * _GIB)
    per_block = model.kv_cache_bytes_per_block(block_size)
    num_blocks = int(budget // per_block)
    if num_blocks < min_num_blocks:
        logger.warning('KV cache: %d blocks fit in %.2f GiB, fewer than one session needs; allocating %d',
                       num_blocks, budget / _GIB, min_num_blocks)
        num_blocks = min_num_blocks
    return num_blocks


class ModelRunner:

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, quant_policy: int = 0):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.quant_policy = quant_policy
        # per layer (k_cache, v_cache): [num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, StepContext, list[int]]:
        """Flatten the step into input_ids[T], positions[T] and a StepContext.

        Also returns the rows whose logits are needed: each sequence's last row when
        the step brings it up to date (``-1`` for a sequence that is still prefilling).
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        cu = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            pos = start
            while pos < end:  # one run of slots per block touched
                block = seq.block_ids[pos // bs]
                run_end = min(end, (pos // bs + 1) * bs)
                base = block * bs - (pos // bs) * bs
                slots.extend(range(base + pos, base + run_end))
                pos = run_end
            query_lens.append(n)
            context_lens.append(end)
            cu.append(cu[-1] + n)
            tables.append(seq.block_ids)
            sample_rows.append(cu[-1] - 1 if end == seq.num_tokens else -1)
        max_blocks = max((end + bs - 1) // bs for end in context_lens)
        table = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables]

        dev = self.device
        ctx = StepContext(
            kv_caches=self.kv_caches,
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(table, dtype=torch.int32, device=dev),
            is_decode=all(n == 1 for n in query_lens),
            query_lens_list=query_lens,
            context_lens_list=context_lens,
            quant_policy=self.quant_policy,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos_t, ctx, sample_rows

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, all_logits: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Run the step; returns (float32 logits, sample_rows).

        The logits have one row per entry of sample_rows that is not -1, in order; with
        ``all_logits`` (a debugging aid) one row per token of the step instead.
        """
        ids, positions, ctx, sample_rows = self.prepare(out)
        hidden = self.model.forward(ids, positions, ctx)
        if not all_logits:
            rows = [r for r in sample_rows if r >= 0]
            if not rows:
                return hidden.new_empty((0, 0), dtype=torch.float32), sample_rows
            if len(rows) != hidden.shape[0]:
                hidden = hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]
        return self.model.compute_logits(hidden), sample_rows
