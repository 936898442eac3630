"""Offline throughput: N requests of varied lengths submitted at once to one engine.

    python benchmark/profile_throughput.py --backend pytorch --num-prompts 64 --max-batch-size 16 --compare-hf
    python benchmark/profile_throughput.py --backend turbomind --dp 2 --num-threads 2   # two replicas


lmd gets every request at t0 through ``AsyncEngine.generate`` (or at most
``--concurrency`` in flight) and batches them continuously with
``PytorchEngineConfig(max_batch_size=...)``. With ``--compare-hf``
transformers ``generate()`` serves the same prompt ids in static batches of
``--hf-batch-size``, one after another, each left-padded to its longest prompt
and run to its longest output (the usual way to batch with HF); every request
is also taken as submitted at t0, so its TTFT includes waiting for earlier
batches. Prompts: prose from ``pydoc_data.topics``, input and output lengths
drawn uniformly from the given ranges with a fixed seed; greedy, EOS ignored,
so each request produces exactly its output length. Each engine runs in its own
subprocess, so peak RSS (ru_maxrss) is that engine's alone. ``--dp N`` runs N replicas of the engine
behind the one AsyncEngine (``lmd.dp_engine``), sharing ``--num-threads`` (N replicas of
num_threads // N threads); ``--tp`` and ``--pp`` go to the engine config as they are.

Prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_engine_args, add_worker_args, build_lmd, cpu_seconds, emit, guarded_worker, lmd_request,
                    load_average, load_prompt_sets, log, peak_rss_mib, ratio, rss_mib, run_worker, save_prompt_sets,
                    set_threads, summarize)
from profile_generation import hf_static_batch, load_hf, pad_token_id
from prompts import Prompt, describe, make_chat_prompts, make_prompts, parse_range, resolve_model_dir

WARMUP = [(32, 8), (48, 8)]  # (input, output) of the untimed requests that run first on each engine


def throughput(timings, prompts: list[Prompt], wall: float) -> dict:
    ins = sum(p.input_len for p in prompts)
    outs = sum(t.num_tokens for t in timings)
    return {
        'wall_s': round(wall, 2),
        'requests_per_s': round(len(prompts) / wall, 4),
        'output_tokens_per_s': round(outs / wall, 2),
        'total_tokens_per_s': round((ins + outs) / wall, 2),
        # EOS ignored: every request made exactly its output_len (chat requests end where the model ends them)
        'exact_token_counts': None if prompts[0].stop_at_eos else all(
            t.num_tokens == p.output_len for t, p in zip(timings, prompts)),
        **summarize(timings),
    }


def lmd_worker(args) -> dict:
    set_threads(args.num_threads)
    warmup, prompts = load_prompt_sets(args.prompt_file)
    t = time.perf_counter()
    engine = build_lmd(args.model_dir, args.backend, args.max_batch_size, args.num_threads, **scaling(args))
    result = {'load_s': round(time.perf_counter() - t, 2), 'rss_after_load_mib': round(rss_mib(), 1),
              'max_batch_size': args.max_batch_size, **scaling(args)}
    concurrency = len(prompts) if args.concurrency == 'all' else int(args.concurrency)
    result['concurrency'] = concurrency

    async def run_all(ps):
        gate = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()

        async def one(p):
            async with gate:
                # every request is submitted at t0 when all are in flight; else when it gets a slot
                return await lmd_request(engine, p, t0 if concurrency >= len(ps) else None)
        return list(await asyncio.gather(*(one(p) for p in ps))), time.perf_counter() - t0

    loop = asyncio.new_event_loop()
    loop.run_until_complete(run_all(warmup))
    log(f'lmd: {len(prompts)} requests, max_batch_size {args.max_batch_size}, concurrency {concurrency}')
    ranks0 = rank_stats(engine)
    pool0 = kernel_pool_stats(args.backend)
    cpu0 = cpu_seconds()
    timings, wall = loop.run_until_complete(run_all(prompts))
    result.update(throughput(timings, prompts, wall))
    pool1 = kernel_pool_stats(args.backend)
    # the kernels' thread team over the run: regions run, how many ran on their caller alone, the
    # stalls and cuts of the team (thread_pool.h)
    result['kernel_pool'] = {k: pool1[k] - pool0[k] for k in ('regions', 'inline_regions', 'stalls', 'shrinks')}
    if ranks0 is not None:
        result['communication'] = communication(ranks0, rank_stats(engine), wall)
    result['cpu_utilization'] = round((cpu_seconds() - cpu0) / wall, 2)
    stats = engine.engine.stats()
    result['engine_stats'] = {'num_preemptions': stats.num_preemptions, 'num_total_blocks': stats.num_total_blocks}
    if args.dp > 1:  # how the requests spread over the replicas
        result['engine_stats']['replica_prompt_tokens'] = [s.num_prompt_tokens for s in engine.replica_stats()]
    engine.close()
    result['peak_rss_mib'] = round(peak_rss_mib(), 1)
    log(f"lmd: {result['wall_s']}s, {result['output_tokens_per_s']} output tok/s")
    return result


def kernel_pool_stats(backend: str) -> dict:
    """The thread pool counters of the extension whose kernels ``backend`` runs: TurboMind links its own
    copy of the kernel library (``_turbomind``), the PyTorch engine calls ``lmd.kernels``."""
    if backend == 'turbomind':
        from lmd.turbomind import _turbomind
        return _turbomind.thread_pool_stats()
    from lmd.kernels import _kernels
    return _kernels.thread_pool_stats()


def rank_stats(engine) -> list[dict] | None:
    """The PyTorch engine's per-rank step and communication counters (``ModelRunner.parallel_stats``), when
    it runs more than one rank."""
    if getattr(engine.engine, 'executor', None) is None:  # one rank: TurboMind, or the PyTorch engine alone
        return None
    return engine.engine.call_on_engine_thread(lambda e: e.runner.parallel_stats())


def communication(before: list[dict], after: list[dict], wall: float) -> dict:
    """What the timed run's steps spent communicating, per rank: milliseconds per step in all-reduces and
    all-gathers (tensor parallelism) and blocked in sends and receives (pipeline stages), beside the step's
    wall time; both include waiting for a slower rank."""
    steps = max(after[0]['steps'] - before[0]['steps'], 1)

    def per_step(key: str) -> list[float]:
        return [round(1000 * (a[key] - b[key]) / steps, 3) for a, b in zip(after, before)]
    return {'steps': steps, 'step_ms': round(1000 * wall / steps, 3),
            'all_reduce_ms_per_step': per_step('all_reduce_s'), 'send_recv_ms_per_step': per_step('send_recv_s')}


def scaling(args) -> dict:
    """The engine config's settings the flags asked for beside the batch and threads (pp and int8_activations
    only where set: each is one engine's)."""
    return dict(tp=args.tp, dp=args.dp, **({'pp': args.pp} if args.pp != 1 else {}),
                **({'int8_activations': True} if args.int8_activations else {}))


