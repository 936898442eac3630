"""What every benchmark needs: the engine's arguments and the engine, the machine it ran on,
the stopwatch and the figures it gives, workers in their own process, and the JSON report.

Each script measures its own thing (``profile_generation.py``: latency at fixed batch sizes,
``profile_throughput.py``: a stream of requests, ``compare_llamacpp.py``: lmd beside
llama.cpp, ...) with these parts, so that a figure means the same in every script:

- ``add_engine_args`` / ``engine_config`` / ``build_lmd``: ``--model``, ``--backend``, ``--num-threads``
  and the ``AsyncEngine`` they describe.
- ``RequestTiming`` / ``summarize`` / ``decode_rate`` / ``percentiles``: one request's stamps and
  TTFT / TPOT / ITL / end-to-end over many; ``lmd_request`` / ``lmd_batch`` stamp lmd's stream.
- ``cpu_info`` / ``load_average`` / ``measure_bandwidth`` / ``rss_mib`` / ``cpu_seconds``: what the
  machine was and did while the figures were taken (these machines are shared: the load average
  says whether a figure can be trusted).
- ``run_worker`` / ``guarded_worker``: each engine in its own subprocess, so its peak RSS is its own;
  the worker writes its result (or a one-line error) to a JSON file the parent reads; ``alternating``
  repeats the sides in alternating order and ``best_of_runs`` folds a side's runs into one report.
- ``emit``: the one JSON object on stdout, with the load average before and after.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback

from prompts import Prompt

DEFAULT_THREADS = min(2, os.cpu_count() or 1)  # the cores of these machines

# ---- the engine ------------------------------------------------------------------------------------------


def add_engine_args(p: argparse.ArgumentParser, backends: tuple[str, ...] | None = ('pytorch', 'turbomind'),
                    model_help: str = "model path or 'smollm2' (the embedded default)", threads: bool = True,
                    threads_help: str | None = None) -> None:
    """``--backend`` (the first of ``backends`` is the default; None: the script picks the engine),
    ``--model`` and, where the script sets them (``threads``), ``--num-threads``."""
    if backends:
        p.add_argument('--backend', choices=backends, default=backends[0])
    p.add_argument('--model', default='smollm2', help=model_help)
    if threads:
        p.add_argument('--num-threads', type=int, default=DEFAULT_THREADS, help=threads_help)


def add_worker_args(p: argparse.ArgumentParser, workers, *extra: str) -> None:
    """The hidden flags a script's parent hands its worker subprocess (``run_worker``)."""
    p.add_argument('--worker', choices=workers, help=argparse.SUPPRESS)
    p.add_argument('--result-file', help=argparse.SUPPRESS)
    p.add_argument('--model-dir', help=argparse.SUPPRESS)
    for flag in extra:
        p.add_argument(flag, help=argparse.SUPPRESS)


def set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


def engine_config(backend: str, max_batch_size: int, num_threads: int, **config):
    """``backend``'s engine config with ``max_batch_size`` and ``num_threads`` (and whatever else ``config`` says)."""
    from lmd.messages import PytorchEngineConfig, TurbomindEngineConfig
    kind = TurbomindEngineConfig if backend == 'turbomind' else PytorchEngineConfig
    return kind(max_batch_size=max_batch_size, num_threads=num_threads, **config)


def build_lmd(model_dir: str, backend: str, max_batch_size: int, num_threads: int, **config):
    """An ``AsyncEngine`` on ``backend`` with ``engine_config``'s config."""
    from lmd.async_engine import AsyncEngine
    return AsyncEngine(model_dir, backend=backend,
                       backend_config=engine_config(backend, max_batch_size, num_threads, **config))


# ---- the stopwatch -----------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f'[{time.strftime("%H:%M:%S")}] {msg}', file=sys.stderr, flush=True)


def percentiles(values: list[float], digits: int = 4) -> dict:
    """p50, p99 (linear interpolation), mean, min, max of ``values``."""
    import numpy as np
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {'p50': round(float(np.percentile(a, 50)), digits), 'p99': round(float(np.percentile(a, 99)), digits),
            'mean': round(float(a.mean()), digits), 'min': round(float(a.min()), digits),
            'max': round(float(a.max()), digits), 'count': int(a.size)}


