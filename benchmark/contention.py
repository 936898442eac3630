"""Batch-1 decode beside a busy process: how much of its quiet rate an engine keeps when
another process takes a core.

    python benchmark/contention.py                          # TurboMind, the embedded SmolLM2 (4-bit)
    python benchmark/contention.py --backends turbomind,pytorch --tokens 64 --repeats 3

For each engine, in one run and one process: batch-1 greedy decode tokens/s (``ignore_eos``)
quiet, then with a busy loop (``python -c 'while True: pass'``) started beside it, once free to
move and once pinned to CPU 0, then quiet again (the two quiet figures show the drift of the
machine while it ran). ``kept`` is the contended rate over the first quiet one: with two cores and
one taken, one core's share is 0.5. A run slower than ``--max-seconds`` is cut short and its rate
read from the tokens it had.

Prints one JSON object on stdout (the CPU's ``lscpu`` model and flags, the load average before
and after, every run's rate and the median per condition); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_engine_args, build_lmd, cpu_info, emit, load_average, log  # noqa: E402

BUSY_LOOP = 'while True: pass'
PROMPT_IDS = list(range(1000, 1032))  # any ids: the prompt only has to be the same every run


class BusyLoop:
    """A python busy loop in its own process, pinned to ``cpu`` or free to move (None)."""

    def __init__(self, cpu: int | None):
        pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        self.proc = subprocess.Popen([sys.executable, '-c', BUSY_LOOP], preexec_fn=pin)
        time.sleep(0.5)  # let it start and the scheduler place it

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def decode_once(engine, tokens: int, max_seconds: float) -> dict:
    """One greedy request of ``tokens`` new tokens; tokens/s after the first one."""
    from lmd.engine import EngineRequest
    from lmd.messages import GenerationConfig
    gen = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, do_sample=False)
    session_id = engine.next_session_id()
    request = EngineRequest(session_id=session_id, token_ids=tuple(PROMPT_IDS),
                            sampling=engine.sampling_params(gen, None))
    stamps: list[tuple[float, int]] = []
    done = threading.Event()
    count = 0

    def on_output(out) -> None:
        nonlocal count
        count += len(out.token_ids)
        stamps.append((time.perf_counter(), count))
        if out.finish_reason is not None:
            done.set()

    engine.engine.add_request(request, on_output)
    cut = not done.wait(max_seconds)
    if cut:
        engine.engine.abort(session_id)
        done.wait(30)
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    rate = (n1 - n0) / (t1 - t0) if t1 > t0 else float('nan')
    return {'tok_s': round(rate, 2), 'tokens': n1, 'cut_short': cut}


def measure(engine, condition: str, args) -> dict:
    busy = None if condition.startswith('quiet') else BusyLoop(0 if condition == 'busy_pinned_cpu0' else None)
    try:
        runs = [decode_once(engine, args.tokens, args.max_seconds) for _ in range(args.repeats)]
    finally:
        if busy:
            busy.stop()
    rates = [r['tok_s'] for r in runs]
    row = {'condition': condition, 'tok_s': round(statistics.median(rates), 2), 'runs': runs,
           'load_average': load_average()}
    log(f'  {condition:18s} {row["tok_s"]:8.2f} tok/s  runs {rates}')
    return row


def run_backend(backend: str, args) -> dict:
    engine = build_lmd(args.model, backend, 1, args.num_threads)
    try:
        log(f'{backend}: warmup')
        decode_once(engine, 8, args.max_seconds)
        rows = [measure(engine, c, args) for c in ('quiet', 'busy', 'busy_pinned_cpu0', 'quiet_again')]
    finally:
        engine.close()
    quiet = rows[0]['tok_s']
    for row in rows[1:]:
        row['kept'] = round(row['tok_s'] / quiet, 3) if quiet else None
    result = {'backend': backend, 'num_threads': args.num_threads, 'rows': rows}
    if backend == 'pytorch':  # the kernels' pool of lmd.kernels (TurboMind's engine links its own)
        from lmd import kernels
        result['kernel_pool'] = kernels._kernels.thread_pool_stats()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, backends=None, model_help="model path or 'smollm2' (the embedded default, 4-bit)")
    p.add_argument('--backends', default='turbomind', help='comma-separated: turbomind, pytorch')
    p.add_argument('--tokens', type=int, default=64, help='new tokens per run')
    p.add_argument('--repeats', type=int, default=3, help='runs per condition (the median is reported)')
    p.add_argument('--max-seconds', type=float, default=20.0, help='a run is cut short after this long')
    args = p.parse_args()

    load_start = load_average()
    report = {'cpu': cpu_info(), 'model': args.model, 'tokens': args.tokens, 'repeats': args.repeats,
              'busy_loop': BUSY_LOOP, 'engines': [run_backend(b.strip(), args) for b in args.backends.split(',')]}
    emit(report, load_start)


if __name__ == '__main__':
    main()
