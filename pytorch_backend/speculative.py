"""Speculative decoding in the PyTorch engine: who drafts, and how many tokens.

Each step, before scheduling, every running sequence that is decoding gets a draft from the
proposer (``NgramProposer``: prompt lookup, the kernel library's ``ngram_propose``, the same
function TurboMind's C++ engine calls). The scheduler gives a drafted sequence its pending token
and the draft in one chunk (``Sequence.draft_token_ids``; cut to the step's token budget), the
model runner returns the logits of all of those rows, and the engine verifies them in order
(``PytorchEngine._verify``): row j's token is chosen by the ordinary sampler from the request's
state after the tokens accepted so far and handed on as any generated token; the draft's token j
is accepted when it is that token, and the first token that differs (or the one after the last
draft) ends the step. For greedy requests that is the output without speculation token for token;
for sampled ones it is rejection sampling with a deterministic draft (accept d with probability
p(d), else draw from p without d), so the target distribution is kept. The sequence's computed
tokens then grow by one plus the accepted drafts; the rejected drafts' KV slots are overwritten by
later tokens, and blocks past the sequence's tokens are given back (``Scheduler.accept_drafts``).
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

    def draft_len(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may have drafted this step: none unless it is decoding (one token
        to compute) and generating on its own (not teacher-forced); never past max_new_tokens or the
        session length, whichever the accepted drafts and the token after them would reach first."""
        if seq.num_tokens - seq.num_computed_tokens != 1 or seq.forced_token_ids is not None:
            return 0
        left_new = seq.sampling.max_new_tokens - seq.num_generated_tokens - 1
        left_ctx = self.session_len - seq.num_tokens - 1
        return max(0, min(self.config.num_speculative_tokens, left_new, left_ctx))

    def propose(self, seq: Sequence) -> tuple[int, ...]:
        k = self.draft_len(seq)
        if k <= 0:
            return ()
        c = self.config
        return tuple(self._propose(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k))


def build_proposer(config: SpeculativeConfig | None, session_len: int) -> NgramProposer | None:
    if config is None:
        return None
    if config.method != 'ngram':
        raise ValueError(f"SpeculativeConfig.method={config.method!r} is not supported by the PyTorch engine yet: "
                         "use 'ngram'")
    return NgramProposer(config, session_len)
