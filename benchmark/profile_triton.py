"""Triton vs api_server: the same prompts at the same concurrency through lmd's Triton models and its api_server.

    python benchmark/profile_triton.py --paths api_server,ensemble,lmd_model --concurrency 16 --num-prompts 96

Three ways to reach the same engine (``--backend``, ``--model``, ``--max-batch-size``):

- ``api_server``: ``python -m lmd.serve.api_server``, started and measured by
  ``profile_restful_api.py``'s own machinery (``/v1/chat/completions``,
  streaming, the prompt as one user message);
- ``ensemble`` and ``lmd_model``: one ``tritonserver`` on a model repository that
  ``lmd.serve.triton.build_repository`` writes for the same model and backend;
  the client is ``tritonclient.grpc.aio``, one gRPC stream per request, the
  prompt as ``prompt`` (which gets the chat template, as the chat endpoint does).

The workload is profile_restful_api's (``build_requests``: prose windows of
exact token lengths, seeded), so every path gets the same prompts, the same
``--concurrency`` (closed-loop clients), greedy decoding and ``max_tokens`` =
the request's output length with ``ignore_eos``, after the same warmup. Paths
run one after another, never at the same time: api_server first (the
reference), then the Triton paths, which share one tritonserver start.

Counting output tokens: the api_server reports ``usage.completion_tokens``;
Triton returns text only, so a Triton request counts ``max_tokens`` when it
finished with ``length`` (anything else is a mismatch), and the text is
re-tokenized with the model's tokenizer as a check that it is about that long
(``retokenized`` in the token check: adjacent pieces can merge when encoded
again, so a few tokens fewer pass; the api_server's answers go through the same
count as a calibration, and every answer is compared with the api_server's).

Per path: TTFT (sent -> first response with text), TPOT, ITL, end-to-end, output
tokens/s over the run's wall time, mean / P50 / P99 (profile_restful_api's
``summarize`` and ``block``), then a markdown table with a ``PATH / api_server``
column per Triton path and the issue's target: Triton output tokens/s within 10%
of the api_server's. ``--json OUT`` writes everything. Exits 2 when a path failed
or a token check did not hold (a missed target is reported, not an error).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_restful_api as rest
import serving_servers as servers
from common import add_engine_args, load_average, log, ratio
from prompts import parse_range, resolve_model_dir

PATHS = ('api_server', 'ensemble', 'lmd_model')
TRITON_PATHS = ('ensemble', 'lmd_model')
PATH_MODELS = {'ensemble': ('preprocessing', 'engine', 'postprocessing'), 'lmd_model': ('lmd_model',)}
TARGET_RATIO = 0.90  # the issue: the Triton paths within 10% of the api_server's output tokens/s
# Re-encoding an answer's text can give fewer tokens than were generated (adjacent pieces, e.g. runs of
# spaces in code, merge into one token; seen: 36 for 41, with the api_server's usage saying 41), rarely more.
# Allowed differences, each at least N tokens or the fraction of max_tokens:
RETOKENIZE_BELOW = (4, 0.25)
RETOKENIZE_ABOVE = (2, 0.05)


# ---- Triton client ---------------------------------------------------------------------------------


@dataclass
class TritonResult(rest.Result):
    retokenized: int | None = None  # tokens in the answer's text, encoded again with the model's tokenizer


def triton_inputs(req: rest.Request) -> list:
    """The request as the ensemble / lmd_model inputs: the prompt text as one user message, greedy
    (temperature 0, as the api_server path sends), exactly ``output_len`` tokens (``ignore_eos``)."""
    import numpy as np
    import tritonclient.grpc.aio as grpcclient

    def tensor(name: str, dtype: str, value) -> object:
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.asarray([value], dtype=object if dtype == 'BYTES' else None))
        return t
    return [tensor('prompt', 'BYTES', req.text.encode()),
            tensor('max_tokens', 'INT32', np.int32(req.output_len)),
            tensor('temperature', 'FP32', np.float32(0.0)),
            tensor('ignore_eos', 'BOOL', True)]


def decode_first(result, name: str) -> str:
    """The first element of a BYTES output as text ('' when the response lacks it)."""
    arr = result.as_numpy(name)
    return '' if arr is None or arr.size == 0 else arr.reshape(-1)[0].decode('utf-8', errors='replace')


async def send_triton(client, model: str, req: rest.Request, res: TritonResult, timeout: float | None = None) -> None:
    """One request on its own gRPC stream, closed after ``timeout`` seconds; fills ``res`` (never raises).
    The response whose ``finish_reason`` is set is the last: its arrival ends the request."""
    async def one_request():
        yield {'model_name': model, 'inputs': triton_inputs(req), 'request_id': f'bench-{req.index}'}

    res.start = time.perf_counter()
    stream = None
    try:
        stream = client.stream_infer(one_request(), stream_timeout=timeout)
        async for result, error in stream:
            now = time.perf_counter()
            if error is not None:
                res.error = f'{model}: {error}'
                break
            piece = decode_first(result, 'text')
            if piece:
                res.chunk_times.append(now)
                res.text += piece
            reason = decode_first(result, 'finish_reason')
            if reason and res.finish_reason is None:
                res.finish_reason, res.end = reason, now
    except Exception as e:  # noqa: BLE001  (a dropped stream fails the request, not the run)
        res.error = f'{model}: {describe_error(e)}'
    finally:
        if res.error is not None and stream is not None:
            stream.cancel()
        res.end = res.end or time.perf_counter()
    if res.error is None and res.finish_reason is None:
        res.error = f'{model}: the stream closed without a response carrying finish_reason'
    elif res.error is None and not res.chunk_times:
        res.error = f'{model}: the stream carried no text'


def describe_error(e: Exception) -> str:
    """One line for a failed stream: a gRPC error's status and details, else the exception."""
    if callable(getattr(e, 'code', None)) and callable(getattr(e, 'details', None)):
        return f'gRPC {e.code().name}: {e.details()}'
    return f'{type(e).__name__}: {e}'


