"""Pipeline parallelism: the decoder's layers split into ``pp`` stages, micro-batches of a step in flight.

An engine with ``tp`` x ``pp`` ranks numbers them stage by stage: rank g is tensor-parallel rank g % tp of
stage g // tp, so the driver (rank 0) is the first stage's first rank. Every rank gets the step the
driver broadcasts (``distributed.RankGroup.send``) and cuts it into the same micro-batches, runs of whole
sequences of about equal rows (``micro_batches``; a step of few rows, as decode is, stays whole). A stage
runs its layers on micro-batch m, hands the residual stream on to the same tensor-parallel rank of the
next stage (``torch.stack((residual, delta))``: the exact state a one-rank forward carries across that
layer boundary) without waiting for it to be received, and goes on with micro-batch m + 1 while the next
stage works on m: with M micro-batches a step takes about (M + pp - 1) micro-batch stage times instead
of pp whole-batch ones. The last stage turns each micro-batch's rows into logits (gathered over its
tensor-parallel ranks) and its first rank sends them, with any prompt logprobs, back to the driver,
which samples as with one rank. Steps do not overlap each other: the driver schedules the next one
once it has sampled this one (vLLM's pp schedulers, each with its own batch in flight, would).

Each stage holds its layers' weights and KV cache only; the first holds the embedding, the last the
final norm and lm_head (``CausalLM`` built with ``layers``). ``stage_layers`` balances the stages by
their matmul weights, counting lm_head (every decoded token's logits) to the last.
"""
from __future__ import annotations

import bisect
import dataclasses
import pickle
import time

import torch
import torch.distributed as dist

from lmd.model_config import ModelConfig

from .model_runner import StepPlan

# micro-batches per stage in a step (of rows enough): more overlap the stages better, fewer keep each
# micro-batch's matmuls larger (on 2 CPU cores, 256-512-token prompts: 1 and 2 within noise, both ahead of
# no micro-batches: 639 / 629 / 605 tokens/s)
MICRO_BATCHES_PER_STAGE = 1
# the fewest rows a micro-batch gets: below them a stage's matmuls read their weights in about the same
# time whatever the rows (decode on a CPU is memory-bound), so cutting the step up would read them once
# more per micro-batch for nothing (decode of 8 sequences, pp=2: 104 output tokens/s as one micro-batch,
# 48 as four)
MIN_MICRO_BATCH_ROWS = 64