def hf_worker(args) -> dict:
    set_threads(args.num_threads)
    warmup, prompts = load_prompt_sets(args.prompt_file)
    t = time.perf_counter()
    model = load_hf(args.model_dir)
    import transformers
    result = {'load_s': round(time.perf_counter() - t, 2), 'rss_after_load_mib': round(rss_mib(), 1),
              'transformers': transformers.__version__,
              'attn_implementation': model.config._attn_implementation,
              'batch_size': args.hf_batch_size, 'order': args.hf_order}
    hf_static_batch(model, warmup, args.pad_id)
    order = list(range(len(prompts)))
    if args.hf_order == 'sorted':  # similar lengths together: less padding, fewer wasted steps
        order.sort(key=lambda i: (prompts[i].input_len, prompts[i].output_len))
    timings = [None] * len(prompts)
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    steps = padded = 0
    for k in range(0, len(order), args.hf_batch_size):
        idx = order[k:k + args.hf_batch_size]
        batch = [prompts[i] for i in idx]
        for i, timing in zip(idx, hf_static_batch(model, batch, args.pad_id, t0)):
            timings[i] = timing
        steps += max(timings[i].num_tokens for i in idx) * len(batch)  # the batch's steps, every row
        padded += max(p.input_len for p in batch) * len(batch)
        log(f'hf: batch {k // args.hf_batch_size} done at {time.perf_counter() - t0:.1f}s')
    wall = time.perf_counter() - t0
    result.update(throughput(timings, prompts, wall))
    result['cpu_utilization'] = round((cpu_seconds() - cpu0) / wall, 2)
    # what static batching computes beyond the requests' own tokens
    result['computed_output_tokens'] = steps
    result['computed_prompt_tokens_with_padding'] = padded
    result['peak_rss_mib'] = round(peak_rss_mib(), 1)
    log(f"hf: {result['wall_s']}s, {result['output_tokens_per_s']} output tok/s")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p)
    p.add_argument('--workload', choices=('prose', 'chat'), default='prose',
                   help='prose: windows of varied lengths, EOS ignored; chat: short one-turn chat requests through '
                        'the chat template, ending at EOS (up to --output-tokens HI, default 128)')
    p.add_argument('--num-prompts', type=int, default=64)
    p.add_argument('--input-tokens', default='32,512', help='prompt length range LO,HI (inclusive) or N')
    p.add_argument('--output-tokens', help='output length range LO,HI (inclusive) or N (default: 16,256; chat: 128)')
    p.add_argument('--max-batch-size', type=int, default=16, help="lmd engine's max_batch_size (per replica)")
    p.add_argument('--dp', type=int, default=1, help='data-parallel replicas sharing --num-threads')
    p.add_argument('--tp', type=int, default=1, help='tensor parallel ranks (engine config tp)')
    p.add_argument('--pp', type=int, default=1, help='pipeline stages (PyTorch engine config pp)')
    p.add_argument('--int8-activations', action='store_true',
                   help='TurboMind: 4-bit and Q8_0 matmuls on activations quantized to int8 per 32 (inexact)')
    p.add_argument('--concurrency', default='all', help="requests in flight at once: 'all' or a number")
    p.add_argument('--compare-hf', action='store_true', help='also run transformers static batches')
    p.add_argument('--hf-batch-size', type=int, default=16)
    p.add_argument('--hf-order', choices=('submission', 'sorted'), default='submission',
                   help='how requests are grouped into HF batches: as submitted, or sorted by length')
    p.add_argument('--skip-lmd', action='store_true', help='run only the transformers side (needs --compare-hf)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--quick', action='store_true',
                   help='smoke run: 16 prompts of 32-128 tokens, 16-64 out, max batch 8, HF batch 8')
    p.add_argument('--timeout', type=float, default=3600, help='seconds each engine worker may run')
    add_worker_args(p, ('lmd', 'hf'), '--prompt-file')
    p.add_argument('--pad-id', type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.output_tokens is None:
        args.output_tokens = '128' if args.workload == 'chat' else '16,256'
    if args.quick:
        args.num_prompts, args.input_tokens, args.output_tokens = 16, '32,128', '16,64'
        args.max_batch_size = args.hf_batch_size = 8
    try:
        args.input_range, args.output_range = parse_range(args.input_tokens), parse_range(args.output_tokens)
    except ValueError as e:
        p.error(str(e))
    if args.concurrency != 'all' and not (args.concurrency.isdigit() and int(args.concurrency) >= 1):
        p.error(f"--concurrency takes 'all' or a positive integer, got {args.concurrency!r}")
    if min(args.num_prompts, args.max_batch_size, args.hf_batch_size, args.dp, args.tp, args.pp) < 1:
        p.error('--num-prompts, --max-batch-size, --hf-batch-size, --dp, --tp and --pp must be >= 1')
    if args.pp != 1 and args.backend == 'turbomind':
        p.error('--pp is a PyTorch engine setting: use --backend pytorch')
    if args.int8_activations and args.backend != 'turbomind':
        p.error('--int8-activations is a TurboMind setting: use --backend turbomind')
    if args.skip_lmd and not args.compare_hf:
        p.error('--skip-lmd leaves nothing to run without --compare-hf')
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        guarded_worker(lmd_worker if args.worker == 'lmd' else hf_worker, args)
        return 0
    load0 = load_average()
    try:
        model_dir = resolve_model_dir(args.model)
    except Exception as e:
        print(json.dumps({'benchmark': 'profile_throughput', 'error': f'{type(e).__name__}: {e}'}))
        return 2
    if args.workload == 'chat':
        prompts = make_chat_prompts(model_dir, args.num_prompts, args.output_range[1])
    else:
        prompts = make_prompts(model_dir, args.num_prompts, args.input_range, args.output_range, seed=args.seed)
    warmup = [Prompt(make_prompts(model_dir, 1, (n_in, n_in), (n_out, n_out), seed=1000 + i)[0].token_ids, n_out)
              for i, (n_in, n_out) in enumerate(WARMUP)]
    report = {
        'benchmark': 'profile_throughput', 'backend': args.backend, 'model': args.model, 'model_dir': model_dir,
        'num_threads': args.num_threads, 'cpu_count': os.cpu_count(), 'seed': args.seed, **scaling(args),
        'workload': describe(prompts),
        'method': 'all requests submitted at t0 (lmd: AsyncEngine.generate streaming, continuous batching; '
                  f'transformers: generate() static batches of {args.hf_batch_size} in {args.hf_order} order, '
                  'left padding, each run to its longest output); TTFT and e2e are measured from t0; '
                  'TPOT = (last - first token) / (tokens - 1); output_tokens counts each request\'s own tokens; '
                  f'greedy, {"stopping at EOS" if args.workload == "chat" else "EOS ignored"}, float32; each '
                  'engine in its own subprocess after 2 untimed requests',
    }
    with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:
        prompt_file = f.name
    save_prompt_sets(prompt_file, [warmup, prompts])
    wargv = ['--backend', args.backend, '--num-threads', str(args.num_threads), '--model-dir', model_dir,
             '--prompt-file', prompt_file, '--pad-id', str(pad_token_id(model_dir)),
             '--max-batch-size', str(args.max_batch_size), '--concurrency', args.concurrency,
             '--dp', str(args.dp), '--tp', str(args.tp), '--pp', str(args.pp),
             *(['--int8-activations'] if args.int8_activations else []),
             '--hf-batch-size', str(args.hf_batch_size), '--hf-order', args.hf_order]
    script = os.path.abspath(__file__)
    try:
        if not args.skip_lmd:
            log(f'lmd ({args.backend}) worker starting')
            report['lmd'] = run_worker(script, 'lmd', wargv, args.timeout)
        if args.compare_hf and 'error' in report.get('lmd', {}):
            report['hf'] = {'skipped': 'lmd failed, so there is nothing to compare with'}
        elif args.compare_hf:
            log('transformers worker starting')
            report['hf'] = run_worker(script, 'hf', wargv, args.timeout)
    finally:
        os.unlink(prompt_file)
    lmd, hf = report.get('lmd', {}), report.get('hf', {})
    if args.compare_hf and lmd and 'error' not in lmd and 'error' not in hf:
        report['ratios_lmd_over_hf'] = {
            'output_tokens_per_s': ratio(lmd['output_tokens_per_s'], hf['output_tokens_per_s']),
            'requests_per_s': ratio(lmd['requests_per_s'], hf['requests_per_s']),
            'ttft_speedup_p50': ratio(hf['ttft_s']['p50'], lmd['ttft_s']['p50']),
            'tpot_speedup_p50': ratio(hf['tpot_s']['p50'], lmd['tpot_s']['p50']),
            'peak_rss': ratio(lmd['peak_rss_mib'], hf['peak_rss_mib']),
        }
        measured = report['ratios_lmd_over_hf']['output_tokens_per_s']
        report['targets'] = {'throughput_vs_hf_static_batches': {'target': 3.0, 'measured': measured,
                                                                  'met': bool(measured and measured >= 3.0)}}
    emit(report, load0)
    return 2 if 'error' in lmd or 'error' in hf else 0


if __name__ == '__main__':
    sys.exit(main())
