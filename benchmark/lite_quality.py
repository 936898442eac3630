"""What ``lmd lite`` costs in quality and buys in size and speed, every scheme in one run.

    python benchmark/lite_quality.py                       # SmolLM2, all schemes (~60 min on 2 cores)
    python benchmark/lite_quality.py --model tiny          # a tiny random Llama (same tokenizer), minutes
    python benchmark/lite_quality.py --schemes float32,rtn_g64,awq_g64,gptq_g64 --calib-samples 32

Schemes: ``float32`` (the checkpoint itself), ``rtn_gG`` (plain round-to-nearest int4 with zero
points, ``lmd lite auto_awq --rtn``), ``awq_gG`` (``lmd lite auto_awq``), ``gptq_gG``
(``lmd lite gptq``), ``w8a8`` (``lmd lite smooth_quant``), ``kv8`` / ``kv4`` (the float
checkpoint with ``quant_policy`` 8 / 4). Each quantizer runs as the ``lmd`` command in its own
process under ``/usr/bin/time``, which gives its wall time and peak RSS. Perplexity is
``lmd.lite.eval_ppl`` in TurboMind on the two held-out texts (``eval_ppl.EVAL_TEXTS``): the
prose (``calib_data.builtin_text('eval')``, of the calibration text's kind but never used for
it) and Python source (``builtin_text('code')``, another kind), the same windows for every
scheme; HF ``transformers`` float32 on the float checkpoint is the reference row. ``closed`` is
the share of RTN's perplexity gap to float (same group size) that a calibrated int4 scheme
closes, per text. ``linear_bytes`` is what the checkpoint's matmul weights take on disk, and
``linear_vs_16bit`` that over the same matmuls at 16 bits. Batch-1 decode tokens/s (greedy,
``--decode-tokens`` prompt,output) through TurbomindEngine compares each quantized checkpoint
with the float checkpoint run in float16.

Prints one JSON object on stdout (progress on stderr) and a markdown table on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEFAULT_THREADS, add_engine_args, set_threads  # noqa: E402

LINEARS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
DEFAULT_SCHEMES = 'float32,rtn_g64,rtn_g32,awq_g64,awq_g32,gptq_g64,gptq_g32,w8a8,kv8,kv4'


def log(*args) -> None:
    """Progress and the markdown table on stderr, as they are (no timestamp: the table is copied out)."""
    print(*args, file=sys.stderr, flush=True)


def tiny_model_dir(root: str, tokenizer_dir: str) -> str:
    """A randomly initialised 4-layer Llama with ``tokenizer_dir``'s tokenizer, written once."""
    import shutil

    import torch
    import transformers
    out = os.path.join(root, 'tiny-llama')
    if os.path.isfile(os.path.join(out, 'config.json')):
        return out
    config = transformers.LlamaConfig(vocab_size=transformers.AutoConfig.from_pretrained(tokenizer_dir).vocab_size,
                                      hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(('tokenizer', 'special_tokens', 'generation_config')):
            shutil.copy(os.path.join(tokenizer_dir, name), out)
    return out


def timed_lmd(args: list[str]) -> dict:
    """``lmd ARGS`` under /usr/bin/time: wall seconds and peak RSS (MiB)."""
    with tempfile.NamedTemporaryFile('r', suffix='.time') as f:
        cmd = ['/usr/bin/time', '-f', '%e %M', '-o', f.name, sys.executable, '-m', 'lmd.cli', *args]
        log('$', ' '.join(cmd[5:]))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            raise RuntimeError(f'lmd {" ".join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}')
        seconds, kib = f.read().split()[-2:]
    return dict(quantize_s=round(float(seconds), 1), quantize_peak_rss_mib=round(int(kib) / 1024, 1))


def linear_bytes(model_dir: str) -> tuple[int, int]:
    """(bytes the matmul weights' tensors take, what the same matmuls take at 16 bits)."""
    total = sixteen = 0
    for name in os.listdir(model_dir):
        if not name.endswith('.safetensors'):
            continue
        with safe_open(os.path.join(model_dir, name), 'pt') as f:
            for key in f.keys():
                if not any(f'.{lin}.' in key for lin in LINEARS):
                    continue
                t = f.get_slice(key)
                shape, dtype = t.get_shape(), t.get_dtype()
                numel = 1
                for d in shape:
                    numel *= d
                size = numel * {'F32': 4, 'F16': 2, 'BF16': 2, 'I32': 4, 'I8': 1, 'U8': 1}[dtype]
                total += size
                if key.endswith('.weight'):            # float or int8 [N, K]
                    sixteen += numel * 2
                elif key.endswith('.qweight'):         # AWQ int32 [K, N / 8], GPTQ [K / 8, N]
                    sixteen += numel * 8 * 2
    return total, sixteen


def decode_tokens_per_s(model_dir: str, prompt: list[int], n: int, **cfg) -> float:
    from lmd.engine import EngineRequest, SamplingParams
    from lmd.messages import TurbomindEngineConfig
    from lmd.turbomind.engine import TurbomindEngine
    best = 0.0
    with TurbomindEngine(model_dir, TurbomindEngineConfig(max_batch_size=1, **cfg)) as engine:
        for rep in range(3):  # the first round warms up
            stamps, done = [], threading.Event()

            def callback(out):
                stamps.append(time.perf_counter())
                if out.finish_reason is not None:
                    done.set()
            engine.add_request(EngineRequest(rep, tuple(prompt), SamplingParams(max_new_tokens=n)), callback)
            done.wait()
            if rep:
                best = max(best, (len(stamps) - 2) / (stamps[-1] - stamps[1]))
    return round(best, 1)


def rounded(ppl: float | None) -> float | None:
    return None if ppl is None else round(ppl, 3)


def gap_closed(rows: list[dict], ref: dict) -> None:
    """Add ``closed`` {text: %} to each awq_gG / gptq_gG row: how much of rtn_gG's gap to ``ref`` it closes."""
    by_scheme = {r['scheme']: r for r in rows}
    for r in rows:
        kind, _, group = r['scheme'].partition('_g')
        rtn = by_scheme.get(f'rtn_g{group}')
        if kind in ('awq', 'gptq') and rtn and None not in (*r['ppl'].values(), *rtn['ppl'].values()):
            r['closed'] = {t: round(100 * (rtn['ppl'][t] - r['ppl'][t]) / (rtn['ppl'][t] - ref[t]), 1)
                           for t in r['ppl']}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p, backends=None, threads=False,
                    model_help="'smollm2', 'tiny' (random 4-layer Llama) or a directory")
    p.add_argument('--schemes', default=DEFAULT_SCHEMES)
    p.add_argument('--work-root', default=os.path.expanduser('~/.cache/lmd/lite_quality'),
                   help='where the quantized checkpoints go (reused when --reuse)')
    p.add_argument('--reuse', action='store_true', help='keep checkpoints already in --work-root')
    p.add_argument('--calib-samples', type=int, default=128)
    p.add_argument('--calib-seqlen', type=int, default=512)
    p.add_argument('--window', type=int, default=512)
    p.add_argument('--num-windows', type=int, default=12)
    p.add_argument('--decode-tokens', default='128,64', help='batch-1 decode: prompt,output tokens (0,0 skips)')
    p.add_argument('--decode-only', action='store_true',
                   help='time decode alone, on checkpoints an earlier run left in --work-root')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from lmd.lite.eval_ppl import EVAL_TEXTS, eval_ppl
    from lmd.model_path import prepare_model_dir
    set_threads(DEFAULT_THREADS)
    os.makedirs(args.work_root, exist_ok=True)
    smollm2 = prepare_model_dir('smollm2')
    model_dir = tiny_model_dir(args.work_root, smollm2) if args.model == 'tiny' else prepare_model_dir(args.model)
    tag = os.path.basename(os.path.normpath(model_dir))
    schemes = [s for s in args.schemes.split(',') if s]
    calib = ['--calib-samples', str(args.calib_samples), '--calib-seqlen', str(args.calib_seqlen)]
    prompt_len, out_len = (int(x) for x in args.decode_tokens.split(','))
    prompt = list(range(1000, 1000 + prompt_len))
    ppl_args = dict(window=args.window, num_windows=args.num_windows)

    def ppls(path: str, **kw) -> dict:
        return {text: rounded(eval_ppl(path, text, **ppl_args, **kw)['ppl']) for text in EVAL_TEXTS}

    result = {'benchmark': 'lite_quality', 'model': args.model, 'model_dir': model_dir,
              'eval': f'{args.num_windows} windows x {args.window} tokens of each held-out text: '
                      f'{", ".join(EVAL_TEXTS)}',
              'calibration': f'{args.calib_samples} x {args.calib_seqlen} tokens of the calibration prose',
              'rows': []}
    if args.decode_only:
        args.reuse = True
        eval_ppl = lambda *a, **k: {'ppl': None}  # noqa: E731
    ref = ppls(model_dir, backend='hf')
    result['rows'].append({'scheme': 'float32 (HF transformers)', 'ppl': ref})
    log(result['rows'][-1])
    float_bytes = linear_bytes(model_dir)
    if prompt_len:
        result['float16_decode_tok_s'] = decode_tokens_per_s(model_dir, prompt, out_len, dtype='float16')
    for scheme in schemes:
        row: dict = {'scheme': scheme}
        if scheme in ('float32', 'kv8', 'kv4'):
            qp = {'float32': 0, 'kv8': 8, 'kv4': 4}[scheme]
            row['ppl'] = ppls(model_dir, quant_policy=qp)
            row['linear_bytes'], _ = float_bytes
            row['linear_vs_16bit'] = round(float_bytes[0] / float_bytes[1], 3)
        else:
            out = os.path.join(args.work_root, f'{tag}-{scheme}')
            if not (args.reuse and os.path.isfile(os.path.join(out, 'config.json'))) and not args.decode_only:
                if os.path.exists(out):
                    import shutil
                    shutil.rmtree(out)
                kind, _, group = scheme.partition('_g')
                if kind in ('rtn', 'awq'):
                    extra = ['--rtn'] if kind == 'rtn' else calib
                    row.update(timed_lmd(['lite', 'auto_awq', model_dir, '--work-dir', out,
                                          '--w-group-size', group, *extra]))
                elif kind == 'gptq':
                    row.update(timed_lmd(['lite', 'gptq', model_dir, '--work-dir', out, '--w-group-size', group,
                                          *calib]))
                elif kind == 'w8a8':
                    row.update(timed_lmd(['lite', 'smooth_quant', model_dir, '--work-dir', out, *calib]))
                else:
                    raise SystemExit(f'unknown scheme {scheme!r}; choose from {DEFAULT_SCHEMES}')
            if not os.path.isfile(os.path.join(out, 'config.json')):
                raise SystemExit(f'--decode-only: {out} is missing; run without it first')
            row['ppl'] = ppls(out)
            row['linear_bytes'], sixteen = linear_bytes(out)
            row['linear_vs_16bit'] = round(row['linear_bytes'] / sixteen, 3)
            if prompt_len:
                row['decode_tok_s'] = decode_tokens_per_s(out, prompt, out_len)
        result['rows'].append(row)
        log(row)
    gap_closed(result['rows'], ref)
    print(json.dumps(result, indent=1))
    log('| scheme | prose ppl | code ppl | RTN gap closed (prose / code) | matmul weights | vs 16-bit | quantize s '
        '| peak RSS MiB | decode tok/s |')
    log('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
    for r in result['rows']:
        mib = f"{r['linear_bytes'] / 2**20:.1f} MiB" if 'linear_bytes' in r else ''
        closed = ' / '.join(f'{v}%' for v in r['closed'].values()) if 'closed' in r else ''
        log(f"| {r['scheme']} | {r['ppl']['prose']} | {r['ppl']['code']} | {closed} | {mib} | "
            f"{r.get('linear_vs_16bit', '')} | {r.get('quantize_s', '')} | {r.get('quantize_peak_rss_mib', '')} | "
            f"{r.get('decode_tok_s', '')} |")
    if prompt_len:
        log(f"float16 decode tok/s (the 16-bit path): {result['float16_decode_tok_s']}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
