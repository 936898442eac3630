"""Runs one scheduled step through the model; owns the model and the KV cache tensors.

Device code stays here: the scheduler and block manager hand over block ids and
token counts, and this file turns them into tensors once per step.
"""
from __future__ import annotations

import torch

from .context import StepContext
from .lora import ModelLora
from .sampler import token_logprobs
from .scheduler import SchedulerOutput

# prompt rows turned into logits at once: bounds the [rows, vocab] float32 block a long prefill makes
PROMPT_LOGITS_ROWS = 256


class ModelRunner:

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, quant_policy: int = 0):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.quant_policy = quant_policy
        # per layer (k_cache, v_cache[, k_params, v_params]): CausalLM.allocate_kv_cache
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, quant_policy)
        self.lora = ModelLora(model.num_layers, model.dtype, device)  # LoRA adapters by slot (lora.py)

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
        row_slots: list[int] | None = None  # each row's LoRA slot, once a sequence runs one
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            if seq.adapter_slot >= 0 and row_slots is None:
                row_slots = [-1] * num_rows
            if row_slots is not None:
                row_slots.extend([seq.adapter_slot] * n)
            start = seq.num_computed_tokens
            end = start + n
            block_ids = seq.block_ids
            if n == 1:  # decode
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(block_ids[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                input_ids.extend(seq.draft_token_ids)  # a drafted step: its pending token, then the draft
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
            sample_rows.append(num_rows - 1 if end == seq.num_tokens + len(seq.draft_token_ids) else -1)
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
            lora=self.lora.step(row_slots) if row_slots is not None else None,
        )
        return longs[:T], longs[T:2 * T], ctx, sample_rows

    @torch.inference_mode()
    def run(self, out: SchedulerOutput,
            all_logits: bool = False) -> tuple[torch.Tensor, list[int], list[list[dict[int, float]] | None]]:
        """Run the step; returns (float32 logits, sample_rows, prompt_logprobs).

        The logits have one row per entry of sample_rows that is not -1, in order, and before it one
        more per drafted token of that sequence (the rows of its pending token and its draft, in
        order); with ``all_logits`` (a debugging aid) one row per token of the step instead.
        ``prompt_logprobs``: per sequence of the step, None or the new entries of its
        ``Sequence.prompt_logprobs`` (``prompt_logprobs`` below).
        """
        ids, positions, ctx, sample_rows = self.prepare(out)
        hidden = self.model.forward(ids, positions, ctx)
        prompt_lps = self.prompt_logprobs(out, hidden)
        if not all_logits:
            rows = []
            for seq, r in zip(out.seqs, sample_rows):
                if r >= 0:
                    rows.extend(range(r - len(seq.draft_token_ids), r + 1))
            if not rows:
                return hidden.new_empty((0, 0), dtype=torch.float32), sample_rows, prompt_lps
            if len(rows) != hidden.shape[0]:
                hidden = hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]
        return self.model.compute_logits(hidden), sample_rows, prompt_lps

    def prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> list[list[dict[int, float]] | None]:
        """The prompt logprobs this step's rows give: for each sequence that asks and has rows it has
        not read (a recompute after preemption skips those it has), position p's row scores prompt
        token p + 1 (``sampler.token_logprobs``); the prompt's last row is the sampled one, not read here.
        hidden: [T, H], the step's rows in the order of ``prepare``."""
        result: list[list[dict[int, float]] | None] = []
        row0 = 0
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            entries = None
            start = seq.num_computed_tokens
            if seq.prompt_logprobs is not None:
                first = len(seq.prompt_logprobs) - 1  # the next position to read
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    if first < start:
                        raise AssertionError(f'session {seq.session_id}: prompt rows {first}..{start} were never '
                                             'computed (a prefix hit on a sequence that wants prompt logprobs?)')
                    k = seq.sampling.prompt_logprobs
                    entries = []
                    for a in range(first, last, PROMPT_LOGITS_ROWS):
                        b = min(a + PROMPT_LOGITS_ROWS, last)
                        logits = self.model.compute_logits(hidden[row0 + a - start:row0 + b - start])
                        entries += token_logprobs(logits, seq.token_ids[a + 1:b + 1], k)
            result.append(entries)
            row0 += n
        return result

    @torch.inference_mode()
    def score(self, token_ids: list[int], adapter_slot: int = -1) -> torch.Tensor:
        """float32 logits [n, vocab] of one sequence teacher-forced in one forward pass, over a KV cache
        of its own (the serving cache's blocks are left alone), freed after (``PytorchEngine.get_logits``)."""
        return self.model.compute_logits(self.forward_alone(token_ids, adapter_slot))

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int], adapter_slot: int = -1) -> torch.Tensor:
        """float32 [n, hidden]: the final norm's output of one sequence, run as ``score`` runs it
        (``PytorchEngine.get_hidden_states``)."""
        return self.forward_alone(token_ids, adapter_slot).float()

    def forward_alone(self, token_ids: list[int], adapter_slot: int = -1) -> torch.Tensor:
        """The model's hidden states [n, hidden] (after the final norm, the model dtype) of one sequence
        in one forward pass over a KV cache of its own, freed after; ``adapter_slot``: its LoRA adapter."""
        n, bs, dev = len(token_ids), self.block_size, self.device
        num_blocks = -(-n // bs)
        # one sequence in blocks 0, 1, ... in order: token t sits in slot t
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        ctx = StepContext(kv_caches=self.model.allocate_kv_cache(num_blocks, bs, self.quant_policy), block_size=bs,
                          slot_mapping=torch.arange(n, device=dev), query_lens=lens,
                          cu_query_lens=torch.tensor([0, n], dtype=torch.int32, device=dev), context_lens=lens,
                          block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
                          is_decode=n == 1, query_lens_list=[n], context_lens_list=[n],
                          quant_policy=self.quant_policy,
                          lora=self.lora.step([adapter_slot] * n) if adapter_slot >= 0 else None)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        return self.model.forward(ids, torch.arange(n, device=dev), ctx)
