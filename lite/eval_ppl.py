"""Perplexity of a model on held-out text, measured the same way for every format and backend.

The method: tokenize the whole text once, without BOS or any special token (the windows start
mid-text anyway, and the number then depends on the weights alone); take ``num_windows``
consecutive, non-overlapping windows of ``window`` tokens from the start; score each one
alone from an empty KV cache, teacher-forced in one forward pass: the NLL of tokens
1 .. window - 1 given their prefix. ``ppl = exp(mean NLL over every scored token)``.

Backends: 'turbomind' and 'pytorch', each with the checkpoint's format (float, AWQ, GPTQ, W8A8, a
GGUF conversion's quantized matmuls) and ``quant_policy`` for the KV cache, built through the
core (``lmd.pipeline``) and scored with its ``get_logits``: one full-sequence forward per window,
no sampling (``lmd.engine.Engine.get_logits``); 'hf' is HF ``transformers`` on the float
checkpoint, the reference. The NLL is ``lmd.engine.token_nll``'s, for all three.
"""
from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

BACKENDS = ('turbomind', 'pytorch', 'hf')
_DTYPES = ('auto', 'float32', 'bfloat16', 'float16')
BLOCK_SIZE = 64
EVAL_TEXTS = {'prose': 'eval', 'code': 'code'}  # the built-in held-out texts: name -> calib_data.builtin_text split

Scorer = Callable[[list[int]], torch.Tensor]  # window ids -> float32 logits [window, vocab]


def eval_ppl(model_path: str, text_file: str | None = None, *, model_format: str | None = None,
             quant_policy: int = 0, backend: str = 'turbomind', dtype: str = 'float32', window: int = 512,
             num_windows: int = 12, engine_fields: dict | None = None) -> dict:
    """Perplexity of ``model_path`` ('smollm2', a hub id, a directory or a GGUF file) on
    ``text_file``: a UTF-8 text file, or one of the built-in held-out texts, 'prose' (the default,
    ``calib_data.builtin_text('eval')``) or 'code' (Python's own source, ``builtin_text('code')``).

    ``model_format`` None reads the checkpoint as the engines do: on TurboMind a GGUF conversion
    (``'smollm2'``) runs its 4-bit matmuls (values equal to the float weights'); 'hf' forces the
    float weights.

    ``engine_fields``: the engines' scaling settings, as the commands take them (``tp``, ``dp``, ``pp``,
    ``distributed_executor_backend``, ``ray_address``; ``lmd.backend.command_engine_config``); with
    ``dp`` replicas, that many windows are scored at once. The 'hf' reference takes none.

    Returns ``ppl``, ``nll`` (mean, nats), ``tokens`` (scored), ``windows``, ``window``,
    ``seconds`` (scoring), ``load_seconds``, and the settings that ran (``backend``,
    ``model_format``, ``quant_policy``, ``dtype``).
    """
    from lmd.engine import token_nll
    from lmd.model_path import prepare_model_dir
    from lmd.tokenizer import Tokenizer

    _check_args(backend, quant_policy, dtype, window, num_windows, model_format)
    engine_fields = {k: v for k, v in (engine_fields or {}).items() if v is not None}
    if backend == 'hf' and any(v != 1 for k, v in engine_fields.items() if k in ('tp', 'dp', 'pp')):
        raise ValueError(f"backend 'hf' is the float reference on one process: {engine_fields} need backend "
                         "'turbomind' or 'pytorch'")
    text = _read_text(text_file)
    model_dir = prepare_model_dir(model_path)
    ids = Tokenizer(model_dir).encode(text, add_special_tokens=False)
    need = window * num_windows
    if len(ids) < need:
        source = f"the built-in {text_file or 'prose'} text" if text_file in (None, *EVAL_TEXTS) else text_file
        raise ValueError(f'{source} has {len(ids)} tokens, fewer than num_windows * window = {num_windows} * '
                         f'{window} = {need}; {len(ids) // window} windows of {window} tokens fit')

    start = time.perf_counter()
    score, fmt, close = _SCORERS[backend](backend, model_dir, model_format, quant_policy, dtype, window,
                                          engine_fields)
    load_seconds = time.perf_counter() - start
    windows = [ids[w * window:(w + 1) * window] for w in range(num_windows)]
    start = time.perf_counter()
    try:
        # dp replicas score dp windows at once (each get_logits runs on the least busy replica)
        with ThreadPoolExecutor(engine_fields.get('dp', 1)) as pool:
            nlls = list(pool.map(lambda chunk: token_nll(score(chunk), chunk).sum().item(), windows))
        seconds = time.perf_counter() - start
    finally:
        close()
    num_scored = num_windows * (window - 1)
    nll = sum(nlls) / num_scored  # in window order: the same sum whatever ran first
    return dict(ppl=math.exp(nll), nll=nll, tokens=num_scored, windows=num_windows, window=window,
                seconds=seconds, load_seconds=load_seconds, backend=backend, model_format=fmt,
                quant_policy=quant_policy, dtype=dtype)


