"""Speculative decoding in the PyTorch engine: who drafts, and how many tokens.

Each step, before scheduling, every running sequence that is decoding gets a draft from the proposer
(``NgramProposer``: prompt lookup, the kernel library's ``ngram_propose``, the same function
TurboMind's C++ engine calls; ``DraftModelProposer``: a smaller model's greedy continuation). The
scheduler gives a drafted sequence its pending token and the draft in one chunk
(``Sequence.draft_token_ids``; cut to the step's token budget), the model runner returns the logits
of all of those rows, and the engine verifies them in order (``PytorchEngine._verify``): row j's
token is chosen by the ordinary sampler from the request's state after the tokens accepted so far
and handed on as any generated token; the draft's token j is accepted when it is that token, and the
first token that differs (or the one after the last draft) ends the step. For greedy requests that
is the output without speculation token for token; for sampled ones it is rejection sampling with a
deterministic draft (accept d with probability p(d), else draw from p without d), so the target
distribution is kept. The sequence's computed tokens then grow by one plus the accepted drafts; the
rejected drafts' KV slots are overwritten by later tokens, and blocks past the sequence's tokens are
given back (``Scheduler.accept_drafts``).

With ``SpeculativeConfig.adaptive_draft_length`` each draft is cut to the length that pays, by the
kernel library's ``DraftLength`` (the policy TurboMind's C++ engine runs too): the engine reports the
wall time and rows of its decode-only steps (``observe_step``) and each verified draft (``observe``).
"""
from __future__ import annotations

from lmd.messages import SpeculativeConfig

from .sequence import Sequence


class NgramProposer:
    """Drafts by prompt lookup (``SpeculativeConfig.method == 'ngram'``)."""

    def __init__(self, config: SpeculativeConfig, session_len: int):
        from lmd.kernels import ops
        self._propose = ops.ngram_propose
        self.config = config
        self.session_len = session_len
        self._ops = ops
        self.lengths = ops.DraftLength(config.num_speculative_tokens) if config.adaptive_draft_length else None
        self._num_decoding = 1

    def draft(self, running: list[Sequence]) -> None:
        """This step's drafts: each running sequence's ``draft_token_ids`` (empty where it drafts nothing)."""
        self.begin_step(running)
        for seq in running:
            seq.draft_token_ids = self.propose(seq)

    def begin_step(self, running: list[Sequence]) -> None:
        """Before this step's drafts: forget sequences no longer running, count those decoding."""
        self.retain(running)
        self._num_decoding = max(1, sum(s.num_tokens - s.num_computed_tokens == 1 for s in running))

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified draft of ``seq``: ``drafted`` tokens, the first ``accepted`` of them accepted."""
        if self.lengths is not None:
            self._acceptance_of(seq).observe(drafted, accepted)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step (every row a sequence's next token or one of its drafts) and its wall time."""
        if self.lengths is not None:
            self.lengths.observe_step(rows, seconds)

    def _acceptance_of(self, seq: Sequence):
        if seq.draft_acceptance is None:
            seq.draft_acceptance = self._ops.DraftAcceptance()
        return seq.draft_acceptance

    def draft_len(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may have drafted this step: none unless it is decoding (one token
        to compute) and generating on its own (not teacher-forced); never past max_new_tokens or the
        session length, whichever the accepted drafts and the token after them would reach first; with
        adaptive_draft_length, only as many as pay. Called once per step and sequence."""
        if seq.num_tokens - seq.num_computed_tokens != 1 or seq.forced_token_ids is not None:
            return 0
        left_new = seq.sampling.max_new_tokens - seq.num_generated_tokens - 1
        left_ctx = self.session_len - seq.num_tokens - 1
        k = max(0, min(self.config.num_speculative_tokens, left_new, left_ctx))
        if self.lengths is not None:
            acc = self._acceptance_of(seq)
            acc.decay()
            k = self.lengths.length(acc, self._num_decoding, k)
        return k

    def retain(self, running: list[Sequence]) -> None:
        """Forget what the proposer keeps for sequences no longer in ``running`` (nothing, for prompt lookup)."""

    def propose(self, seq: Sequence) -> tuple[int, ...]:
        k = self.draft_len(seq)
        if k <= 0:
            return ()
        c = self.config
        return tuple(self._propose(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k))


class DraftModelProposer(NgramProposer):
    """Drafts with a smaller model that shares the target's tokenizer (``method == 'draft_target'``): the
    draft model's greedy continuation, ``draft_len`` tokens, from a paged KV cache of its own.

    Each sequence has a shadow in the draft cache. Before drafting, the shadow keeps the longest run of its
    computed tokens that the sequence still has (what it drafted and the target rejected goes, with the
    blocks past it), then computes the sequence's new tokens in one chunk and decodes the draft token by
    token. Greedy drafts are deterministic, so verification stays exact for sampled requests too. Shadows
    of sequences that stopped running are freed (``retain``); a draft that finds no free block is skipped.
    """

    def __init__(self, config: SpeculativeConfig, session_len: int, model, num_blocks: int, block_size: int,
                 device):
        super().__init__(config, session_len)
        from .block_manager import BlockManager
        from .model_runner import ModelRunner
        self.runner = ModelRunner(model, num_blocks, block_size, device)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.shadows: dict[int, tuple[Sequence, Sequence]] = {}  # session id -> (sequence, its shadow)

    def retain(self, running: list[Sequence]) -> None:
        alive = {id(s) for s in running}
        for sid, (seq, shadow) in list(self.shadows.items()):
            if id(seq) not in alive:
                self.block_manager.free(shadow)
                del self.shadows[sid]

    def propose(self, seq: Sequence) -> tuple[int, ...]:
        k = self.draft_len(seq)
        if k <= 0:
            return ()
        entry = self.shadows.get(seq.session_id)
        if entry is None or entry[0] is not seq:
            if entry is not None:
                self.block_manager.free(entry[1])
            entry = (seq, Sequence(seq.session_id, [], seq.sampling, None, None))
            self.shadows[seq.session_id] = entry
        shadow = entry[1]
        tokens = seq.token_ids
        keep = 0
        limit = min(shadow.num_computed_tokens, len(tokens))
        while keep < limit and shadow.token_ids[keep] == tokens[keep]:
            keep += 1
        shadow.num_computed_tokens = keep
        shadow.token_ids = list(tokens)
        self.block_manager.truncate(shadow, keep)
        from .scheduler import SchedulerOutput
        draft: list[int] = []
        for _ in range(k):
            n = shadow.num_tokens - shadow.num_computed_tokens
            if not self.block_manager.allocate(shadow, shadow.num_tokens):
                break
            logits, _, _ = self.runner.run(SchedulerOutput((shadow,), (n,)))
            shadow.num_computed_tokens = shadow.num_tokens
            draft.append(int(logits[-1].argmax()))
            shadow.token_ids.append(draft[-1])
        return tuple(draft)


def build_proposer(config: SpeculativeConfig | None, session_len: int, load_draft_model=None, num_blocks: int = 0,
                   block_size: int = 0, device=None) -> NgramProposer | None:
    """The proposer ``config`` asks for; ``load_draft_model(path)`` builds a draft model as the engine
    builds its own (its dtype, device and kernels)."""
    if config is None:
        return None
    if config.method == 'ngram':
        return NgramProposer(config, session_len)
    if config.method == 'draft_target':
        from lmd.model_path import prepare_model_dir
        model = load_draft_model(prepare_model_dir(config.model))
        return DraftModelProposer(config, session_len, model, num_blocks, block_size, device)
    raise ValueError(f'SpeculativeConfig.method={config.method!r} is not supported by the PyTorch engine')