async def run_triton_load(url: str, model: str, requests: list[rest.Request], concurrency: int,
                          timeout: float | None = None) -> tuple[list[TritonResult], float]:
    """Send ``requests`` with at most ``concurrency`` in flight (0: all at once) over one channel;
    a request still streaming after ``timeout`` seconds fails."""
    import tritonclient.grpc.aio as grpcclient
    sem = asyncio.Semaphore(concurrency or len(requests))
    results = [TritonResult(r.index) for r in requests]
    client = grpcclient.InferenceServerClient(url)
    try:
        async def one(req: rest.Request, res: TritonResult):
            async with sem:
                await send_triton(client, model, req, res, timeout)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(req, res) for req, res in zip(requests, results)))
    finally:
        await client.close()
    return results, max(r.end for r in results) - t0


def count_tokens(results: list[TritonResult], requests: list[rest.Request], tokenizer) -> None:
    """Triton sends text: a request that finished with ``length`` generated ``max_tokens`` (ignore_eos);
    its text encoded again gives ``retokenized``, the check that it is about that long."""
    for r in results:
        if r.error is None:
            r.retokenized = len(tokenizer.encode(r.text, add_special_tokens=False).ids)
            r.completion_tokens = (requests[r.index].output_len if r.finish_reason == 'length'
                                   else r.retokenized)


def retokenize_check(requests: list[rest.Request], texts: dict[int, str], tokenizer) -> dict:
    """How far each answer's re-encoded length is from max_tokens; ``ok`` when all are within
    RETOKENIZE_BELOW / RETOKENIZE_ABOVE (too short: tokens went missing; too long: text was repeated)."""
    diffs, outside = [], []
    for index, text in sorted(texts.items()):
        asked = requests[index].output_len
        d = len(tokenizer.encode(text, add_special_tokens=False).ids) - asked
        diffs.append(d)
        n, frac = RETOKENIZE_BELOW if d < 0 else RETOKENIZE_ABOVE
        if abs(d) > max(n, frac * asked):
            outside.append({'request': index, 'asked': asked, 'retokenized': asked + d})
    return {'checked': len(diffs), 'minus_asked': {'min': min(diffs), 'max': max(diffs)} if diffs else None,
            'outside_slack': len(outside), 'examples': outside[:5], 'ok': bool(diffs) and not outside}


# ---- paths -----------------------------------------------------------------------------------------


def rest_args(args) -> argparse.Namespace:
    """profile_restful_api's arguments for the api_server path: the chat endpoint (Triton's ``prompt``
    gets the chat template too), the same workload, concurrency, engine and limits."""
    fmt = f':{args.model_format}' if args.model_format else ''
    argv = ['--servers', f'lmd-{args.backend}{fmt}', '--endpoint', 'chat', '--num-prompts', str(args.num_prompts),
            '--input-len', args.input_len, '--output-len', args.output_len, '--concurrency', str(args.concurrency),
            '--warmup', str(args.warmup), '--seed', str(args.seed), '--model', args.model,
            '--max-batch-size', str(args.max_batch_size), '--startup-timeout', str(args.startup_timeout),
            '--request-timeout', str(args.request_timeout)]
    return rest.parse_args(argv)