def stage_layers(config: ModelConfig, pp: int) -> list[range]:
    """The decoder layers of each of ``pp`` stages: contiguous runs, at least one layer each, whose largest
    cost is smallest, a layer costing its matmul weights and the last stage lm_head's besides."""
    n = config.num_layers
    if not 1 <= pp <= n:
        raise ValueError(f'pp={pp} stages need 1 <= pp <= the {n} decoder layers')
    H, D = config.hidden_size, config.head_dim
    layer = H * D * (2 * config.num_heads + 2 * config.num_kv_heads) + 3 * H * config.intermediate_size
    head = config.vocab_size * H
    # best[s][i]: the smallest largest cost of the first i layers in s stages (the last stage costs head more)
    inf = float('inf')
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for s in range(1, pp + 1):
        for i in range(s, n - (pp - s) + 1):
            extra = head if s == pp else 0
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], (i - j) * layer + extra)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds = [n]
    for s in range(pp, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def micro_batches(plan: StepPlan, count: int) -> list[tuple[StepPlan, int]]:
    """``plan`` cut into at most ``count`` runs of whole sequences of about equal rows: (the run's plan, the
    index of its first sequence in ``plan``). Rows and logit rows keep their order, so the runs' logits
    one after another are ``plan``'s."""
    B, cu = len(plan.query_lens), plan.cu_query_lens
    count = max(1, min(count, B))
    bounds = [0]
    for k in range(1, count):
        b = bisect.bisect_left(cu, cu[-1] * k / count)
        bounds.append(min(max(b, bounds[-1] + 1), B - (count - k)))
    bounds.append(B)
    if count == 1:
        return [(plan, 0)]
    M = plan.max_blocks
    runs = []
    for a, b in zip(bounds, bounds[1:]):
        ra, rb = cu[a], cu[b]
        runs.append((dataclasses.replace(
            plan,
            input_ids=plan.input_ids[ra:rb], positions=plan.positions[ra:rb], slots=plan.slots[ra:rb],
            query_lens=plan.query_lens[a:b], cu_query_lens=[c - ra for c in cu[a:b + 1]],
            context_lens=plan.context_lens[a:b], block_table=plan.block_table[a * M:b * M],
            row_slots=None if plan.row_slots is None else plan.row_slots[ra:rb],
            logit_rows=None if plan.logit_rows is None else [r - ra for r in plan.logit_rows if ra <= r < rb],
            prompt_jobs=[(i - a, x - ra, y - ra, t, k) for i, x, y, t, k in plan.prompt_jobs if a <= i < b],
        ), a))
    return runs


class PipelineStage:
    """One rank's place in the pipeline: its stage, its neighbours, and the transfers between them."""

    def __init__(self, group: dist.ProcessGroup, rank: int, tp: int, pp: int, config: ModelConfig):
        self.group = group  # every rank of the engine
        self.rank = rank
        self.stage, self.tp_rank = divmod(rank, tp)
        self.pp = pp
        self.prev = rank - tp if self.stage > 0 else None
        self.next = rank + tp if self.stage < pp - 1 else None
        self.result_rank = (pp - 1) * tp  # the last stage's first rank: it sends the driver the results
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.seconds = 0.0  # blocked in sends and receives, waiting for the stage before included
        self._sending: list[tuple[object, torch.Tensor]] = []  # (work, the tensor it sends) until flushed

    # -- a step ---------------------------------------------------------------------------------------------

    def execute(self, runner, plan: StepPlan, num_seqs: int):
        """``ModelRunner.execute`` over the stages: the driver's result (logits, prompt logprobs); None on
        the other ranks."""
        count = min(MICRO_BATCHES_PER_STAGE * self.pp, len(plan.input_ids) // MIN_MICRO_BATCH_ROWS)
        runs = micro_batches(plan, count)
        for run, _ in runs:
            ids, positions, ctx = runner.tensors(run)
            hidden = self.run_layers(runner.model, ids, positions, ctx)
            if hidden is not None:  # the last stage
                sends = self.tp_rank == 0
                logits, prompt_lps = runner.finish(run, hidden, len(run.query_lens) if sends else 0)
                if sends and logits.numel():
                    self._send(logits.contiguous(), 0)
                if sends and run.prompt_jobs:
                    self._send_object(prompt_lps, 0)
        self.flush()
        if self.rank != 0:
            return None
        parts, prompt_lps = [], [None] * num_seqs
        for run, first in runs:
            rows = len(run.input_ids) if run.logit_rows is None else len(run.logit_rows)
            if rows:
                parts.append(self._recv(torch.empty(rows, self.vocab_size), self.result_rank))
            if run.prompt_jobs:
                for i, lps in enumerate(self._recv_object(self.result_rank)):
                    prompt_lps[first + i] = lps
        logits = torch.cat(parts) if parts else torch.empty(0, 0)
        return logits, prompt_lps

    def run_layers(self, model, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor | None:
        """This stage's layers on one micro-batch: from the previous stage's hand-over (or the tokens), on to
        the next stage; the normed hidden states on the last stage, else None."""
        handed = None
        if self.prev is not None:
            handed = self._recv(torch.empty(2, ids.shape[0], self.hidden_size, dtype=model.dtype), self.prev)
        out = model.forward(ids, positions, ctx, handed)
        if self.next is None:
            return out
        self._send(out, self.next)
        return None

    def to_driver(self, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The last stage's result ``t`` (of ``shape`` and ``dtype``) on the driver; None on the other ranks."""
        if self.rank == self.result_rank:
            self._send(t.contiguous(), 0)
        self.flush()
        return self._recv(torch.empty(shape, dtype=dtype), self.result_rank) if self.rank == 0 else None

    # -- transfers ------------------------------------------------------------------------------------------

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self._sending.append((self.group.send([t], dst, 0), t))

    def _recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        start = time.perf_counter()
        self.group.recv([t], src, 0).wait()
        self.seconds += time.perf_counter() - start
        return t

    def _send_object(self, obj, dst: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self._send(torch.tensor([data.numel()], dtype=torch.int64), dst)
        self._send(data, dst)

    def _recv_object(self, src: int):
        size = self._recv(torch.zeros(1, dtype=torch.int64), src)
        return pickle.loads(self._recv(torch.empty(int(size), dtype=torch.uint8), src).numpy().tobytes())

    def flush(self) -> None:
        """Wait until everything this rank sent has gone."""
        start = time.perf_counter()
        try:
            for work, _ in self._sending:
                work.wait()
        finally:
            self._sending.clear()
            self.seconds += time.perf_counter() - start
