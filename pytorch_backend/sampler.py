"""The sampler: one step's logits in, one token (and optional logprobs) per request out.

Processing order, as HF ``generate`` applies it:

    repetition_penalty (prompt + generated ids)  ->  presence / frequency penalty
    (generated ids, OpenAI semantics)  ->  bad_token_ids to -inf  ->  stop_token_ids
    to -inf while num_generated < min_new_tokens (not under a constraint)  ->  a structured-output
    constraint's disallowed tokens to -inf  ->  greedy: argmax
    ->  else temperature -> top_k -> top_p -> min_p -> draw

Logprobs are ``log_softmax`` of the raw logits, before any of the above (vLLM's default), so a
constrained row's logprobs say what the model wanted, not what the grammar allowed.

Structured output: a state may carry a ``constraint`` (``lmd.guided.TokenConstraint``). The
sampler asks it for this step's bitmask and masks the row; the engine calls ``accept`` with the
token it keeps. The constraint lives in the state, so it survives preemption.

Reproducibility: a seeded request owns a ``torch.Generator`` that only advances
when that request draws. Every sampled row takes exactly one uniform ``u`` per step
(a seeded row from its own generator, the others from one shared generator per
device) and picks the token where ``u`` falls in the cumulative distribution of its
filtered probabilities. That depends only on the row's logits, params and generator,
so a seeded request samples the same tokens whatever else is in the batch, in
whatever row order, and across preemption-by-recompute (its state survives). (An
exponential race over the vocabulary would need V random numbers per row per step;
on CPU those cost more than the whole rest of a step.)

Speed: a batch that needs no penalty, mask or logprobs and is all greedy is one
``argmax`` over ``[B, V]`` with no copy. Penalties and masks of all rows are one
gather/scatter over flat indices; top_k rows work on ``topk`` candidates, top_p /
min_p rows on a ``topk`` prefix, and only rows whose kept set may pass the prefix
are fully sorted. Per-row Python work is building index tensors (cached on each
state) and one ``torch.rand(1)`` per seeded row.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.dlpack import to_dlpack

from lmd.engine import SamplingParams
from lmd.kernels import ops

_NEG_INF = float('-inf')

# device -> generator shared by every row that has no random_seed
_shared_generators: dict[torch.device, torch.Generator] = {}


def _shared_generator(device: torch.device) -> torch.Generator:
    g = _shared_generators.get(device)
    if g is None:
        g = torch.Generator(device=device)
        g.seed()
        _shared_generators[device] = g
    return g


def is_greedy(params: SamplingParams) -> bool:
    """Sampling reduces to argmax (ties: lowest id)."""
    return params.greedy or params.temperature == 0.0 or params.top_k == 1


class SamplingState:
    """Per-request mutable sampling state; lives as long as the request (preemption included)."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], constraint=None):
        self.params = params
        self.constraint = constraint  # lmd.guided.TokenConstraint or None
        self.greedy = is_greedy(params)
        self.num_generated = 0
        # token id -> times generated (presence / frequency penalties)
        self.output_counts: dict[int, int] = {}
        # ids of prompt + generated, each once, in first-seen order (repetition penalty)
        self._seen: set[int] = set()
        self._seen_ids: list[int] = []
        for t in prompt_token_ids:
            if t not in self._seen:
                self._seen.add(t)
                self._seen_ids.append(t)
        self.has_repetition_penalty = params.repetition_penalty != 1.0
        self.has_output_penalty = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._generator: torch.Generator | None = None
        # tensors built on first use, per device
        self._seen_tensor: torch.Tensor | None = None
        # (min, max) of the seen ids
        self._seen_range = (min(self._seen_ids, default=0), max(self._seen_ids, default=0))
        self._masks: dict[tuple[str, torch.device, int], torch.Tensor] = {}

    def append(self, token_id: int) -> None:
        """Record a token this request generated."""
        self.num_generated += 1
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        if token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_ids.append(token_id)
            lo, hi = self._seen_range
            self._seen_range = (min(lo, token_id), max(hi, token_id))

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator this request draws from: its own when seeded, else the shared one."""
        if self.params.random_seed is None:
            return _shared_generator(device)
        g = self._generator
        if g is None or g.device != device:
            # a new device restarts the stream; engines keep one device for a request's life
            g = torch.Generator(device=device)
            g.manual_seed(self.params.random_seed)
            self._generator = g
        return g

    @property
    def has_seed(self) -> bool:
        return self.params.random_seed is not None

    def needs_processing(self) -> bool:
        """Whether any penalty or mask touches this row's logits this step."""
        p = self.params
        return (self.has_repetition_penalty or self.has_output_penalty or bool(p.bad_token_ids)
                or self.blocks_stop_tokens() or self.constraint is not None)

    def blocks_stop_tokens(self) -> bool:
        """Stop ids are masked until min_new_tokens, unless a grammar decides where the text ends."""
        p = self.params
        return self.num_generated < p.min_new_tokens and bool(p.stop_token_ids) and self.constraint is None

    # --- index tensors the sampler scatters into the logits ---------------------------------

    def seen_ids(self, device: torch.device, vocab_size: int) -> torch.Tensor:
        """Prompt + generated ids, each once; ids outside [0, V) dropped (they would index the next row)."""
        t = self._seen_tensor
        n = len(self._seen_ids)
        if t is None or t.device != device:
            t = torch.tensor(self._seen_ids, dtype=torch.long, device=device)
        elif t.numel() < n:
            tail = torch.tensor(self._seen_ids[t.numel():], dtype=torch.long, device=device)
            t = torch.cat([t, tail])
        self._seen_tensor = t
        if self._seen_ids and (min(self._seen_range) < 0 or max(self._seen_range) >= vocab_size):
            return t[(t >= 0) & (t < vocab_size)]
        return t

    def output_ids_and_counts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(list(self.output_counts.keys()), dtype=torch.long, device=device)
        counts = torch.tensor(list(self.output_counts.values()), dtype=torch.float32, device=device)
        return ids, counts

    def masked_ids(self, device: torch.device, vocab_size: int) -> torch.Tensor | None:
        """Ids to set to -inf this step: bad ids, plus stop ids until min_new_tokens (ids >= V dropped)."""
        p = self.params
        block_stop = self.blocks_stop_tokens()
        kind = 'bad+stop' if block_stop else 'bad'
        key = (kind, device, vocab_size)
        t = self._masks.get(key)
        if t is None:
            ids = set(p.bad_token_ids)
            if block_stop:
                ids.update(p.stop_token_ids)
            ids = sorted(i for i in ids if 0 <= i < vocab_size)
            t = torch.tensor(ids, dtype=torch.long, device=device)
            self._masks[key] = t
        return t if t.numel() else None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: None unless params.logprobs is set; else {chosen: lp, then top-k alternatives, best first}
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Stateless: everything per request lives in its ``SamplingState``."""

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        # logits: [B, V] float32, one row per state; never modified
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f'Sampler.sample: logits of shape {tuple(logits.shape)} for {len(states)} states')
        batch, vocab = logits.shape
        owned = False
        if logits.dtype != torch.float32:
            logits = logits.float()
            owned = True

        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            raw_logprobs = torch.log_softmax(_take_rows(logits, lp_rows), dim=-1)

        work = self.process_logits(logits, states, owned)

        greedy_rows = [i for i, s in enumerate(states) if s.greedy]
        if len(greedy_rows) == batch:
            token_ids = greedy_ids(work)
        else:
            token_ids = torch.empty(batch, dtype=torch.long, device=logits.device)
            if greedy_rows:
                idx = torch.tensor(greedy_rows, device=logits.device)
                token_ids[idx] = greedy_ids(work.index_select(0, idx))
            sample_rows = [i for i, s in enumerate(states) if not s.greedy]
            x = _take_rows(work, sample_rows)
            token_ids[torch.tensor(sample_rows, device=logits.device)] = self._sample_rows(
                x, [states[i] for i in sample_rows])
        ids = token_ids.tolist()

        logprobs: list[dict[int, float] | None] = [None] * batch
        if lp_rows:
            self._fill_logprobs(raw_logprobs, lp_rows, ids, states, logprobs)
        return SamplerOutput(token_ids=ids, logprobs=logprobs)

    # --- penalties and masks -----------------------------------------------------------------

    def process_logits(self, logits: torch.Tensor, states: list[SamplingState],
                       owned: bool = False) -> torch.Tensor:
        """Penalties and masks; returns ``logits`` itself when no row needs any, else a processed copy.

        ``owned``: the caller gives ``logits`` away, so it may be processed in place.
        """
        rows = [i for i, s in enumerate(states) if s.needs_processing()]
        if not rows:
            return logits
        vocab = logits.shape[1]
        device = logits.device
        work = logits if owned and logits.is_contiguous() else logits.clone(memory_format=torch.contiguous_format)
        flat = work.view(-1)

        rep_idx, rep_pen = [], []
        out_idx, out_delta = [], []
        mask_idx = []
        for i in rows:
            s = states[i]
            p = s.params
            base = i * vocab
            if s.has_repetition_penalty:
                seen = s.seen_ids(device, vocab)
                if seen.numel():
                    rep_idx.append(seen + base)
                    rep_pen.append(torch.full((seen.numel(),), p.repetition_penalty, device=device))
            if s.has_output_penalty and s.output_counts:
                ids, counts = s.output_ids_and_counts(device)
                out_idx.append(ids + base)
                out_delta.append(counts * p.frequency_penalty + p.presence_penalty)
            masked = s.masked_ids(device, vocab)
            if masked is not None:
                mask_idx.append(masked + base)

        if rep_idx:
            # HF RepetitionPenaltyLogitsProcessor: negative logits multiplied, positive divided
            idx = torch.cat(rep_idx)
            pen = torch.cat(rep_pen)
            vals = flat[idx]
            flat[idx] = torch.where(vals < 0, vals * pen, vals / pen)
        if out_idx:
            idx = torch.cat(out_idx)
            flat[idx] = flat[idx] - torch.cat(out_delta)
        if mask_idx:
            flat[torch.cat(mask_idx)] = _NEG_INF
        constrained = [i for i in rows if states[i].constraint is not None]
        if constrained:
            num_words = (vocab + 31) // 32
            # bitmask: [len(constrained), num_words] int32, xgrammar's layout (see apply_token_bitmask_)
            bitmask = torch.empty((len(constrained), num_words), dtype=torch.int32)
            for j, i in enumerate(constrained):
                c = states[i].constraint
                if c.num_words != num_words:
                    raise ValueError(f'a constraint for {c.vocab_size} tokens on logits of {vocab}')
                c.fill_bitmask(bitmask, j)
            apply_token_bitmask_(work, bitmask, constrained)
        return work

    # --- sampling ---------------------------------------------------------------------------

    def _sample_rows(self, x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Draw one token per row of ``x`` ([n, V], already penalized); returns [n] long."""
        n, vocab = x.shape
        device = x.device
        u = self._uniforms(states, device)
        out = torch.empty(n, dtype=torch.long, device=device)

        # each row's path depends only on its own params and logits (keeps a seeded row batch-independent)
        plain, top_k, nucleus = [], [], []
        for r, s in enumerate(states):
            p = s.params
            if 0 < p.top_k < vocab:
                top_k.append(r)
            elif p.top_p < 1.0 or p.min_p > 0.0:
                nucleus.append(r)
            else:
                plain.append(r)

        if plain:
            group = [states[r] for r in plain]
            probs = _scale(_take_rows(x, plain), group).softmax(dim=-1)
            out[torch.tensor(plain, device=device)] = draw(probs, _take_rows(u, plain))
        if top_k:
            group = [states[r] for r in top_k]
            # temperature keeps the order: cut first, then scale only the candidates
            vals, cand = _take_rows(x, top_k).topk(max(s.params.top_k for s in group), dim=-1)  # best first
            probs = filter_sorted(_scale(vals, group), *_cuts(group, device))
            choice = draw(probs, _take_rows(u, top_k))
            out[torch.tensor(top_k, device=device)] = cand.gather(1, choice[:, None]).squeeze(1)
        if nucleus:
            group = [states[r] for r in nucleus]
            out[torch.tensor(nucleus, device=device)] = self._sample_nucleus(
                _scale(_take_rows(x, nucleus), group), group, _take_rows(u, nucleus))
        return out

    def _sample_nucleus(self, x: torch.Tensor, states: list[SamplingState], u: torch.Tensor) -> torch.Tensor:
        """Rows without top_k but with top_p and/or min_p; x: [n, V] already scaled.

        A full sort of 49k logits costs ~30 argmaxes on CPU, yet the kept set almost always
        lies within the best few hundred tokens: try ``topk`` prefixes of growing width and
        fully sort only rows whose kept set may pass the widest. Which width serves a row
        depends only on that row, and the prefix paths give the same probabilities as a sort.
        """
        n, vocab = x.shape
        device = x.device
        # one softmax over the vocab; every path gathers its probabilities from it, so the
        # prefix and the sort see the very same floats (logsumexp and exp(-inf) are slow on CPU)
        probs_all = x.softmax(dim=-1)
        top_k, top_p, min_p = _cuts(states, device)
        out = torch.empty(n, dtype=torch.long, device=device)
        rows = torch.arange(n, device=device)  # rows still to draw, as indices into x
        for width in self.NUCLEUS_PREFIXES + (vocab,):
            xr = x if rows.numel() == n else x.index_select(0, rows)
            if width >= vocab:
                vals, cand = xr.sort(dim=-1, descending=True)
                done = torch.ones(rows.numel(), dtype=torch.bool, device=device)
            else:
                vals, cand = xr.topk(width, dim=-1)
                full = probs_all.index_select(0, rows).gather(1, cand)
                mass = full.cumsum(dim=-1)[:, -1]
                tp, mp = top_p[rows], min_p[rows]
                # the kept set ends inside the prefix when top_p's does or min_p's does
                done = ((tp < 1.0) & (mass >= tp)) | ((mp > 0.0) & (full[:, -1] < mp * full[:, 0]))
            if bool(done.any()):
                d = done.nonzero().squeeze(1)
                r = rows[d]
                probs = filter_sorted(vals[d], top_k[r], top_p[r], min_p[r],
                                      probs_all.index_select(0, r).gather(1, cand[d]))
                out[r] = cand[d].gather(1, draw(probs, u[r])[:, None]).squeeze(1)
            rows = rows[~done]
            if rows.numel() == 0:
                break
        return out

    # widths of the topk prefixes a top_p / min_p row tries before a full sort
    NUCLEUS_PREFIXES = (256, 4096)

    @staticmethod
    def _uniforms(states: list[SamplingState], device: torch.device) -> torch.Tensor:
        """[n] U[0, 1): each row takes exactly one value per step, a seeded row from its own generator."""
        u = torch.empty(len(states), dtype=torch.float32, device=device)
        unseeded = [r for r, s in enumerate(states) if not s.has_seed]
        if unseeded:
            shared = torch.rand(len(unseeded), generator=_shared_generator(device), device=device)
            u[torch.tensor(unseeded, device=device)] = shared
        seeded = [r for r, s in enumerate(states) if s.has_seed]
        if seeded:
            own = [torch.rand(1, generator=states[r].generator(device), device=device) for r in seeded]
            u[torch.tensor(seeded, device=device)] = torch.cat(own)
        return u

    def warp(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, top_k, top_p, min_p as the sampling paths apply them, back in vocab order.

        Not the hot path (it sorts every row); for tests and debugging: ``softmax`` of the
        result is the distribution a sampled row draws from (cut tokens are -inf).
        """
        device = logits.device
        temps = torch.tensor([s.params.temperature for s in states], dtype=torch.float32, device=device)
        x = logits / temps[:, None]
        vals, cand = x.sort(dim=-1, descending=True, stable=True)
        top_k, top_p, min_p = _cuts(states, device)
        probs = torch.empty_like(vals)
        for r in range(x.shape[0]):
            # top-k rows normalize over their top-k set, others over the vocab, as the hot paths do
            row_probs = None if top_k[r] < x.shape[1] else x[r:r + 1].softmax(dim=-1).gather(1, cand[r:r + 1])
            probs[r:r + 1] = filter_sorted(vals[r:r + 1], top_k[r:r + 1], top_p[r:r + 1], min_p[r:r + 1], row_probs)
        return torch.empty_like(vals).scatter_(1, cand, probs.log())

    # --- logprobs ----------------------------------------------------------------------------

    @staticmethod
    def _fill_logprobs(raw_logprobs: torch.Tensor, lp_rows: list[int], ids: list[int],
                       states: list[SamplingState], out: list[dict[int, float] | None]) -> None:
        # raw_logprobs: [len(lp_rows), V] (or [B, V] when every row asked)
        device = raw_logprobs.device
        chosen = torch.tensor([ids[i] for i in lp_rows], device=device)
        chosen_lp = raw_logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
        ks = [states[i].params.logprobs for i in lp_rows]
        k_max = max(ks)
        top_vals = top_ids = None
        if k_max > 0:
            v, t = raw_logprobs.topk(k_max, dim=-1)
            top_vals, top_ids = v.tolist(), t.tolist()
        for j, i in enumerate(lp_rows):
            d = {ids[i]: chosen_lp[j]}
            for t, v in zip(top_ids[j][:ks[j]] if k_max else (), top_vals[j][:ks[j]] if k_max else ()):
                d.setdefault(t, v)
            out[i] = d


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[dict[int, float]]:
    """Per row of ``logits`` [n, V]: ``{token_ids[i]: its logprob, then the k best alternatives, best
    first}``, log_softmax of the raw float32 row: what a prompt's rows give (the engine's prompt
    logprobs), the same arithmetic as the sampled tokens' logprobs."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    own = raw.gather(1, torch.tensor(token_ids, device=raw.device)[:, None]).squeeze(1).tolist()
    tops = [[]] * len(token_ids)
    if k > 0:
        v, t = raw.topk(min(k, raw.shape[1]), dim=-1)
        tops = [list(zip(ti, vi)) for ti, vi in zip(t.tolist(), v.tolist())]
    out = []
    for tid, lp, top in zip(token_ids, own, tops):
        d = {tid: lp}
        for alt, alt_lp in top:
            d.setdefault(alt, alt_lp)
        out.append(d)
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [n, W] int32 (bit ``t % 32`` of word ``t // 32``: token t allowed) -> bool [n, vocab]."""
    n, width = bitmask.shape
    if width * 32 < vocab:
        raise ValueError(f'a bitmask of {width} words covers {width * 32} tokens, fewer than the {vocab} logits')
    if bitmask.device.type == 'cpu' and sys.byteorder == 'little':
        # numpy's unpackbits is ~50x faster than shifts on the CPU; little-endian bytes of a word
        # unpacked little-bit-first give its bits 0..31 in order
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder='little')
        return torch.from_numpy(bits).view(torch.bool)[:, :vocab]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # an arithmetic shift of a negative word still leaves bit k in place 0
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(n, width * 32)[:, :vocab].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """Set to -inf, in place, every logit whose bit is clear: logits [B, V]; bitmask [n, W] int32
    for ``rows`` of logits (None: n == B, every row). Returns ``logits``."""
    allowed = unpack_bitmask(bitmask, logits.shape[1]).to(logits.device)
    if rows is None:
        if allowed.shape[0] != logits.shape[0]:
            raise ValueError(f'a bitmask of {allowed.shape[0]} rows for logits of {logits.shape[0]}')
        return logits.masked_fill_(~allowed, _NEG_INF)
    for j, i in enumerate(rows):
        logits[i].masked_fill_(~allowed[j], _NEG_INF)
    return logits