def bench_api_server(args, requests, warmup, model_dir: str, log_dir: str) -> dict:
    """Start lmd's api_server as profile_restful_api does, time it, stop it."""
    ra = rest_args(args)
    server = servers.server_specs(ra, model_dir)[0]
    info = {'command': ' '.join(server.cmd), 'weights': server.weights}
    try:
        t = time.perf_counter()
        servers.start(server, log_dir, args.startup_timeout)
        info.update(startup_s=round(time.perf_counter() - t, 1), log=server.log_path)
        model = rest.served_model(server.base_url, None)
        r = bench_path('api_server', lambda reqs: asyncio.run(rest.run_load(server.base_url, model, reqs, ra)),
                       server.proc.pid, requests, warmup)
    except Exception as e:  # noqa: BLE001  (the Triton paths still run)
        r = {'error': f'api_server: {type(e).__name__}: {e}'}
    finally:
        servers.stop(server)
    return {'server': 'api_server', 'path': 'api_server', 'kind': 'lmd', 'base_url': server.base_url, **info, **r}


def bench_path(path: str, load, pid: int | None, requests, warmup, tokenizer=None, peak_rss=None) -> dict:
    """Warm ``path`` up, then time ``requests`` on it; ``load(requests)`` returns (results, seconds).
    With ``tokenizer`` (Triton: text only) the output tokens are counted by ``count_tokens``. Server CPU
    covers ``pid``'s process tree; ``peak_rss()`` (default: that whole tree's) the memory."""
    out = {}
    try:
        if warmup:
            res, _ = load(warmup)
            bad = [r.error or 'no text' for r in res if not r.ok]
            if bad:
                raise RuntimeError(f'warmup failed: {bad[0]}')
        cpu0 = servers.tree_cpu_seconds(pid) if pid else None
        load0, client0 = load_average()[0], time.process_time()
        log(f'{path}: {len(requests)} requests')
        results, duration = load(requests)
        if tokenizer is not None:
            count_tokens(results, requests, tokenizer)
        out.update(rest.summarize(requests, results, duration, 'chat'))
        out['client_cpu_utilization'] = round((time.process_time() - client0) / duration, 3)
        if pid:
            out['server_cpu_utilization'] = round((servers.tree_cpu_seconds(pid) - cpu0) / duration, 2)
            out['server_peak_rss_mib'] = peak_rss() if peak_rss else servers.tree_peak_rss_mib(pid)
        out['load_average'] = [load0, load_average()[0]]
        out['texts'] = {r.index: r.text for r in results if r.ok}
        out['sample_text'] = {r.index: r.text[:160] for r in results[:3] if r.ok}
        if out['failed']:
            out['error'] = f'{out["failed"]} of {len(results)} requests failed: {out["errors"][0]}'
    except Exception as e:  # noqa: BLE001  (one path's failure is its block's error; the others still run)
        out['error'] = f'{path}: {type(e).__name__}: {e}'
    return out


def stub_model(pid: int) -> str | None:
    """The Triton model a Python-backend stub process serves (its argv[1] is REPO/MODEL/VERSION/model.py)."""
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            argv = f.read().decode(errors='replace').split('\0')
    except OSError:
        return None
    if len(argv) < 2 or not argv[0].endswith('triton_python_backend_stub'):
        return None
    return os.path.basename(os.path.dirname(os.path.dirname(argv[1])))


def triton_path_peak_rss_mib(pid: int, path: str) -> float:
    """Peak RSS of tritonserver itself plus the stubs of ``path``'s models: the other path's models share the
    server but sit idle, and the api_server holds one engine, not two."""
    stubs = [p for p in servers.process_tree(pid)[1:] if stub_model(p) in PATH_MODELS[path]]
    return servers.peak_rss_mib([pid] + stubs)


def build_triton_repository(args, repo: str) -> None:
    from lmd.serve.triton import build_repository
    flags = {'max_batch_size': args.max_batch_size}
    if args.model_format:
        flags['model_format'] = args.model_format
    build_repository(args.model, repo, backend=args.backend, postprocessing_instances=args.postprocessing_instances,
                     **flags)


def start_triton(args, log_dir: str):
    """Build the repository and start tritonserver on free ports; returns the running server."""
    from lmd.serve.triton_server import TritonServer
    repo = os.path.join(log_dir, 'triton_repository')
    log(f'building the Triton model repository in {repo}')
    build_triton_repository(args, repo)
    server = TritonServer(repo, http_port=servers.free_port(), grpc_port=servers.free_port(),
                          metrics_port=servers.free_port(), log_path=os.path.join(log_dir, 'tritonserver.log'))
    log(f'starting tritonserver on {repo}')
    return server.start(args.startup_timeout)


