"""Which sequences run in the next step, and how many of their tokens.

Policy only: the block manager owns the blocks, the model runner the tensors.
The scheduler owns the queues: ``waiting`` (FIFO; preempted sequences go back to
its front), ``running`` (in admission order) and ``idle`` (interactive sessions
between turns, least recently used first, whose kept blocks are the first thing
given up when blocks run short).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerOutput:
    """All the model runner gets for one step.

    Sequence ``i`` computes ``token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens[i]]``
    (read from the sequence before the step is applied).
    """
    seqs: tuple[Sequence, ...] = ()
    num_scheduled_tokens: tuple[int, ...] = ()
    # sequences that cannot be served at all (dropped from the queues; the engine fails them)
    failed: tuple[tuple[Sequence, str], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class Scheduler:

    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.idle: OrderedDict[int, Sequence] = OrderedDict()  # session_id -> kept session
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """The rule: every sequence has ``num_computed_tokens`` and ``num_tokens``; a step gives each
        the tokens that let it catch up, within ``max_num_batched_tokens`` and ``max_batch_size``.

        Running sequences first, oldest first (a decode needs 1 token, a chunked prefill
        the rest of its prompt); then waiting ones in FIFO order while the budget lasts.
        A sequence meets the prefix cache when it is admitted (not one that skips reading it,
        ``skip_reading_prefix_cache``: its prompt logprobs need every row). When blocks run out,
        idle sessions give theirs up first, then the newest running sequence is
        preempted: its blocks are freed and it goes back to the front of the queue with
        nothing computed, to be recomputed (its generated tokens stay in its context).
        """
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            pending = seq.num_tokens - seq.num_computed_tokens
            n = min(pending + len(seq.draft_token_ids), budget)
            if seq.draft_token_ids:  # a draft rides along with its pending token, cut to the budget
                seq.draft_token_ids = seq.draft_token_ids[:max(0, n - pending)]
            if n <= 0:
                i += 1
                continue
            while not bm.allocate(seq, seq.num_computed_tokens + n):
                if self._release_kept():
                    continue
                victim = self.running.pop()  # newest
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(n)
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: nothing after it is left in running

        failed: list[tuple[Sequence, str]] = []
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if bm.blocks_held(seq.num_tokens, self.max_num_batched_tokens) > bm.num_blocks:
                self.waiting.popleft()
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED
                failed.append((seq, f'its {seq.num_tokens} tokens need more KV blocks than the cache has '
                                    f'({bm.num_blocks} blocks of {bm.block_size})'))
                continue
            prefix: list[int] = []
            # admission from scratch: look in the prefix cache (unless the prompt's own rows are wanted)
            if not seq.block_ids and not seq.skip_reading_prefix_cache:
                prefix, num_hit = bm.match_prefix(seq.token_ids, seq.adapter_uid)
                seq.num_computed_tokens = num_hit
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate(seq, seq.num_computed_tokens + n, prefix):
                if not self._release_kept(but=seq):
                    break
            else:
                self.waiting.popleft()
                if not seq.is_admitted:  # first admission of this turn: what the cache saved it
                    seq.is_admitted = True
                    seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                seqs.append(seq)
                counts.append(n)
                budget -= n
                continue
            if not seq.block_ids:
                seq.num_computed_tokens = 0
            break  # FIFO: the head waits for blocks, nobody overtakes it

        return SchedulerOutput(tuple(seqs), tuple(counts), tuple(failed))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.draft_token_ids = ()
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release_kept(self, but: Sequence | None = None) -> bool:
        """Free the kept blocks of one sequence that is not running; False if none holds any.

        The least recently used idle session goes first, then a resumed session waiting
        behind ``but`` in the queue (newest first); either is recomputed when it runs.
        """
        for seq in self.idle.values():
            if seq.block_ids:
                break
        else:
            seq = next((s for s in reversed(self.waiting) if s.block_ids and s is not but), None)
            if seq is None:
                return False
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        return True

    def update(self, out: SchedulerOutput) -> None:
        """Record that the step of ``out`` ran: its tokens are in the cache."""
        bm = self.block_manager
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            seq.num_computed_tokens += n - len(seq.draft_token_ids)  # drafts count once accepted
            bm.cache_full_blocks(seq)
            bm.release_outside_window(seq)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the first ``num_accepted`` drafted tokens of the step are ``seq``'s, their KV
        computed; the rest's slots are free for what comes next, and blocks past its tokens go back."""
        if not seq.block_ids:  # it ended and let its blocks go
            return
        bm = self.block_manager
        seq.num_computed_tokens += num_accepted
        bm.cache_full_blocks(seq)
        bm.release_outside_window(seq)
        bm.truncate(seq, seq.num_tokens)

    def finish(self, seq: Sequence, keep: bool = False) -> None:
        """Take ``seq`` out of the queues; ``keep``: an interactive session keeps its blocks, idle."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.IDLE:
            self.idle.pop(seq.session_id, None)
        if keep:
            seq.status = SequenceStatus.IDLE
            self.idle[seq.session_id] = seq
        else:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED

    def resume(self, seq: Sequence) -> None:
        """An idle session's next turn joins the queue with whatever of its cache it still holds."""
        self.idle.pop(seq.session_id, None)
        self.add(seq)
