"""One request's (or one interactive session's) state as the engine thread sees it.

A ``Sequence`` lives on the engine thread only. Its ``token_ids`` are the whole
context: an interactive session's earlier turns (prompts and answers), this
turn's prompt, and the tokens generated so far. The KV cache holds the first
``num_computed_tokens`` of them, in the blocks ``block_ids`` lists in order.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from lmd.engine import EngineOutput, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = 'waiting'    # queued (new, or preempted and to be recomputed)
    RUNNING = 'running'    # scheduled: prefilling in chunks or decoding
    IDLE = 'idle'          # an interactive session between turns: tokens (and maybe blocks) kept
    FINISHED = 'finished'  # done; its blocks are freed


class Sequence:
    __slots__ = ('session_id', 'token_ids', 'num_prompt_tokens', 'num_computed_tokens', 'num_cached_tokens',
                 'block_ids', 'block_hashes', 'status', 'sampling', 'sampling_state', 'callback',
                 'loop', 'sequence_end', 'is_admitted', 'num_preemptions', 'logits_sink', 'forced_token_ids',
                 'prompt_logprobs', 'skip_reading_prefix_cache', 'draft_token_ids', 'draft_acceptance', 'adapter_slot',
                 'adapter_uid')

    def __init__(self, session_id: int, token_ids: list[int], sampling: 'SamplingParams',
                 sampling_state, callback: Callable[['EngineOutput'], None] | None, sequence_end: bool = True):
        self.session_id = session_id
        self.token_ids: list[int] = list(token_ids)
        # tokens of the context before this turn's generation (earlier turns included)
        self.num_prompt_tokens = len(self.token_ids)
        # tokens whose K/V are in the cache
        self.num_computed_tokens = 0
        # of the prompt tokens, how many this turn found in the cache (prefix hit or kept session)
        self.num_cached_tokens = 0
        # the KV blocks holding this sequence's tokens, in order; block i holds tokens [i*bs, (i+1)*bs)
        self.block_ids: list[int] = []
        # hash chain of the leading full blocks (the block manager's prefix-cache keys)
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.sampling = sampling
        self.sampling_state = sampling_state
        self.callback = callback
        self.loop = None  # the event loop the callback runs on (None: the engine thread)
        self.sequence_end = sequence_end
        # set by the scheduler when this turn is first admitted (num_cached_tokens is measured then)
        self.is_admitted = False
        self.num_preemptions = 0
        # with SamplingParams.prompt_logprobs: the entries read so far, [None, {token 1: lp, ...}, ...]; entry
        # p + 1 comes from the logits of position p, so the next position to read is len - 1
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        # the scheduler does not match this sequence against the prefix cache (its prompt rows are wanted)
        self.skip_reading_prefix_cache = False
        # speculative decoding: this step's drafted tokens, computed after the pending one (speculative.py)
        self.draft_token_ids: tuple[int, ...] = ()
        self.draft_acceptance = None  # its recent drafts (ops.DraftAcceptance), with an adaptive draft length
        # a LoRA adapter (lmd.lora.AdapterSlot): the model's slot its rows run, and the uid that salts its
        # prefix-cache keys; -1 / 0: the base model
        self.adapter_slot = -1
        self.adapter_uid = 0
        # test hooks (teacher forcing): logits rows land in logits_sink, the next token comes from forced_token_ids
        self.logits_sink: list | None = None
        self.forced_token_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def start_turn(self, new_token_ids, sampling: 'SamplingParams', sampling_state, callback, sequence_end: bool):
        """Begin an interactive session's next turn: its prompt follows the kept history."""
        self.token_ids.extend(new_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.is_admitted = False
        self.status = SequenceStatus.WAITING
        self.sampling = sampling
        self.sampling_state = sampling_state
        self.callback = callback
        self.sequence_end = sequence_end

    def __repr__(self):
        return (f'Sequence(session_id={self.session_id}, status={self.status.value}, tokens={self.num_tokens}, '
                f'prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})')