def bench_triton(args, requests, warmup, log_dir: str, tokenizer):
    """Yield a result for every Triton path in ``args.path_list``, one after another, on one tritonserver
    (built and started here unless ``--triton-url``; stopped once the last path is done)."""
    paths = [p for p in args.path_list if p in TRITON_PATHS]
    if not paths:
        return
    server = None
    weights = f'{args.model}, {args.backend}, model_format {args.model_format or "auto"}, via tritonserver'
    try:
        if args.triton_url:
            url, pid, startup = args.triton_url, None, None
        else:
            t = time.perf_counter()
            server = start_triton(args, log_dir)
            url, pid, startup = server.grpc_url, server.proc.pid, round(time.perf_counter() - t, 1)
    except Exception as e:  # noqa: BLE001  (TritonNotInstalled, a repository or startup error: say which)
        for p in paths:
            yield {'server': p, 'path': p, 'kind': 'triton', 'weights': weights,
                   'error': f'tritonserver: {type(e).__name__}: {e}'}
        return
    try:
        for p in paths:
            r = {'server': p, 'path': p, 'kind': 'triton', 'base_url': url, 'weights': weights,
                 **bench_path(p, lambda reqs, p=p: asyncio.run(run_triton_load(url, p, reqs, args.concurrency,
                                                                               args.request_timeout)),
                              pid, requests, warmup, tokenizer,
                              peak_rss=(lambda p=p: triton_path_peak_rss_mib(pid, p)) if pid else None)}
            if startup is not None:
                r['startup_s'] = startup  # build + start, shared by the Triton paths
            if server is not None:
                r['log'] = server.log_path
            yield r
    finally:
        if server is not None:
            server.stop()


# ---- report ----------------------------------------------------------------------------------------


def add_checks(r: dict, requests: list[rest.Request], tokenizer, ref_texts: dict | None) -> None:
    """The re-tokenized length of every answer of path ``r`` (a Triton path's check; on the api_server,
    whose usage counts exactly, the calibration), and how many of its answers equal the api_server's
    (greedy, same prompts: a different answer hints at another template, or float noise)."""
    texts = r.get('texts')
    if not texts:
        return
    r['token_check']['retokenized'] = retokenize_check(requests, texts, tokenizer)
    if r['path'] in TRITON_PATHS and not r['token_check']['retokenized']['ok']:
        r['token_check']['ok'] = False
    if ref_texts is not None and r['path'] != 'api_server':
        same = sum(texts.get(i) == t for i, t in ref_texts.items())
        r['same_text_as_api_server'] = f'{same} of {len(ref_texts)}'


def path_block(r: dict) -> str:
    """profile_restful_api's block, plus the re-tokenized lengths and the answers' agreement."""
    lines = [rest.block(r)]
    rt = (r.get('token_check') or {}).get('retokenized')
    if rt and rt['minus_asked']:
        lines.append(f'{"re-tokenized - max_tokens":<34}{rt["minus_asked"]["min"]} .. {rt["minus_asked"]["max"]}')
    if 'same_text_as_api_server' in r:
        lines.append(f'{"same answer as api_server":<34}{r["same_text_as_api_server"]}')
    return '\n'.join(lines)


def ratio_table(results: list[dict]) -> str:
    """profile_restful_api's table with a ``PATH / api_server`` column for every Triton path (above 1
    is better for Triton on throughput rows, below 1 on latency rows)."""
    as_pairs = [{**r, 'kind': 'reference' if r['path'] == 'api_server' else 'lmd'} for r in results]
    return rest.markdown_table(as_pairs)


def target(results: list[dict]) -> dict:
    """Each Triton path's output tokens/s over the api_server's, against TARGET_RATIO."""
    ref = next((r for r in results if r['path'] == 'api_server' and 'completed' in r), None)
    out = {}
    for r in results:
        if r['path'] in TRITON_PATHS and ref is not None and 'completed' in r:
            x = ratio(r['output_tokens_per_s'], ref['output_tokens_per_s'], 3)
            out[r['path']] = {'output_tokens_per_s_ratio': x, 'met': x is not None and x >= TARGET_RATIO}
    return out


def target_line(t: dict) -> str:
    if not t:
        return 'target: needs api_server and a Triton path measured'
    parts = [f'{p} {v["output_tokens_per_s_ratio"]:.2f}x ({"met" if v["met"] else "MISSED"})' for p, v in t.items()]
    return f'target: output tokens/s >= {TARGET_RATIO:.2f}x api_server at this concurrency: ' + ', '.join(parts)


