"""Runs one scheduled step through the model; owns the model and the KV cache tensors.

Device code stays here: the scheduler and block manager hand over block ids and
token counts, and this file turns them into tensors once per step.
"""
from __future__ import annotations

import torch

from .context import StepContext
from .scheduler import SchedulerOutput


class ModelRunner:

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, quant_policy: int = 0):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.quant_policy = quant_policy
        # per layer (k_cache, v_cache[, k_params, v_params]): CausalLM.allocate_kv_cache
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, quant_policy)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, StepContext, list[int]]:
        """Flatten the step into input_ids[T], positions[T] and a StepContext.

        Also returns the rows whose logits are needed: each sequence's last row when
        the step brings it up to date (``-1`` for a sequence that is still prefilling).
        Python lists are built first and become tensors in two calls.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        cu = [0]
        num_rows = 0
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            start = seq.num_computed_tokens
            end = start + n
            block_ids = seq.block_ids
            if n == 1:  # decode
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(block_ids[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                pos = start
                while pos < end:  # one run of slots per block touched
                    i = pos // bs
                    run_end = min(end, (i + 1) * bs)
                    base = (block_ids[i] - i) * bs
                    slots.extend(range(base + pos, base + run_end))
                    pos = run_end
            num_rows += n
            query_lens.append(n)
            context_lens.append(end)
            cu.append(num_rows)
            sample_rows.append(num_rows - 1 if end == seq.num_tokens else -1)
        batch = len(query_lens)
        max_blocks = (max(context_lens) + bs - 1) // bs
        table: list[int] = []
        for seq, end in zip(out.seqs, context_lens):
            row = seq.block_ids[:max_blocks]
            table.extend(row)
            if len(row) < max_blocks:
                table.extend([0] * (max_blocks - len(row)))

        dev = self.device
        # one int64 buffer: input_ids[T] | positions[T] | slot_mapping[T]
        longs = torch.tensor(input_ids + positions + slots, dtype=torch.int64)
        # one int32 buffer: query_lens[B] | cu_query_lens[B+1] | context_lens[B] | block_tables[B*M]
        ints = torch.tensor(query_lens + cu + context_lens + table, dtype=torch.int32)
        if dev.type != 'cpu':
            longs = longs.pin_memory().to(dev, non_blocking=True)
            ints = ints.pin_memory().to(dev, non_blocking=True)
        T = num_rows
        ctx = StepContext(
            kv_caches=self.kv_caches,
            block_size=bs,
            slot_mapping=longs[2 * T:],
            query_lens=ints[:batch],
            cu_query_lens=ints[batch:2 * batch + 1],
            context_lens=ints[2 * batch + 1:3 * batch + 1],
            block_tables=ints[3 * batch + 1:].view(batch, max_blocks),
            is_decode=T == batch,
            query_lens_list=query_lens,
            context_lens_list=context_lens,
            quant_policy=self.quant_policy,
        )
        return longs[:T], longs[T:2 * T], ctx, sample_rows

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

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [n, vocab] of one sequence teacher-forced in one forward pass, over a KV cache
        of its own (the serving cache's blocks are left alone), freed after (``PytorchEngine.get_logits``)."""
        n, bs, dev = len(token_ids), self.block_size, self.device
        num_blocks = -(-n // bs)
        # one sequence in blocks 0, 1, ... in order: token t sits in slot t
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        ctx = StepContext(kv_caches=self.model.allocate_kv_cache(num_blocks, bs, self.quant_policy), block_size=bs,
                          slot_mapping=torch.arange(n, device=dev), query_lens=lens,
                          cu_query_lens=torch.tensor([0, n], dtype=torch.int32, device=dev), context_lens=lens,
                          block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
                          is_decode=n == 1, query_lens_list=[n], context_lens_list=[n],
                          quant_policy=self.quant_policy)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        return self.model.compute_logits(self.model.forward(ids, torch.arange(n, device=dev), ctx))