def ratio(a, b, digits: int = 2):
    return round(a / b, digits) if a and b else None


class RequestTiming:
    """Wall-clock stamps of one request: submitted, and each time new tokens arrived."""

    def __init__(self, submit: float, output_len: int):
        self.submit = submit
        self.output_len = output_len
        self.stamps: list[float] = []   # when a piece arrived
        self.counts: list[int] = []     # tokens generated so far at that stamp

    def add(self, t: float, count: int) -> None:
        self.stamps.append(t)
        self.counts.append(count)

    @property
    def num_tokens(self) -> int:
        return self.counts[-1] if self.counts else 0

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.submit

    @property
    def e2e(self) -> float:
        return self.stamps[-1] - self.submit

    @property
    def tpot(self) -> float | None:
        """Mean gap per token after the first one; None for a 1-token answer."""
        later = self.num_tokens - self.counts[0]
        return (self.stamps[-1] - self.stamps[0]) / later if later > 0 else None

    def itls(self) -> list[float]:
        """Inter-token gaps; a piece that brought k tokens counts as k gaps of 1/k of its wait."""
        out = []
        for i in range(1, len(self.stamps)):
            k = self.counts[i] - self.counts[i - 1]
            if k > 0:
                out.extend([(self.stamps[i] - self.stamps[i - 1]) / k] * k)
        return out


def summarize(timings: list[RequestTiming]) -> dict:
    """TTFT / TPOT / ITL / end-to-end distributions over a set of requests."""
    tpots = [t.tpot for t in timings if t.tpot is not None]
    return {
        'ttft_s': percentiles([t.ttft for t in timings]),
        'tpot_s': percentiles(tpots),
        'itl_s': percentiles([g for t in timings for g in t.itls()]),
        'e2e_s': percentiles([t.e2e for t in timings]),
    }


def decode_rate(timings: list[RequestTiming]) -> float:
    """Tokens after each request's first, per second, from the earliest first token to the last token."""
    later = sum(t.num_tokens - t.counts[0] for t in timings)
    window = max(t.stamps[-1] for t in timings) - min(t.stamps[0] for t in timings)
    return later / window if window > 0 else float('nan')


def concurrent_round(run, prompts: list[Prompt], name: str) -> dict:
    """``run(prompts)`` (all at once: their RequestTimings) as one round: output and total tokens/s over its
    wall time, and the requests' latencies (``summarize``)."""
    t0 = time.perf_counter()
    timings = run(prompts)
    wall = max(t.stamps[-1] for t in timings) - t0
    tokens = sum(t.num_tokens for t in timings)
    log(f'{name} {len(prompts)} concurrent: {tokens / wall:.1f} output tok/s')
    return {'num_requests': len(prompts), 'wall_s': round(wall, 3), 'output_tokens': tokens,
            'output_tokens_per_s': round(tokens / wall, 2),
            'total_tokens_per_s': round((tokens + sum(p.input_len for p in prompts)) / wall, 2),
            'exact_token_counts': all(t.num_tokens == t.output_len for t in timings), **summarize(timings)}


async def lmd_request(engine, prompt: Prompt, submit: float | None = None) -> RequestTiming:
    """Stream one request through ``AsyncEngine.generate`` and stamp every Response."""
    from lmd.messages import GenerationConfig
    gen = GenerationConfig(max_new_tokens=prompt.output_len, ignore_eos=not prompt.stop_at_eos, do_sample=False)
    timing = RequestTiming(time.perf_counter() if submit is None else submit, prompt.output_len)
    async for r in engine.generate(None, gen_config=gen, input_ids=list(prompt.token_ids),
                                   stream_response=True, do_preprocess=False):
        timing.add(time.perf_counter(), r.generate_token_len)
    return timing


async def lmd_batch(engine, prompts: list[Prompt]) -> list[RequestTiming]:
    """All ``prompts`` submitted at the same instant; the engine batches them as it likes."""
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(lmd_request(engine, p, t0) for p in prompts)))


# ---- the machine ---------------------------------------------------------------------------------------------


