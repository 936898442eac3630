"""One token's text and bytes, as OpenAI's logprobs show them.

A token is not always text: a byte-level BPE token may hold half of a UTF-8
character. ``bytes`` is the token's exact bytes (byte-level tokens through the GPT-2
byte table, SentencePiece ``<0xNN>`` byte tokens, ``▁`` as a space); ``token`` is
those bytes decoded with replacement, so a client that joins ``bytes`` gets the text
back exactly. Results are cached per id.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from lmd.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r'^<0x([0-9A-Fa-f]{2})>$')


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable characters byte-level BPE uses back to bytes."""
    bs = list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1)) + \
        list(range(ord('®'), ord('ÿ') + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:

    def __init__(self, tokenizer: Tokenizer):
        hf = tokenizer.hf_tokenizer
        self._hf = hf
        decoder = hf.backend_tokenizer.decoder
        self._byte_level = decoder is not None and 'ByteLevel' in repr(decoder)
        self._added = {i: t.content for i, t in hf.backend_tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if token_id in self._added:
            raw = self._added[token_id].encode('utf-8')
        else:
            piece = self._hf.convert_ids_to_tokens(token_id)
            if piece is None:
                raw = b''
            elif self._byte_level:
                table = _byte_decoder()
                raw = bytes(table[ch] for ch in piece) if all(ch in table for ch in piece) else piece.encode()
            else:
                m = _BYTE_TOKEN.match(piece)
                raw = bytes([int(m.group(1), 16)]) if m else piece.replace('\u2581', ' ').encode('utf-8')
        hit = (raw.decode('utf-8', errors='replace'), list(raw))
        self._cache[token_id] = hit
        return hit

    def chat_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]],
                      top_k: int) -> list[dict]:
        """OpenAI's chat ``logprobs.content``: one entry per generated token."""
        out = []
        for tid, lp in zip(token_ids, logprobs):
            text, raw = self.get(tid)
            top = []
            for alt, alt_lp in sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]:
                alt_text, alt_raw = self.get(alt)
                top.append({'token': alt_text, 'logprob': alt_lp, 'bytes': alt_raw})
            out.append({'token': text, 'logprob': lp.get(tid, -9999.0), 'bytes': raw, 'top_logprobs': top})
        return out

    def completion_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], top_k: int,
                            offset: int) -> dict:
        """OpenAI's legacy completions ``logprobs`` for these tokens; ``offset``: text before them."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in zip(token_ids, logprobs):
            text, _ = self.get(tid)
            tokens.append(text)
            token_lps.append(lp.get(tid, -9999.0))
            tops.append({self.get(a)[0]: v for a, v in sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]}
                        if top_k else None)
            offsets.append(offset)
            offset += len(text)
        return {'tokens': tokens, 'token_logprobs': token_lps, 'top_logprobs': tops, 'text_offset': offsets}

    def echo_logprobs(self, token_ids: Sequence[int], prompt_logprobs: Sequence[dict[int, float] | None] | None,
                      top_k: int) -> dict:
        """The prompt's part of an echoed completion's ``logprobs`` (OpenAI and vLLM, ``echo`` with
        ``logprobs``): one entry per prompt token, offsets from 0 in the echoed text; the first token's
        ``token_logprobs`` and ``top_logprobs`` are null (nothing predicts it), as are all of them
        without the engine's prompt logprobs."""
        lps = list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(token_ids)
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tid, lp in zip(token_ids, lps):
            text, _ = self.get(tid)
            tokens.append(text)
            token_lps.append(None if lp is None else lp.get(tid, -9999.0))
            tops.append({self.get(a)[0]: v for a, v in _best(lp, top_k)} if lp is not None and top_k else None)
            offsets.append(offset)
            offset += len(text)
        return {'tokens': tokens, 'token_logprobs': token_lps, 'top_logprobs': tops, 'text_offset': offsets}

    def prompt_logprobs(self, token_ids: Sequence[int], prompt_logprobs: Sequence[dict[int, float] | None],
                        top_k: int) -> list[dict[str, dict] | None]:
        """vLLM's ``prompt_logprobs`` (a response extra): per prompt token None (the first) or
        ``{token_id: {logprob, rank, decoded_token}}``, the prompt's own token and the ``top_k`` best.
        Ranks count from 1 over the vocabulary; the prompt's token outside the top k has rank null
        (the engines keep only the top k)."""
        out: list[dict[str, dict] | None] = []
        for tid, lp in zip(token_ids, prompt_logprobs):
            if lp is None:
                out.append(None)
                continue
            ranked = sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))
            rank = {t: r for r, (t, _) in enumerate(ranked, 1) if r <= top_k}
            entry = {str(tid): {'logprob': lp[tid], 'rank': rank.get(tid), 'decoded_token': self.get(tid)[0]}}
            for alt, alt_lp in ranked[:top_k]:
                entry.setdefault(str(alt), {'logprob': alt_lp, 'rank': rank[alt], 'decoded_token': self.get(alt)[0]})
            out.append(entry)
        return out


def _best(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely of an entry that holds its token and at least the k best, best first."""
    return sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
