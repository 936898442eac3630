"""Runs one scheduled step through the model; owns the model and the KV cache tensors.

Device code stays here: the scheduler and block manager hand over block ids and
token counts, and this file turns them into tensors once per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .context import StepContext
from .lora import ModelLora
from .sampler import token_logprobs
from .scheduler import SchedulerOutput

# prompt rows turned into logits at once: bounds the [rows, vocab] float32 block a long prefill makes
PROMPT_LOGITS_ROWS = 256


@dataclass
class StepPlan:
    """One step as plain lists (``ModelRunner.plan``): what every tensor-parallel rank needs to run it,
    sent to the other ranks as it is (``distributed.RankGroup.send``); each builds its tensors itself."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    cu_query_lens: list[int]
    context_lens: list[int]
    block_table: list[int]    # [B * max_blocks], row-major
    max_blocks: int
    row_slots: list[int] | None  # each row's LoRA slot, once a sequence of the step runs one
    logit_rows: list[int] | None  # the rows turned into logits; None: every row
    # prompt logprobs: (sequence index, first row, end row, the tokens those rows score, top-k)
    prompt_jobs: list[tuple[int, int, int, list[int], int]]


class ModelRunner:

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, quant_policy: int = 0,
                 ranks=None, stage=None, world=None):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.quant_policy = quant_policy
        # per layer (k_cache, v_cache[, k_params, v_params]): CausalLM.allocate_kv_cache
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, quant_policy)
        self.lora = ModelLora(model.num_layers, model.dtype, device)  # LoRA adapters by slot (lora.py)
        # tensor parallelism, on rank 0: the other ranks, each running every call here on its shard
        # (distributed.RankGroup); None: this process runs the whole model
        self.ranks = ranks
        # pipeline parallelism: this rank's stage (pipeline_parallel.PipelineStage); None: all the layers
        self.stage = stage
        self.world = world  # the process group of every rank (on every rank); None: one rank
        self.num_steps = 0  # execute() calls: steps run

    def plan(self, out: SchedulerOutput, all_logits: bool = False) -> tuple[StepPlan, list[int]]:
        """The step's rows flattened (input ids, positions, KV slots, per-sequence lengths, block tables),
        and the rows whose logits are needed: each sequence's last row when the step brings it up to date
        (``-1`` in the returned sample_rows for a sequence still prefilling), after the rows of its
        draft's tokens when it has one."""
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
        max_blocks = (max(context_lens) + bs - 1) // bs
        table: list[int] = []
        for seq, end in zip(out.seqs, context_lens):
            row = seq.block_ids[:max_blocks]
            table.extend(row)
            if len(row) < max_blocks:
                table.extend([0] * (max_blocks - len(row)))
        logit_rows = None
        if not all_logits:
            logit_rows = []
            for seq, r in zip(out.seqs, sample_rows):
                if r >= 0:
                    logit_rows.extend(range(r - len(seq.draft_token_ids), r + 1))
        plan = StepPlan(input_ids, positions, slots, query_lens, cu, context_lens, table, max_blocks, row_slots,
                        logit_rows, self.prompt_jobs(out))
        return plan, sample_rows

    def tensors(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        """input_ids[T], positions[T] and the StepContext of ``plan``, from two host buffers."""
        dev = self.device
        T, batch = len(plan.input_ids), len(plan.query_lens)
        # one int64 buffer: input_ids[T] | positions[T] | slot_mapping[T]
        longs = torch.tensor(plan.input_ids + plan.positions + plan.slots, dtype=torch.int64)
        # one int32 buffer: query_lens[B] | cu_query_lens[B+1] | context_lens[B] | block_tables[B*M]
        ints = torch.tensor(plan.query_lens + plan.cu_query_lens + plan.context_lens + plan.block_table,
                            dtype=torch.int32)
        if dev.type != 'cpu':
            longs = longs.pin_memory().to(dev, non_blocking=True)
            ints = ints.pin_memory().to(dev, non_blocking=True)
        ctx = StepContext(
            kv_caches=self.kv_caches,
            block_size=self.block_size,
            slot_mapping=longs[2 * T:],
            query_lens=ints[:batch],
            cu_query_lens=ints[batch:2 * batch + 1],
            context_lens=ints[2 * batch + 1:3 * batch + 1],
            block_tables=ints[3 * batch + 1:].view(batch, plan.max_blocks),
            is_decode=T == batch,
            query_lens_list=plan.query_lens,
            context_lens_list=plan.context_lens,
            quant_policy=self.quant_policy,
            lora=self.lora.step(plan.row_slots) if plan.row_slots is not None else None,
        )
        return longs[:T], longs[T:2 * T], ctx

    @torch.inference_mode()
    def run(self, out: SchedulerOutput,
            all_logits: bool = False) -> tuple[torch.Tensor, list[int], list[list[dict[int, float]] | None]]:
        """Run the step; returns (float32 logits, sample_rows, prompt_logprobs).

        The logits have one row per entry of sample_rows that is not -1, in order, and before it one
        more per drafted token of that sequence (the rows of its pending token and its draft, in
        order); with ``all_logits`` (a debugging aid) one row per token of the step instead.
        ``prompt_logprobs``: per sequence of the step, None or the new entries of its
        ``Sequence.prompt_logprobs`` (``prompt_jobs`` below).
        """
        plan, sample_rows = self.plan(out, all_logits)
        logits, prompt_lps = self.on_all_ranks('execute', plan, driver_args=(len(out.seqs),))
        return logits, sample_rows, prompt_lps

    def on_all_ranks(self, method: str, *args, driver_args: tuple = ()):
        """``method(*args, *driver_args)`` here, after sending ``method(*args)`` to the other ranks (with
        tensor parallelism: each runs it on its shard, the model's collectives meeting); a collective
        broken by a rank's end raises ``RankFailure``."""
        if self.ranks is None:
            return getattr(self, method)(*args, *driver_args)
        self.ranks.send((method, *args))
        try:
            return getattr(self, method)(*args, *driver_args)
        except RuntimeError as e:
            raise self.ranks.failure(e) from e

    def execute(self, plan: StepPlan, num_seqs: int = 0):
        """The forward pass of ``plan`` (on every rank): (float32 logits of ``plan.logit_rows``, prompt
        logprobs per sequence: None, or the entries its ``prompt_jobs`` give)."""
        self.num_steps += 1
        if self.stage is not None:
            return self.stage.execute(self, plan, num_seqs)
        ids, positions, ctx = self.tensors(plan)
        return self.finish(plan, self.model.forward(ids, positions, ctx), num_seqs)

    def finish(self, plan: StepPlan, hidden: torch.Tensor, num_seqs: int):
        """``execute``'s result from the step's normed hidden states: the logits of ``plan.logit_rows`` and,
        when ``num_seqs`` (the rank that returns them), the prompt logprobs."""
        prompt_lps: list[list[dict[int, float]] | None] = [None] * num_seqs
        for i, a, b, targets, k in plan.prompt_jobs:
            logits = self.model.compute_logits(hidden[a:b])  # on every rank: the vocabulary is gathered
            if num_seqs:
                prompt_lps[i] = (prompt_lps[i] or []) + token_logprobs(logits, targets, k)
        rows = plan.logit_rows
        if rows is not None:
            if not rows:
                return hidden.new_empty((0, 0), dtype=torch.float32), prompt_lps
            if len(rows) != hidden.shape[0]:
                hidden = hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]
        return self.model.compute_logits(hidden), prompt_lps

    def parallel_stats(self) -> list[dict]:
        """Per rank, in rank order: steps run, seconds in tensor-parallel collectives and seconds blocked in
        pipeline sends and receives (waiting for slower ranks and earlier stages included) so far."""
        return self.on_all_ranks('gather_stats')

    def gather_stats(self) -> list[dict]:
        tp, stage = self.model.tp, self.stage
        own = torch.tensor([self.num_steps, tp.seconds if tp else 0.0, stage.seconds if stage else 0.0],
                           dtype=torch.float64)
        rows = [own]
        if self.world is not None:
            rows = [torch.empty_like(own) for _ in range(self.world.size())]
            self.world.allgather([rows], [own]).wait()
        return [dict(steps=int(r[0]), all_reduce_s=float(r[1]), send_recv_s=float(r[2])) for r in rows]

    def prompt_jobs(self, out: SchedulerOutput) -> list[tuple[int, int, int, list[int], int]]:
        """The prompt logprobs this step's rows give, as jobs of at most PROMPT_LOGITS_ROWS rows: for each
        sequence that asks and has rows it has not read (a recompute after preemption skips those it
        has), position p's row scores prompt token p + 1 (``sampler.token_logprobs``); the prompt's last
        row is the sampled one, not read here. Rows are those of ``plan``'s order."""
        jobs = []
        row0 = 0
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            start = seq.num_computed_tokens
            if seq.prompt_logprobs is not None:
                first = len(seq.prompt_logprobs) - 1  # the next position to read
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last and first < start:
                    raise AssertionError(f'session {seq.session_id}: prompt rows {first}..{start} were never '
                                         'computed (a prefix hit on a sequence that wants prompt logprobs?)')
                for a in range(first, last, PROMPT_LOGITS_ROWS):
                    b = min(a + PROMPT_LOGITS_ROWS, last)
                    jobs.append((i, row0 + a - start, row0 + b - start, seq.token_ids[a + 1:b + 1],
                                 seq.sampling.prompt_logprobs))
            row0 += n
        return jobs

    @torch.inference_mode()
    def score(self, token_ids: list[int], adapter_slot: int = -1) -> torch.Tensor:
        """float32 logits [n, vocab] of one sequence teacher-forced in one forward pass, over a KV cache
        of its own (the serving cache's blocks are left alone), freed after (``PytorchEngine.get_logits``)."""
        return self.on_all_ranks('forward_logits', token_ids, adapter_slot)

    def forward_logits(self, token_ids: list[int], adapter_slot: int) -> torch.Tensor:
        hidden = self.forward_alone(token_ids, adapter_slot)
        if self.stage is None:
            return self.model.compute_logits(hidden)
        logits = None if hidden is None else self.model.compute_logits(hidden)
        return self.stage.to_driver(logits, (len(token_ids), self.stage.vocab_size), torch.float32)

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int], adapter_slot: int = -1) -> torch.Tensor:
        """float32 [n, hidden]: the final norm's output of one sequence, run as ``score`` runs it
        (``PytorchEngine.get_hidden_states``)."""
        return self.on_all_ranks('forward_hidden', token_ids, adapter_slot).float()

    def forward_hidden(self, token_ids: list[int], adapter_slot: int) -> torch.Tensor:
        hidden = self.forward_alone(token_ids, adapter_slot)
        if self.stage is None:
            return hidden
        return self.stage.to_driver(hidden, (len(token_ids), self.stage.hidden_size), self.model.dtype)

    def forward_alone(self, token_ids: list[int], adapter_slot: int = -1) -> torch.Tensor | None:
        """The model's hidden states [n, hidden] (after the final norm, the model dtype) of one sequence
        in one forward pass over a KV cache of its own, freed after; ``adapter_slot``: its LoRA adapter.
        A pipeline stage runs its layers: None but on the last stage."""
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
        if self.stage is not None:
            return self.stage.run_layers(self.model, ids, torch.arange(n, device=dev), ctx)
        return self.model.forward(ids, torch.arange(n, device=dev), ctx)
