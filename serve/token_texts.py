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
