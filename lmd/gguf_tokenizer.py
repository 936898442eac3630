"""A GGUF file's tokenizer (``tokenizer.ggml.*`` metadata) as a ``tokenizers.Tokenizer`` and the
tokenizer_config.json dict HF writes beside it (``build_tokenizer``): llama.cpp's 'gpt2' model as
byte-level BPE, its pre-tokenizer chosen by ``tokenizer.ggml.pre``; its 'llama' model as
SentencePiece BPE with byte fallback, merges rebuilt from the pieces' scores. Control tokens are
special, user-defined ones added whole; BOS / EOS added as the file says.
"""
from __future__ import annotations

from .errors import ModelFormatError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns, named by tokenizer.ggml.pre (the same regexes the
# models' own tokenizer.json files use).
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# gpt-oss's o200k: contractions kept on their word, CamelCase split, '/' kept after punctuation
_GPT4O_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLIT_PRE = ('smollm', 'starcoder', 'refact')
_LLAMA3_PRE = ('llama-bpe', 'llama3', 'llama-v3')
_QWEN2_PRE = ('qwen2',)

SPM_SPACE = '\u2581'  # '▁', SentencePiece's visible space


def _byte_level_tokenizer(meta: dict, tokens: list[str], path: str):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    merges_raw = meta.get('tokenizer.ggml.merges')
    if not merges_raw:
        raise ModelFormatError(f'{path}: BPE tokenizer without tokenizer.ggml.merges')
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(' ')
        if not sep:
            raise ModelFormatError(f'{path}: malformed BPE merge {m!r}')
        merges.append((left, right))
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # duplicates: the first id wins, as in llama.cpp's lookup
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get('tokenizer.ggml.pre', 'default')
    if pre in _DIGIT_SPLIT_PRE:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE or pre == 'gpt-4o':
        pattern = _QWEN2_PATTERN if pre in _QWEN2_PRE else _GPT4O_PATTERN if pre == 'gpt-4o' else _LLAMA3_PATTERN
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior='isolated', invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        if pre in _QWEN2_PRE:
            tk.normalizer = normalizers.NFC()
    else:  # 'default', 'gpt-2' and anything unknown: GPT-2's own regex
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return tk


def _spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE has scores, not merges: every split of a piece into two pieces
    that exist is a merge, ranked by the merged piece's score (higher merges first)."""
    ranked = []
    for piece, pid in vocab.items():
        if len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], pid, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]


def _sentencepiece_tokenizer(meta: dict, tokens: list[str], types: list[int], path: str):
    """llama.cpp's 'llama' tokenizer model: SentencePiece BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    scores = meta.get('tokenizer.ggml.scores') or [0.0] * len(tokens)
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    # byte pieces (<0x41>) and control tokens never take part in merges
    mergeable = {t: i for t, i in vocab.items() if types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED)}
    unk_id = meta.get('tokenizer.ggml.unknown_token_id', 0)
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, mergeable),
                              unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(meta.get('tokenizer.ggml.add_space_prefix', True))
    norms = [normalizers.Prepend(SPM_SPACE)] if add_prefix else []
    tk.normalizer = normalizers.Sequence(norms + [normalizers.Replace(' ', SPM_SPACE)])
    decs = [decoders.Replace(SPM_SPACE, ' '), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decs.append(decoders.Strip(' ', 1, 0))
    tk.decoder = decoders.Sequence(decs)
    return tk


def _token(meta: dict, key: str, tokens: list[str]) -> str | None:
    i = meta.get(f'tokenizer.ggml.{key}_token_id')
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def build_tokenizer(meta: dict, path: str = '<gguf>'):
    """A ``tokenizers.Tokenizer`` and the tokenizer_config.json dict from GGUF metadata."""
    from tokenizers import AddedToken, processors
    tokens = meta.get('tokenizer.ggml.tokens')
    if not tokens:
        raise ModelFormatError(f'{path}: GGUF has no tokenizer (tokenizer.ggml.tokens missing)')
    types = meta.get('tokenizer.ggml.token_type') or [TOKEN_NORMAL] * len(tokens)
    kind = meta.get('tokenizer.ggml.model')
    if kind == 'gpt2':
        tk = _byte_level_tokenizer(meta, tokens, path)
    elif kind == 'llama':
        tk = _sentencepiece_tokenizer(meta, tokens, types, path)
    else:
        raise ModelFormatError(
            f'{path}: tokenizer model {kind!r} is not supported; lmd converts GGUF tokenizers '
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")

    # Control tokens are special (skipped by skip_special_tokens); user-defined ones are
    # matched whole before pre-tokenization but decode as text, as in HF's own files.
    added = [AddedToken(tokens[i], special=(t == TOKEN_CONTROL), normalized=False)
             for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tk.add_special_tokens([a for a in added if a.special])
    tk.add_tokens([a for a in added if not a.special])

    bos, eos = _token(meta, 'bos', tokens), _token(meta, 'eos', tokens)
    add_bos = bool(meta.get('tokenizer.ggml.add_bos_token', kind == 'llama'))
    add_eos = bool(meta.get('tokenizer.ggml.add_eos_token', False))
    single, pair, specials = ['$A:0'], ['$A:0', '$B:1'], []
    if add_bos and bos is not None:
        single, pair = [f'{bos}:0'] + single, [f'{bos}:0', '$A:0', f'{bos}:1', '$B:1']
        specials.append((bos, meta['tokenizer.ggml.bos_token_id']))
    if add_eos and eos is not None:
        single, pair = single + [f'{eos}:0'], pair + [f'{eos}:1']
        specials.append((eos, meta['tokenizer.ggml.eos_token_id']))
    if specials:
        tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    elif kind == 'gpt2':
        tk.post_processor = processors.ByteLevel(trim_offsets=False)

    tok_cfg = {
        'tokenizer_class': 'PreTrainedTokenizerFast',
        'bos_token': bos,
        'eos_token': eos,
        'pad_token': _token(meta, 'padding', tokens),
        'unk_token': _token(meta, 'unknown', tokens),
        'add_bos_token': add_bos,
        'add_eos_token': add_eos,
        'clean_up_tokenization_spaces': False,
        'model_max_length': int(meta.get(f'{meta.get("general.architecture")}.context_length', 4096)),
    }
    if meta.get('tokenizer.chat_template'):
        tok_cfg['chat_template'] = meta['tokenizer.chat_template']
    return tk, tok_cfg
