"""Text for calibration and perplexity that works offline.

The default is English prose that ships with Python itself: the reference topics of
``pydoc_data.topics``, split into two disjoint parts so perplexity is never measured on
text the quantizer saw: two long prose topics, "compound" (compound statements) and
"debugger" (pdb), about 71 000 characters or 17 000 SmolLM2 tokens, are held out for
evaluation; the other 77 topics (about 394 000 characters) are for calibration.

The second held-out text is of another kind: Python source code, the standard library's own
modules ``CODE_EVAL`` (about 94 000 characters, 24 000 SmolLM2 tokens), which no split of the
prose quotes at length. It measures whether a quantizer calibrated on prose generalizes.
(The topics and modules change a little between Python versions, so figures compare only
within one version.)
"""
from __future__ import annotations

import os

BUILTIN = 'pydoc'
HELD_OUT = ('compound', 'debugger')
# pure-Python stdlib modules, in this order: the first 12 x 512 tokens span graphlib, shlex and textwrap
CODE_EVAL = ('graphlib', 'shlex', 'textwrap', 'heapq', 'fractions')
SPLITS = ('calib', 'eval', 'code')


def builtin_text(split: str) -> str:
    """``split``: 'calib' (the calibration topics) or 'eval' (the held-out ones), each topic's
    text in sorted topic order; or 'code' (the source files of the ``CODE_EVAL`` modules, in
    that order); separated by blank lines."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    if split == 'code':
        return '\n\n'.join(_module_source(name) for name in CODE_EVAL)
    from pydoc_data.topics import topics
    names = sorted(topics)
    held_out = split == 'eval'
    return '\n\n'.join(topics[name] for name in names if (name in HELD_OUT) == held_out)


def _module_source(name: str) -> str:
    """The source text of the standard-library module ``name``."""
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not (spec.origin or '').endswith('.py') or not os.path.isfile(spec.origin):
        raise FileNotFoundError(f'the source of the standard-library module {name!r} is not on this machine '
                                '(a Python installed without its .py files); the code eval text needs it')
    with open(spec.origin, encoding='utf-8') as f:
        return f.read()


def _read_jsonl(path: str) -> str:
    import json
    texts = []
    with open(path, encoding='utf-8') as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f'{path}, line {lineno}: not a JSON object ({e})') from None
            if not isinstance(obj, dict) or not isinstance(obj.get('text'), str):
                raise ValueError(f'{path}, line {lineno}: expected an object with a string "text" field')
            texts.append(obj['text'])
    return '\n\n'.join(texts)


def _read_file(path: str) -> str:
    if path.lower().endswith('.jsonl'):
        return _read_jsonl(path)
    with open(path, encoding='utf-8') as f:
        return f.read()


def _hub_text(repo_id: str) -> str:
    """The .txt / .jsonl files of a Hugging Face dataset repository, joined."""
    import glob

    from huggingface_hub import snapshot_download
    try:
        root = snapshot_download(repo_id, repo_type='dataset', allow_patterns=['*.txt', '*.jsonl'], etag_timeout=10)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f'--calib-dataset {repo_id!r} is neither {BUILTIN!r} nor a local .txt/.jsonl file, and the '
                         f'Hugging Face Hub could not be reached to fetch it ({type(e).__name__}: {reason}); '
                         f"pass a local .txt or .jsonl file, or '{BUILTIN}'") from None
    files = sorted(glob.glob(os.path.join(glob.escape(root), '**', '*.txt'), recursive=True)
                   + glob.glob(os.path.join(glob.escape(root), '**', '*.jsonl'), recursive=True))
    if not files:
        raise ValueError(f'--calib-dataset {repo_id!r}: the hub dataset has no .txt or .jsonl files lmd can read; '
                         'pass a local .txt or .jsonl file instead')
    return '\n\n'.join(_read_file(p) for p in files)


def calib_text(dataset: str = BUILTIN) -> str:
    """The calibration text of ``dataset``: 'pydoc' (``builtin_text('calib')``), a local ``.txt``
    (the whole file) or ``.jsonl`` (the ``text`` field of each line's object), or else the id of a
    Hugging Face dataset (its .txt / .jsonl files)."""
    if dataset == BUILTIN:
        return builtin_text('calib')
    path = os.path.expanduser(dataset)
    if os.path.isfile(path):
        text = _read_file(path)
    elif path.lower().endswith(('.txt', '.jsonl')) or os.path.isdir(path):
        raise FileNotFoundError(f'--calib-dataset {dataset!r}: no such file')
    else:
        text = _hub_text(dataset)
    if not text.strip():
        raise ValueError(f'--calib-dataset {dataset!r}: the text is empty')
    return text


def calib_tokens(tokenizer, dataset: str = BUILTIN, calib_samples: int = 128, calib_seqlen: int = 512):
    """``calib_samples`` windows of ``calib_seqlen`` tokens of ``dataset``'s text, spread evenly
    over it without overlap: a LongTensor [calib_samples, calib_seqlen]."""
    import torch
    if calib_samples < 1 or calib_seqlen < 1:
        raise ValueError(f'--calib-samples ({calib_samples}) and --calib-seqlen ({calib_seqlen}) must be positive')
    # the backend tokenizer: HF's encode warns about texts longer than the model's context
    ids = tokenizer.hf_tokenizer.backend_tokenizer.encode(calib_text(dataset), add_special_tokens=False).ids
    fit = len(ids) // calib_seqlen
    if fit < calib_samples:
        raise ValueError(f'--calib-dataset {dataset!r} has {len(ids)} tokens: {fit} windows of {calib_seqlen} fit, '
                         f'{calib_samples} were asked for; lower --calib-samples or --calib-seqlen, or give more text')
    stride = len(ids) // calib_samples
    return torch.tensor([ids[i * stride:i * stride + calib_seqlen] for i in range(calib_samples)])