def cpu_info() -> dict:
    """The CPU as lscpu names it, with its flags, the cores this process may run on, and the kernel
    library's instruction set in use (``kernels_isa``: 'avx512', 'avx2' or 'ref'; LMD_CPU_ISA caps it,
    and engine workers started from here inherit the cap)."""
    from lmd.kernels import ops
    info = {'cpus': os.cpu_count(), 'affinity': sorted(os.sched_getaffinity(0)), 'kernels_isa': ops.isa(),
            'avx512_vnni': ops.avx512_vnni()}
    try:
        out = subprocess.run(['lscpu'], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return {**info, 'lscpu_error': str(e)}
    for line in out.splitlines():
        key, _, value = line.partition(':')
        if key.strip() in ('Model name', 'Flags', 'Hypervisor vendor', 'Thread(s) per core'):
            info[key.strip().lower().replace(' ', '_').replace('(s)', 's')] = value.strip()
    return info


def add_llamacpp_extra_bufts_arg(p: argparse.ArgumentParser) -> None:
    """``--llamacpp-extra-bufts``, read by ``llamacpp_extra_bufts``."""
    p.add_argument('--llamacpp-extra-bufts', choices=('auto', 'on', 'off'), default='auto',
                   help="llama.cpp's repacked / AMX weight buffers; auto: off on CPUs with AMX, where llama.cpp "
                        '(llama-cpp-python 0.3.36 and its llama-server) crashes in them on quantized types')


def llamacpp_extra_bufts(setting: str = 'auto') -> bool:
    """Whether llama.cpp may repack weights into its extra (CPU-specific / AMX) buffers: 'on', 'off', or
    'auto': not on a CPU with AMX, where llama-cpp-python 0.3.36's and its llama-server's repack / AMX
    buffers crash (SIGSEGV) on every quantized type. Off is ``use_extra_bufts = False`` in
    llama-cpp-python's model params and ``--no-repack`` for llama-server."""
    if setting != 'auto':
        return setting == 'on'
    with open('/proc/cpuinfo') as f:
        return 'amx_tile' not in f.read().split()


def load_average() -> list[float]:
    """The 1/5/15-minute load: other work on the same cores skews every figure."""
    return [round(x, 2) for x in os.getloadavg()]


def rss_mib() -> float:
    """This process's resident set now (VmRSS), MiB."""
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) / 1024
    return float('nan')


