"""What the Python layers above an engine cost in batch-1 decode: the same request timed at the
engine, through AsyncEngine, and through ``pipeline(...).stream_infer``, side by side.

    python benchmark/stack_overhead.py                              # both engines, the embedded SmolLM2
    python benchmark/stack_overhead.py --backends turbomind --tokens 256 --repeats 5

For each engine, in one process, one AsyncEngine and the pipeline over it; each repeat runs the
three paths one after another on the same prompt ids (greedy, ``ignore_eos``):

- ``engine``: ``Engine.add_request`` with a plain callback (the engine's own thread calls it);
- ``async_engine``: ``AsyncEngine.generate`` on an event loop of this thread (no pipeline);
- ``pipeline``: ``pipeline.stream_infer`` (the pipeline's loop thread, then this thread).

Decode tokens/s counts the tokens after the first over the time from the first to the last.
``ctx_switches_per_token``: the process's voluntary context switches per generated token, a
count of the thread wakes each path adds (on a 2-core machine each woken Python thread takes a
core from the kernels' thread team for a moment). ``overhead`` is 1 - pipeline / engine (and
async_engine / engine), from the medians.

Prints one JSON object on stdout (the CPU's ``lscpu`` model and flags, the load average before
and after, every run and the medians); progress goes to stderr. These machines are shared: run
it a few times, or quiet, before trusting a few percent.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DEFAULT_THREADS, RequestTiming, build_lmd, cpu_info, decode_rate, emit,  # noqa: E402
                    load_average, log)

PROMPT = 'The history of the printing press begins'
PATHS = ('engine', 'async_engine', 'pipeline')


def ctx_switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def run_engine(async_engine, ids: list[int], n: int, sid: int) -> RequestTiming:
    """The request at the engine: its thread calls a plain callback, which stamps and signals."""
    from lmd.engine import EngineRequest, SamplingParams
    done = threading.Event()
    timing = RequestTiming(time.perf_counter(), n)
    count = 0

    def on_output(out):
        nonlocal count
        count += len(out.token_ids)
        timing.add(time.perf_counter(), count)
        if out.finish_reason is not None:
            done.set()

    async_engine.engine.add_request(EngineRequest(sid, tuple(ids), SamplingParams(max_new_tokens=n)), on_output)
    done.wait()
    return timing


def run_async_engine(async_engine, ids: list[int], n: int, gen) -> RequestTiming:
    async def main():
        timing = RequestTiming(time.perf_counter(), n)
        async for r in async_engine.generate(None, gen_config=gen, input_ids=ids, do_preprocess=False):
            timing.add(time.perf_counter(), r.generate_token_len)
        return timing
    return asyncio.run(main())


def run_pipeline(pipe, n: int, gen) -> RequestTiming:
    timing = RequestTiming(time.perf_counter(), n)
    for r in pipe.stream_infer(PROMPT, gen_config=gen, do_preprocess=False):
        timing.add(time.perf_counter(), r.generate_token_len)
    return timing


def measure(backend: str, args) -> dict:
    from lmd.api import Pipeline
    from lmd.messages import GenerationConfig

    log(f'{backend}: loading {args.model}')
    async_engine = build_lmd(args.model, backend, 1, args.num_threads)
    pipe = Pipeline(async_engine)
    try:
        ids = async_engine.encode(PROMPT, do_preprocess=False)
        gen = GenerationConfig(max_new_tokens=args.tokens, ignore_eos=True, do_sample=False)
        run_engine(async_engine, ids, 8, 1)  # warm up every path once
        run_async_engine(async_engine, ids, 8, GenerationConfig(max_new_tokens=8, ignore_eos=True))
        run_pipeline(pipe, 8, GenerationConfig(max_new_tokens=8, ignore_eos=True))
        runs = {p: [] for p in PATHS}
        for rep in range(args.repeats):
            for path in PATHS:
                switches = ctx_switches()
                if path == 'engine':
                    timing = run_engine(async_engine, ids, args.tokens, 100 + rep)
                elif path == 'async_engine':
                    timing = run_async_engine(async_engine, ids, args.tokens, gen)
                else:
                    timing = run_pipeline(pipe, args.tokens, gen)
                switches = ctx_switches() - switches
                assert timing.num_tokens == args.tokens, (path, timing.num_tokens)
                runs[path].append({'decode_tokens_per_s': round(decode_rate([timing]), 2),
                                   'ctx_switches_per_token': round(switches / timing.num_tokens, 2)})
                log(f'{backend} {path:12s} {runs[path][-1]}')
    finally:
        pipe.close()
    median = {p: round(statistics.median(r['decode_tokens_per_s'] for r in runs[p]), 2) for p in PATHS}
    switches = {p: round(statistics.median(r['ctx_switches_per_token'] for r in runs[p]), 2) for p in PATHS}
    return {
        'median_decode_tokens_per_s': median,
        'median_ctx_switches_per_token': switches,
        'overhead': {p: round(1 - median[p] / median['engine'], 4) for p in PATHS[1:]},
        'spread': {p: [min(r['decode_tokens_per_s'] for r in runs[p]), max(r['decode_tokens_per_s'] for r in runs[p])]
                   for p in PATHS},
        'runs': runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--backends', default='turbomind,pytorch', help='comma-separated: turbomind, pytorch')
    p.add_argument('--model', default='smollm2', help="model path or 'smollm2' (the embedded default, 4-bit GGUF)")
    p.add_argument('--num-threads', type=int, default=DEFAULT_THREADS)
    p.add_argument('--tokens', type=int, default=128, help='tokens generated per request')
    p.add_argument('--repeats', type=int, default=3, help='runs of each path, interleaved')
    args = p.parse_args()
    backends = [b.strip() for b in args.backends.split(',') if b.strip()]
    for b in backends:
        if b not in ('turbomind', 'pytorch'):
            p.error(f'--backends: unknown engine {b!r} (turbomind, pytorch)')
    load_start = load_average()
    report = {'benchmark': 'stack_overhead', 'model': args.model, 'tokens': args.tokens, 'repeats': args.repeats,
              'num_threads': args.num_threads, 'cpu': cpu_info(), 'results': {}}
    for b in backends:
        report['results'][b] = measure(b, args)
    emit(report, load_start)


if __name__ == '__main__':
    main()
