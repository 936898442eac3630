"""Serving benchmark: one client, the same prompts, against lmd's api_server and its peers.

    python benchmark/profile_restful_api.py --servers lmd,llama-server,vllm --concurrency 16 --num-prompts 128

An async load generator for OpenAI-compatible servers. Every request streams
(``stream: true`` with ``stream_options.include_usage``) from ``/v1/completions``
(default: the raw prompt, no chat template) or ``/v1/chat/completions``
(``--endpoint chat``), greedy, with its output length fixed by ``max_tokens`` and
``ignore_eos``. Arrivals: ``--concurrency C`` (at most C requests in flight: C
closed-loop clients; default 16) and/or ``--request-rate R`` (Poisson, seeded; ``inf``,
the default, does not pace).

Prompts are windows of real prose (``pydoc_data.topics``, see prompts.py) with
lengths drawn from ``--input-len`` / ``--output-len``; a window is kept only when its
text re-encodes to the same token ids, so every server's tokenizer sees the stated
length (``usage.prompt_tokens`` is checked, and so is ``usage.completion_tokens``
against ``max_tokens``; mismatches are reported, never hidden).

Per request: TTFT (send -> first chunk with text), ITL (gaps between chunks with
text), TPOT ((last - first chunk) / (completion_tokens - 1)), end-to-end latency. Per
server: request throughput, output and total tokens/s over the run's wall time,
mean / P50 / P99 of each latency, the server's CPU seconds per wall second and
peak RSS (its whole process tree).

``--servers`` names what to start, one after another on the same prompts:
``lmd`` (``--lmd-backend``), ``lmd-turbomind``, ``lmd-pytorch`` (each optionally
``:MODEL_FORMAT[:DTYPE]``: ``lmd-turbomind:hf`` float32, ``lmd-turbomind:gguf`` the
GGUF's 4-bit matmuls as W4A16), ``llama-server``
(``--gguf``), ``llama-server-f16`` (the F16 GGUF gguf_files.py writes), ``vllm``
(``--vllm-dtype``, the venv of setup_vllm_cpu.sh), or ``NAME=URL`` for a server
already running. Each gets the same ``--max-batch-size`` (lmd's max_batch_size,
llama-server's slots, vLLM's max-num-seqs) and no prefix caching. A block per
server, then a markdown table with lmd / peer ratios (above 1 is better for lmd on
throughput rows, below 1 on latency rows), goes to stdout;
``--json OUT`` writes everything. Exits 2 when a server failed or a check did not hold.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_engine_args, add_llamacpp_extra_bufts_arg, alternating, load_average, log, percentiles, ratio
from gguf_files import LLAMA_SERVER
from prompts import ProseCorpus, parse_range, resolve_model_dir
from serving_servers import (VLLM_VENV, Server, check_runnable, server_specs, start, stop, tree_cpu_seconds,
                             tree_peak_rss_mib)

SERVER_KINDS = ('lmd', 'lmd-turbomind', 'lmd-pytorch', 'llama-server', 'llama-server-f16', 'vllm')
# for --dry-run's duration estimate: (startup s, prefill tok/s, output tok/s at 16-32 concurrent), rough
# rates on a quiet 2-core Zen 3 from this directory's README (vLLM: a guess; its first start compiles)
EXPECTED = {'lmd:hf': (15, 500, 210), 'lmd:gguf': (15, 290, 130), 'lmd-pytorch': (15, 400, 150),
            'llama-server': (5, 260, 120), 'llama-server-f16': (5, 540, 190), 'vllm': (240, 300, 100)}
METRICS = ('ttft', 'tpot', 'itl', 'e2e')


# ---- workload ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int
    token_ids: tuple[int, ...]
    text: str
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.token_ids)


def build_requests(model_dir: str, num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                   seed: int) -> list[Request]:
    """``num`` prose windows whose decoded text encodes back to the same ids (so a server that
    tokenizes the text gets the stated length), each from a different paragraph where possible."""
    corpus = ProseCorpus(model_dir)
    rng = random.Random(seed)
    used: set[tuple[int, ...]] = set()
    out = []
    for i in range(num):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        for _ in range(200):
            ids = corpus.window(rng, n_in)
            text = corpus.decode(ids)
            if ids[:8] not in used and tuple(corpus.tokenizer.encode(text, add_special_tokens=False).ids) == ids:
                break
        else:
            raise RuntimeError(f'no {n_in}-token window of the corpus re-encodes to itself in 200 draws')
        used.add(ids[:8])
        out.append(Request(i, ids, text, n_out))
    return out


def workload(requests: list[Request]) -> dict:
    ins = [r.input_len for r in requests]
    outs = [r.output_len for r in requests]
    return {'source': 'pydoc_data.topics (stdlib prose), windows starting at paragraph starts',
            'num_prompts': len(requests),
            'input_tokens': {'min': min(ins), 'max': max(ins), 'mean': round(sum(ins) / len(ins), 1),
                             'total': sum(ins)},
            'output_tokens': {'min': min(outs), 'max': max(outs), 'mean': round(sum(outs) / len(outs), 1),
                              'total': sum(outs)}}


# ---- client ------------------------------------------------------------------------------------------


@dataclass
class Result:
    index: int
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried text
    text: str = ''
    prompt_tokens: int | None = None      # from usage
    completion_tokens: int | None = None  # from usage
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def num_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)


def make_payload(req: Request, endpoint: str, model: str, prompt_format: str) -> dict:
    body = {'model': model, 'max_tokens': req.output_len, 'ignore_eos': True, 'temperature': 0.0,
            'stream': True, 'stream_options': {'include_usage': True}}
    if endpoint == 'chat':
        body['messages'] = [{'role': 'user', 'content': req.text}]
    else:
        body['prompt'] = list(req.token_ids) if prompt_format == 'ids' else req.text
    return body


async def send(client, url: str, body: dict, endpoint: str, res: Result) -> None:
    """One streamed request; fills ``res`` (never raises)."""
    res.start = time.perf_counter()
    try:
        async with client.stream('POST', url, json=body) as r:
            if r.status_code != 200:
                res.error = f'HTTP {r.status_code}: {(await r.aread()).decode(errors="replace")[:300]}'
                return
            async for line in r.aiter_lines():
                if not line.startswith('data:'):
                    continue
                data = line[5:].strip()
                if data == '[DONE]':
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get('error'):
                    res.error = f'error event: {json.dumps(chunk["error"])[:300]}'
                    return
                if chunk.get('usage'):
                    res.prompt_tokens = chunk['usage'].get('prompt_tokens')
                    res.completion_tokens = chunk['usage'].get('completion_tokens')
                for choice in chunk.get('choices') or []:
                    delta = choice.get('delta') or {}
                    piece = choice.get('text') if endpoint == 'completions' else delta.get('content')
                    if piece:
                        res.chunk_times.append(now)
                        res.text += piece
                    res.finish_reason = choice.get('finish_reason') or res.finish_reason
    except Exception as e:  # noqa: BLE001  (a dropped connection or bad JSON fails the request, not the run)
        res.error = f'{type(e).__name__}: {e}'
    finally:
        res.end = time.perf_counter()
    if res.error is None and not res.chunk_times:
        res.error = 'the stream carried no text'


async def run_load(base_url: str, model: str, requests: list[Request], args) -> tuple[list[Result], float]:
    """Send ``requests`` at Poisson arrivals (``request_rate``) with at most ``concurrency`` in flight."""
    import httpx
    url = base_url + ('/v1/chat/completions' if args.endpoint == 'chat' else '/v1/completions')
    conc = args.concurrency or len(requests)
    sem = asyncio.Semaphore(conc)
    rng = random.Random(args.seed + 1)
    results = [Result(r.index) for r in requests]
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    headers = {'Authorization': f'Bearer {args.api_key}'} if args.api_key else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        async def one(req: Request, res: Result):
            async with sem:
                await send(client, url, make_payload(req, args.endpoint, model, args.prompt_format),
                           args.endpoint, res)

        tasks = []
        t0 = time.perf_counter()
        for req, res in zip(requests, results):
            tasks.append(asyncio.create_task(one(req, res)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
    return results, max(r.end for r in results) - t0


def summarize(requests: list[Request], results: list[Result], duration: float, endpoint: str) -> dict:
    ok = [r for r in results if r.ok]
    ms = {m: [] for m in METRICS}
    for r in ok:
        ms['ttft'].append((r.chunk_times[0] - r.start) * 1e3)
        ms['e2e'].append((r.end - r.start) * 1e3)
        ms['itl'].extend((b - a) * 1e3 for a, b in zip(r.chunk_times, r.chunk_times[1:]))
        if r.num_tokens > 1:
            ms['tpot'].append((r.chunk_times[-1] - r.chunk_times[0]) * 1e3 / (r.num_tokens - 1))
    out_tokens = sum(r.num_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else requests[r.index].input_len for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    s = {'completed': len(ok), 'failed': len(results) - len(ok), 'duration_s': round(duration, 3),
         'request_throughput': round(len(ok) / duration, 3),
         'output_tokens': out_tokens, 'output_tokens_per_s': round(out_tokens / duration, 2),
         'total_tokens_per_s': round((in_tokens + out_tokens) / duration, 2),
         'tokens_per_chunk': round(out_tokens / chunks, 3) if chunks else None,
         **{f'{m}_ms': percentiles(v, 2) for m, v in ms.items()},
         'errors': sorted({r.error for r in results if r.error})[:5]}
    s['token_check'] = token_check(requests, ok, endpoint)
    return s


def token_check(requests: list[Request], ok: list[Result], endpoint: str) -> dict:
    """Did every server generate exactly max_tokens, and (completions) see the stated prompt length?"""
    no_usage = [r.index for r in ok if r.completion_tokens is None]
    out_bad = [{'request': r.index, 'asked': requests[r.index].output_len, 'got': r.completion_tokens,
                'finish_reason': r.finish_reason}
               for r in ok if r.completion_tokens is not None and r.completion_tokens != requests[r.index].output_len]
    check = {'usage_reported': len(ok) - len(no_usage), 'output_mismatches': len(out_bad), 'examples': out_bad[:5]}
    if no_usage:  # without usage the chunk count stands in (a chunk can carry several tokens)
        chunk_bad = [r.index for r in ok if r.completion_tokens is None
                     and len(r.chunk_times) != requests[r.index].output_len]
        check['no_usage_chunk_count_mismatches'] = len(chunk_bad)
    prompt = [r.prompt_tokens - requests[r.index].input_len for r in ok if r.prompt_tokens is not None]
    if endpoint == 'completions':
        check['prompt_mismatches'] = sum(d != 0 for d in prompt)
    if prompt:
        check['prompt_tokens_minus_stated'] = {'min': min(prompt), 'max': max(prompt)}
    check['ok'] = not (out_bad or check.get('no_usage_chunk_count_mismatches') or check.get('prompt_mismatches'))
    return check


def served_model(base_url: str, api_key: str | None) -> str:
    import httpx
    headers = {'Authorization': f'Bearer {api_key}'} if api_key else None
    data = httpx.get(base_url + '/v1/models', timeout=10, headers=headers).json()
    return data['data'][0]['id']


def bench_server(s: Server, requests: list[Request], warmup: list[Request], args, log_dir: str) -> dict:
    out = {'server': s.name, 'kind': s.kind, 'weights': s.weights, 'base_url': s.base_url}
    if s.cmd:
        out['command'] = ' '.join(shlex.quote(c) for c in s.cmd)
        if s.env:
            out['env'] = s.env
        why = check_runnable(s)
        if why:
            out['error'] = why
            return out
    try:
        t = time.perf_counter()
        if s.cmd:
            start(s, log_dir, args.startup_timeout)
            out['startup_s'] = round(time.perf_counter() - t, 1)
        model = served_model(s.base_url, args.api_key)
        out['model'] = model
        if warmup:
            res, _ = asyncio.run(run_load(s.base_url, model, warmup, args))
            bad = [r.error for r in res if not r.ok]
            if bad:
                raise RuntimeError(f'warmup failed: {bad[0]}')
        cpu0 = tree_cpu_seconds(s.proc.pid) if s.proc else None
        load0, client0 = load_average()[0], time.process_time()
        log(f'{s.name}: {len(requests)} requests')
        results, duration = asyncio.run(run_load(s.base_url, model, requests, args))
        out.update(summarize(requests, results, duration, args.endpoint))
        out['client_cpu_utilization'] = round((time.process_time() - client0) / duration, 3)
        if s.proc:
            out['server_cpu_utilization'] = round((tree_cpu_seconds(s.proc.pid) - cpu0) / duration, 2)
            out['server_peak_rss_mib'] = tree_peak_rss_mib(s.proc.pid)
        out['load_average'] = [load0, load_average()[0]]
        out['sample_text'] = {r.index: r.text[:160] for r in results[:3] if r.ok}
        if out['failed']:
            out['error'] = f'{out["failed"]} of {len(results)} requests failed: {out["errors"][0]}'
    except Exception as e:  # noqa: BLE001  (one server's failure is its block's error; the others still run)
        out['error'] = f'{type(e).__name__}: {e}'
    finally:
        stop(s)
        if s.proc and s.proc.poll() is None:
            out['warning'] = 'server did not stop'
    return out


# ---- report ------------------------------------------------------------------------------------------


def block(r: dict) -> str:
    head = f'==== {r["server"]} ({r["weights"]}) '
    lines = [head + '=' * max(0, 78 - len(head))]
    if 'completed' not in r:
        return '\n'.join(lines + [f'FAILED: {r.get("error")}'])
    lines += [f'{"completed / failed":<34}{r["completed"]} / {r["failed"]}',
              f'{"duration (s)":<34}{r["duration_s"]}',
              f'{"request throughput (req/s)":<34}{r["request_throughput"]}',
              f'{"output tokens/s":<34}{r["output_tokens_per_s"]}',
              f'{"total tokens/s":<34}{r["total_tokens_per_s"]}',
              f'{"":<34}{"mean":>10}{"p50":>10}{"p99":>10}']
    for m, label in (('ttft', 'TTFT (ms)'), ('tpot', 'TPOT (ms)'), ('itl', 'ITL (ms)'), ('e2e', 'end-to-end (ms)')):
        p = r.get(f'{m}_ms') or {}
        lines.append(f'{label:<34}' + ''.join(f'{p.get(k, float("nan")):>10.1f}' for k in ('mean', 'p50', 'p99')))
    tc = r['token_check']
    lines.append(f'{"tokens per chunk":<34}{r["tokens_per_chunk"]}')
    lines.append(f'{"token check":<34}{"ok" if tc["ok"] else "MISMATCH " + json.dumps(tc)}')
    if 'server_cpu_utilization' in r:
        lines.append(f'{"server CPU s / wall s, peak RSS":<34}{r["server_cpu_utilization"]}, '
                     f'{r["server_peak_rss_mib"]} MiB')
    lines.append(f'{"client CPU s / wall s, load avg":<34}{r.get("client_cpu_utilization")}, '
                 f'{r.get("load_average")}')
    if r.get('error'):
        lines.append(f'ERROR: {r["error"]}')
    return '\n'.join(lines)


TABLE_ROWS = [('request throughput (req/s)', lambda r: r['request_throughput'], True),
              ('output tokens/s', lambda r: r['output_tokens_per_s'], True),
              ('total tokens/s', lambda r: r['total_tokens_per_s'], True)]
for _m, _label in (('ttft', 'TTFT'), ('tpot', 'TPOT'), ('itl', 'ITL'), ('e2e', 'end-to-end')):
    for _k in ('mean', 'p50', 'p99'):
        TABLE_ROWS.append((f'{_label} {_k.upper() if _k != "mean" else "mean"} (ms)',
                           lambda r, m=_m, k=_k: (r.get(f'{m}_ms') or {}).get(k), False))


def markdown_table(results: list[dict]) -> str:
    """Servers side by side; a column lmd / peer for every lmd server and peer (higher is better
    for lmd on throughput rows; lower on latency rows)."""
    done = [r for r in results if 'completed' in r]
    if not done:
        return ''
    lmds = [r for r in done if r['kind'] == 'lmd']
    peers = [r for r in done if r['kind'] != 'lmd']
    pairs = [(a, b) for a in lmds for b in peers]
    head = ['figure', *[r['server'] for r in done], *[f'{a["server"]} / {b["server"]}' for a, b in pairs]]
    lines = ['| ' + ' | '.join(head) + ' |', '| --- |' + ' ---: |' * (len(head) - 1),
             '| weights | ' + ' | '.join(r['weights'] for r in done) + ' |' + ' |' * len(pairs)]
    for label, get, _ in TABLE_ROWS:
        vals = [get(r) for r in done]
        cells = [fmt(v) for v in vals] + [fmt_ratio(ratio(get(a), get(b))) for a, b in pairs]
        lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
    lines.append('| token check | ' + ' | '.join('ok' if r['token_check']['ok'] else 'mismatch' for r in done)
                 + ' |' + ' |' * len(pairs))
    return '\n'.join(lines)


def fmt(v) -> str:
    if v is None:
        return ''
    return f'{v:.1f}' if isinstance(v, float) and abs(v) >= 10 else f'{v:.3g}' if isinstance(v, float) else str(v)


def fmt_ratio(v) -> str:
    return '' if v is None else f'{v:.2f}'


def expected_seconds(name: str, wl: dict, warmup: int) -> float:
    if name.startswith('lmd-pytorch'):
        key = 'lmd-pytorch'
    elif name.startswith('lmd'):
        key = 'lmd:hf' if ':hf' in name else 'lmd:gguf'  # TurboMind reads the shipped GGUF as W4A16 by default
    else:
        key = name if name in EXPECTED else 'lmd:gguf'
    startup, prefill, decode = EXPECTED[key]
    return startup + wl['input_tokens']['total'] / prefill + wl['output_tokens']['total'] / decode + 2 * warmup


# ---- main --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--servers', default='lmd',
                   help=f'comma-separated: {", ".join(SERVER_KINDS)}, or NAME=URL (running already); an lmd entry may '
                        'end in :MODEL_FORMAT[:DTYPE], e.g. lmd-turbomind:hf (float32), lmd-turbomind:gguf (W4A16)')
    p.add_argument('--endpoint', choices=('completions', 'chat'), default='completions')
    p.add_argument('--prompt-format', choices=('text', 'ids'), default='text',
                   help="completions prompt: the window's text, or its token ids")
    p.add_argument('--num-prompts', type=int, default=128)
    p.add_argument('--input-len', default='64,512', help='prompt tokens: N or LO,HI (uniform, inclusive)')
    p.add_argument('--output-len', default='64,256', help='output tokens (max_tokens with ignore_eos): N or LO,HI')
    p.add_argument('--request-rate', type=float, default=math.inf, help='Poisson arrivals per second; inf: all at once')
    p.add_argument('--concurrency', type=int, default=16, help='at most this many requests in flight (0: no limit)')
    p.add_argument('--warmup', type=int, default=2, help='short requests before the timed run')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--repeats', type=int, default=1,
                   help='run every server this many times, the order reversed every other time; the table takes '
                        "each server's run with the most output tokens/s and the JSON lists every run")
    p.add_argument('--max-batch-size', type=int, default=16,
                   help="lmd --max-batch-size, llama-server -np, vLLM --max-num-seqs")
    add_engine_args(p, backends=None, threads_help='llama-server / vLLM threads',
                    model_help="lmd's model; its tokenizer makes the prompts and vLLM serves its HF directory")
    p.add_argument('--lmd-backend', choices=('turbomind', 'pytorch'), default='turbomind')
    p.add_argument('--lmd-args', default='', help='more lmd api_server flags, e.g. "--model-format gguf"')
    p.add_argument('--gguf', default=None, help='llama-server model (default: the shipped SmolLM2 Q4_1 GGUF)')
    p.add_argument('--llama-server', default=LLAMA_SERVER)
    add_llamacpp_extra_bufts_arg(p)
    p.add_argument('--llama-args', default='', help='more llama-server flags')
    p.add_argument('--vllm-venv', default=VLLM_VENV)
    p.add_argument('--vllm-dtype', default='float32', choices=('float32', 'bfloat16', 'float16'),
                   help="vLLM's weights and activations; on AVX2 without AVX512-BF16 its oneDNN GEMM takes "
                        'float32 only (16-bit falls back to torch.nn.functional.linear)')
    p.add_argument('--vllm-kv-gib', type=int, default=2, help='VLLM_CPU_KVCACHE_SPACE (GiB of KV cache)')
    p.add_argument('--vllm-args', default='', help='more vLLM server flags')
    p.add_argument('--api-key', default=None)
    p.add_argument('--startup-timeout', type=float, default=600)
    p.add_argument('--request-timeout', type=float, default=900)
    p.add_argument('--json', default=None, metavar='OUT', help='write every result here')
    p.add_argument('--log-dir', default=None, help='server logs (default: a temporary directory, kept)')
    p.add_argument('--dry-run', action='store_true', help='print the plan and its expected duration, start nothing')
    p.add_argument('--quick', action='store_true', help='smoke run: 4 prompts of 32-64 tokens, 8-16 out, 1 warmup')
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.warmup = 4, '32,64', '8,16', 1
    try:
        args.input_lo, args.input_hi = parse_range(args.input_len)
        args.output_lo, args.output_hi = parse_range(args.output_len)
    except ValueError as e:
        p.error(str(e))
    if args.num_prompts < 1:
        p.error(f'--num-prompts must be >= 1, got {args.num_prompts}')
    if not args.request_rate > 0:
        p.error(f'--request-rate must be > 0 (inf: all at once), got {args.request_rate}')
    if args.concurrency < 0:
        p.error(f'--concurrency must be >= 0 (0: no limit), got {args.concurrency}')
    if args.max_batch_size < 1:
        p.error(f'--max-batch-size must be >= 1, got {args.max_batch_size}')
    if args.repeats < 1:
        p.error(f'--repeats must be >= 1, got {args.repeats}')
    args.server_list = [s.strip() for s in args.servers.split(',') if s.strip()]
    bad = [s for s in args.server_list if '=' not in s and s.split(':')[0] not in SERVER_KINDS
           or s.startswith('lmd') and len(s.split(':')) > 3 or not s.startswith('lmd') and ':' in s.split('=')[0]]
    if bad or not args.server_list:
        p.error(f'--servers: unknown {bad}; choose from {", ".join(SERVER_KINDS)} or NAME=URL')
    if args.endpoint == 'chat' and args.prompt_format == 'ids':
        p.error('--prompt-format ids applies to --endpoint completions')
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    if args.gguf is None and any(s.startswith('llama-server') for s in args.server_list):
        from gguf_files import shipped_gguf
        args.gguf = shipped_gguf()
    requests = build_requests(model_dir, args.num_prompts, (args.input_lo, args.input_hi),
                              (args.output_lo, args.output_hi), args.seed)
    warmup = build_warmup(requests, args.warmup, model_dir)
    wl = workload(requests)
    servers = server_specs(args, model_dir)
    est = {s.name: round(expected_seconds(s.name, wl, args.warmup) * args.repeats) for s in servers}
    plan = {'benchmark': 'profile_restful_api', 'argv': sys.argv[1:], 'endpoint': args.endpoint,
            'prompt_format': args.prompt_format if args.endpoint == 'completions' else 'chat messages (text)',
            'request_rate': 'inf' if math.isinf(args.request_rate) else args.request_rate,
            'concurrency': args.concurrency, 'max_batch_size': args.max_batch_size,
            'sampling': 'greedy (temperature 0), ignore_eos, max_tokens = output length', 'workload': wl,
            'expected_duration_s': {**est, 'total': sum(est.values())}, 'cpu_count': os.cpu_count()}
    log(f'workload: {json.dumps(wl["input_tokens"])} in, {json.dumps(wl["output_tokens"])} out; '
        f'expected ~{sum(est.values()) / 60:.1f} min on a quiet machine ({est})')
    if args.dry_run:
        for s in servers:
            print(f'{s.name}: ' + (' '.join(shlex.quote(c) for c in s.cmd) if s.cmd else s.base_url))
        print(json.dumps(plan, indent=2))
        return 0
    log_dir = args.log_dir or tempfile.mkdtemp(prefix='lmd-serving-bench-')
    os.makedirs(log_dir, exist_ok=True)
    runs: list[list[dict]] = [[] for _ in servers]
    for rep, i in alternating(list(range(len(servers))), args.repeats):
        # after the first, a fresh spec (and port) each time: the last run's socket may still be closing
        s = servers[i] if rep == 0 else server_specs(args, model_dir)[i]
        if args.repeats > 1:
            log(f'{s.name}: repeat {rep + 1} of {args.repeats}')
        runs[i].append(bench_server(s, requests, warmup, args, log_dir))
        print(block(runs[i][-1]), flush=True)
    results = [best_run(r) for r in runs]
    table = markdown_table(results)
    print('\n' + table)
    report = {**plan, 'log_dir': log_dir, 'results': results, 'markdown_table': table}
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(report, f, indent=2)
        log(f'wrote {args.json}')
    failed = [r['server'] for r in results if r.get('error') or not r.get('token_check', {}).get('ok')]
    if failed:
        log(f'failed or mismatched: {failed}')
    return 2 if failed else 0


def best_run(runs: list[dict]) -> dict:
    """A server's run with the most output tokens/s (a failed or mismatched run only if every run was), with
    every run's output tokens/s and TTFT P99 beside it when there were several."""
    def good(r):
        return not r.get('error') and r.get('token_check', {}).get('ok')
    best = max(runs, key=lambda r: (bool(good(r)), r.get('output_tokens_per_s') or 0.0))
    if len(runs) == 1:
        return best
    return {**best, 'runs': [{'output_tokens_per_s': r.get('output_tokens_per_s'),
                              'ttft_p99_ms': (r.get('ttft_ms') or {}).get('p99'), 'error': r.get('error')}
                             for r in runs]}


def build_warmup(requests: list[Request], n: int, model_dir: str) -> list[Request]:
    """``n`` short requests (16 prompt tokens, 8 out) so each server has compiled / allocated before timing."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, 'tokenizer.json'))
    return [Request(i, r.token_ids[:16], tok.decode(list(r.token_ids[:16])), 8) for i, r in enumerate(requests[:n])]


if __name__ == '__main__':
    sys.exit(main())