def peak_rss_mib() -> float:
    """This process's peak resident set (ru_maxrss is KiB on Linux), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def best_seconds(fn, repeats: int, min_time: float = 0.0) -> float:
    """The least seconds a call of ``fn`` took, over ``repeats`` timings after one warm-up call; each timing
    calls it until ``min_time`` has passed (at least once) and divides by the calls."""
    fn()
    best = float('inf')
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        best = min(best, elapsed / n)
    return best


def measure_bandwidth(num_threads: int, gib: float = 1.5, repeats: int = 5) -> dict:
    """Read bandwidth with ``num_threads`` threads: best of ``repeats`` sums over a ``gib`` float32 tensor.

    Also a GEMV over a same-sized matrix (the access pattern of batch-1 decode) and a numpy copy.
    """
    import numpy as np
    import torch
    torch.set_num_threads(num_threads)
    n = int(gib * 2**30) // 4
    x = torch.ones(n, dtype=torch.float32)
    best = float('inf')
    for _ in range(repeats):
        t = time.perf_counter()
        torch.sum(x)
        best = min(best, time.perf_counter() - t)
    read_bw = x.numel() * 4 / best
    cols = 4096
    w = x[: n - n % cols].view(-1, cols)
    v = torch.ones(cols, dtype=torch.float32)
    best_mv = float('inf')
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mv(w, v)
        best_mv = min(best_mv, time.perf_counter() - t)
    gemv_bw = w.numel() * 4 / best_mv
    del x, w
    a = np.ones(n // 2, dtype=np.float32)
    b = np.empty_like(a)
    best_cp = float('inf')
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(b, a)
        best_cp = min(best_cp, time.perf_counter() - t)
    copy_bw = 2 * a.nbytes / best_cp  # bytes read + bytes written
    return {'read_gb_per_s': round(read_bw / 1e9, 2), 'gemv_gb_per_s': round(gemv_bw / 1e9, 2),
            'copy_gb_per_s': round(copy_bw / 1e9, 2),
            'method': f'best of {repeats}: torch.sum over {gib} GiB float32 ({num_threads} threads) for read; '
                      f'torch.mv over the same bytes for gemv; numpy copy of {gib / 2} GiB counts read+write'}


# ---- workers: one engine per subprocess ----------------------------------------------------------------------


def load_prompt_sets(path: str) -> list[list[Prompt]]:
    with open(path) as f:
        data = json.load(f)
    return [[Prompt(tuple(p['ids']), p['out'], p.get('eos', False)) for p in s] for s in data]


def save_prompt_sets(path: str, sets: list[list[Prompt]]) -> None:
    with open(path, 'w') as f:
        json.dump([[{'ids': list(p.token_ids), 'out': p.output_len, 'eos': p.stop_at_eos} for p in s] for s in sets], f)


def run_worker(script: str, worker: str, argv: list[str], timeout: float | None = None) -> dict:
    """Run ``script`` as a subprocess worker; its JSON result, or {'error': ...}."""
    with tempfile.NamedTemporaryFile('r', suffix='.json', delete=False) as f:
        out_path = f.name
    env = dict(os.environ)
    threads = argv[argv.index('--num-threads') + 1] if '--num-threads' in argv else None
    if threads:
        env.setdefault('OMP_NUM_THREADS', threads)
    cmd = [sys.executable, script, '--worker', worker, '--result-file', out_path] + argv
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, check=False)
        with open(out_path) as f:
            text = f.read()
        if text:
            return json.loads(text)
        return {'error': f'{worker} worker exited with status {proc.returncode} and no result'}
    except subprocess.TimeoutExpired:
        return {'error': f'{worker} worker ran past {timeout:.0f}s and was stopped'}
    finally:
        os.unlink(out_path)


def guarded_worker(fn, args) -> None:
    """Run a worker body and write its result (or a one-line error) to --result-file."""
    try:
        result = fn(args)
    except NotImplementedError as e:  # an engine that has not landed: say so, no traceback
        result = {'error': f'NotImplementedError: {e}'}
    except Exception as e:
        traceback.print_exc()
        result = {'error': f'{type(e).__name__}: {e}'}
    with open(args.result_file, 'w') as f:
        json.dump(result, f)


def alternating(items: list, repeats: int):
    """``items`` ``repeats`` times over, the order reversed every other time: a drift of the machine's speed
    during the run then favours none of them. Yields (repeat, item)."""
    for rep in range(repeats):
        for item in items if rep % 2 == 0 else items[::-1]:
            yield rep, item


def best_of_runs(runs: list[dict], figures: dict, listed: dict | None = None) -> dict:
    """One side's report from several runs of it on a machine whose speed drifts: the first successful
    run's, each section in ``figures`` (name -> the figure a run got there, higher better) taken from the
    run where that figure was best, and ``runs``: every run's figures (and the values ``listed`` takes
    from it: name -> getter). All runs failed: the first."""
    good = [r for r in runs if 'error' not in r]
    if len(runs) == 1 or not good:
        return runs[0]
    best = dict(good[0])
    for section, value in figures.items():
        scored = [r for r in good if value(r) is not None]
        if scored:
            best[section] = max(scored, key=value)[section]
    getters = {**figures, **(listed or {})}
    best['runs'] = [{name: get(r) for name, get in getters.items()} if 'error' not in r else r for r in runs]
    return best


# ---- the report ---------------------------------------------------------------------------------------------


def emit(report: dict, load_start: list[float] | None = None, indent: int = 2) -> None:
    """Print ``report`` as the one JSON object on stdout, with the CPU it ran on (``cpu_info``)
    unless it has it; with ``load_start``, the load average before and after the run goes in last."""
    report.setdefault('cpu', cpu_info())
    if load_start is not None:
        report['load_average'] = {'start': load_start, 'end': load_average()}
    print(json.dumps(report, indent=indent))