# ---- main ------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--paths', default=','.join(PATHS), help=f'comma-separated: {", ".join(PATHS)}')
    add_engine_args(p, backends=('turbomind', 'pytorch'), threads=False,
                    model_help='the model every path serves; its tokenizer makes the prompts')
    p.add_argument('--model-format', default=None, help='the engine\'s --model-format on every path (default: auto)')
    p.add_argument('--num-prompts', type=int, default=128)
    p.add_argument('--input-len', default='64,512', help='prompt tokens: N or LO,HI (uniform, inclusive)')
    p.add_argument('--output-len', default='64,256', help='output tokens (max_tokens with ignore_eos): N or LO,HI')
    p.add_argument('--concurrency', type=int, default=16, help='at most this many requests in flight (0: no limit)')
    p.add_argument('--warmup', type=int, default=2, help='short requests on each path before its timed run')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--max-batch-size', type=int, default=16, help="the engine's max_batch_size on every path")
    p.add_argument('--postprocessing-instances', type=int, default=1,
                   help="instances of the ensemble's postprocessing model (build_repository's postprocessing_instances)")
    p.add_argument('--triton-url', default=None, metavar='HOST:GRPC_PORT',
                   help='measure a tritonserver already running (its repository from lmd serve triton) instead of '
                        'building and starting one')
    p.add_argument('--startup-timeout', type=float, default=600)
    p.add_argument('--request-timeout', type=float, default=900)
    p.add_argument('--json', default=None, metavar='OUT', help='write every result here')
    p.add_argument('--log-dir', default=None, help='server logs and the Triton repository (default: a temporary '
                                                    'directory, kept)')
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
    if args.concurrency < 0:
        p.error(f'--concurrency must be >= 0 (0: no limit), got {args.concurrency}')
    if args.max_batch_size < 1:
        p.error(f'--max-batch-size must be >= 1, got {args.max_batch_size}')
    if args.postprocessing_instances < 1:
        p.error(f'--postprocessing-instances must be >= 1, got {args.postprocessing_instances}')
    args.path_list = [s.strip() for s in args.paths.split(',') if s.strip()]
    bad = [s for s in args.path_list if s not in PATHS]
    if bad or not args.path_list:
        p.error(f'--paths: unknown {bad}; choose from {", ".join(PATHS)}')
    if len(set(args.path_list)) != len(args.path_list):
        p.error(f'--paths: {args.paths} names a path twice')
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    requests = rest.build_requests(model_dir, args.num_prompts, (args.input_lo, args.input_hi),
                                   (args.output_lo, args.output_hi), args.seed)
    warmup = rest.build_warmup(requests, args.warmup, model_dir)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, 'tokenizer.json'))
    wl = rest.workload(requests)
    log(f'workload: {json.dumps(wl["input_tokens"])} in, {json.dumps(wl["output_tokens"])} out; paths {args.path_list}')
    log_dir = args.log_dir or tempfile.mkdtemp(prefix='lmd-triton-bench-')
    os.makedirs(log_dir, exist_ok=True)
    results, ref_texts = [], None
    api = [bench_api_server(args, requests, warmup, model_dir, log_dir)] if 'api_server' in args.path_list else []
    for r in itertools.chain(api, bench_triton(args, requests, warmup, log_dir, tokenizer)):
        add_checks(r, requests, tokenizer, ref_texts)
        if r['path'] == 'api_server':
            ref_texts = r.get('texts')
        r.pop('texts', None)
        results.append(r)
        print(path_block(r), flush=True)
    table, tgt = ratio_table(results), target(results)
    print('\n' + table + '\n\n' + target_line(tgt))
    report = {'benchmark': 'profile_triton', 'argv': sys.argv[1:] if argv is None else argv,
              'paths': args.path_list, 'backend': args.backend, 'model': args.model,
              'concurrency': args.concurrency, 'max_batch_size': args.max_batch_size,
              'postprocessing_instances': args.postprocessing_instances,
              'sampling': 'greedy (temperature 0), ignore_eos, max_tokens = output length',
              'workload': wl, 'cpu_count': os.cpu_count(), 'log_dir': log_dir, 'results': results,
              'markdown_table': table, 'target': tgt}
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(report, f, indent=2)
        log(f'wrote {args.json}')
    failed = [r['path'] for r in results if r.get('error') or not r.get('token_check', {}).get('ok')]
    if failed:
        log(f'failed or mismatched: {failed}')
    return 2 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