def greedy_ids(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a ``[B, V]`` tensor (ties to the lowest id, the first NaN first): on the CPU
    the kernel library's (``ops.argmax``: one pass over each row at memory speed, the rows over its
    threads; torch's walks [16, 49152] float32 logits on one thread, 2 ms of a 16-row decode step)."""
    if x.device.type != 'cpu' or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1 or not x.shape[1]:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    ops.argmax(to_dlpack(x), to_dlpack(out))
    return out


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, without a copy when ``rows`` is every row in order."""
    if len(rows) == t.shape[0] and rows == list(range(len(rows))):
        return t
    return t.index_select(0, torch.tensor(rows, device=t.device))


def _scale(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Divide each row by its temperature (a new tensor unless every temperature is 1)."""
    temps = [s.params.temperature for s in states]
    if all(t == 1.0 for t in temps):
        return x
    return x / torch.tensor(temps, dtype=x.dtype, device=x.device)[:, None]


def _cuts(states: list[SamplingState], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n] top_k (no top-k cut: a huge k), top_p, min_p of each state."""
    no_cut = 2 ** 62
    top_k = torch.tensor([s.params.top_k or no_cut for s in states], dtype=torch.long, device=device)
    top_p = torch.tensor([s.params.top_p for s in states], dtype=torch.float32, device=device)
    min_p = torch.tensor([s.params.min_p for s in states], dtype=torch.float32, device=device)
    return top_k, top_p, min_p


def filter_sorted(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  probs: torch.Tensor | None = None) -> torch.Tensor:
    """Apply top_k, top_p, min_p (in that order) to logits sorted best first; return kept probabilities.

    vals: [n, K] float32, descending per row (may be a prefix of the row when ``probs`` is given);
    top_k: [n] long (K or more: no cut); top_p: [n] (1.0: no cut); min_p: [n] (0.0: no cut);
    probs: [n, K] the tokens' probabilities over the whole row (None: softmax of the top-k-cut ``vals``).
    Returns [n, K]: each token's probability after top_k, zero where cut later; not
    renormalized. Same sets as HF's ``TopKLogitsWarper`` (up to exact ties at the k-th
    value), ``TopPLogitsWarper`` (keep a token while the mass of strictly better tokens
    is below top_p) and ``MinPLogitsWarper``. The best token is always kept.
    """
    n, width = vals.shape
    pos = torch.arange(width, device=vals.device)
    beyond_k = pos[None, :] >= top_k[:, None]
    if probs is None:
        probs = vals.masked_fill(beyond_k, _NEG_INF).softmax(dim=-1)
    else:
        probs = probs.masked_fill(beyond_k, 0.0)
    if bool((top_p < 1.0).any()):
        mass_before = probs.cumsum(dim=-1) - probs
        limit = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, float('inf')))
        cut = mass_before >= limit[:, None]
        cut[:, 0] = False
        probs = probs.masked_fill(cut, 0.0)
    if bool((min_p > 0.0).any()):
        # relative to the best token, so the top_p renormalization does not change the cut
        cut = probs < (min_p[:, None] * probs[:, :1])
        cut[:, 0] = False
        probs = probs.masked_fill(cut, 0.0)
    return probs


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [n, K] non-negative (need not sum to 1), u [n] in [0, 1) -> [n] column."""
    cdf = probs.cumsum(dim=-1)
    target = u * cdf[:, -1]
    j = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    # u * total may round up to total: stay on the last token that has mass
    last = probs.shape[1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(j, last)