def _check_args(backend, quant_policy, dtype, window, num_windows, model_format) -> None:
    if backend not in BACKENDS:
        raise ValueError(f'backend={backend!r} is invalid: choose one of {", ".join(BACKENDS)}')
    if quant_policy not in (0, 4, 8):
        raise ValueError(f'quant_policy={quant_policy!r} is invalid: use 0 (float KV cache), 8 or 4')
    if backend == 'hf' and quant_policy:
        raise ValueError(f"quant_policy={quant_policy} needs backend 'turbomind' or 'pytorch': "
                         "the 'hf' reference has a float KV cache only")
    if dtype not in _DTYPES:
        raise ValueError(f'dtype={dtype!r} is invalid: choose one of {", ".join(_DTYPES)}')
    if not isinstance(window, int) or window < 2:
        raise ValueError(f'window={window!r} is invalid: a window needs at least 2 tokens')
    if not isinstance(num_windows, int) or num_windows < 1:
        raise ValueError(f'num_windows={num_windows!r} is invalid: score at least one window')
    if model_format not in (None, 'hf', 'awq', 'gptq', 'w8a8', 'gguf'):
        raise ValueError(f"model_format={model_format!r} is invalid: choose None (detect), 'hf', 'awq', "
                         "'gptq', 'w8a8' or 'gguf'")


def _read_text(text_file: str | None) -> str:
    from .calib_data import builtin_text
    if text_file is None or text_file in EVAL_TEXTS:
        return builtin_text(EVAL_TEXTS[text_file or 'prose'])
    if not os.path.isfile(text_file):
        raise FileNotFoundError(f'text_file {text_file!r} does not exist')
    try:
        with open(text_file, encoding='utf-8') as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f'text_file {text_file!r} is not UTF-8 text: {e}') from None
    if not text.strip():
        raise ValueError(f'text_file {text_file!r} is empty')
    return text


def _engine_scorer(backend, model_dir, model_format, quant_policy, dtype, window,
                   engine_fields) -> tuple[Scorer, str, Callable]:
    """The engine's own scoring call through the core: ``pipeline(...).get_logits``."""
    from lmd.api import pipeline
    from lmd.backend import command_engine_config

    # scoring runs over a cache of its own: the serving one is left at its smallest, one window; the
    # PyTorch engine's own fields (pp, the executor) make a PytorchEngineConfig, which TurboMind refuses
    config = command_engine_config(dict(session_len=window, cache_block_seq_len=BLOCK_SIZE,
                                        num_cache_blocks=-(-window // BLOCK_SIZE), max_batch_size=1,
                                        quant_policy=quant_policy, model_format=model_format, dtype=dtype,
                                        **engine_fields), backend)
    pipe = pipeline(model_dir, backend_config=config, backend=backend)
    return (lambda ids: pipe.get_logits(ids)[0]), pipe.async_engine.model_info.model_format, pipe.close


def _hf_scorer(backend, model_dir, model_format, quant_policy, dtype, window,
               engine_fields) -> tuple[Scorer, str, Callable]:
    import transformers

    from lmd.model_config import ModelConfig
    config = ModelConfig.from_dir(model_dir)
    if config.model_format != 'hf' or model_format not in (None, 'hf'):
        raise ValueError(f"backend 'hf' is the float reference: it reads float checkpoints only, and {model_dir} "
                         f"is {config.model_format!r} (model_format={model_format!r}); use backend 'turbomind' or "
                         "'pytorch'")
    torch_dtype = getattr(torch, config.torch_dtype if dtype == 'auto' else dtype)  # 'auto': the checkpoint's
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model.eval()

    @torch.inference_mode()
    def score(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].float()
    return score, 'hf', lambda: None


_SCORERS = {'turbomind': _engine_scorer, 'pytorch': _engine_scorer, 'hf': _hf_scorer}
