"""Batch-1 decode at the TurboMind engine, this build of lmd beside another one, runs alternating.

For finding where a speed change came from: build the other commit's wheel and unpack it, e.g.

    git worktree add /tmp/old <commit>
    pip wheel --no-deps --no-build-isolation -w /tmp/old-wheel /tmp/old
    mkdir /tmp/old-pkg && cd /tmp/old-pkg && unzip -q /tmp/old-wheel/lmd-*.whl
    python benchmark/build_ab.py --other /tmp/old-pkg

Each run is a fresh process that loads SmolLM2 (TurboMind's default: the shipped 4-bit GGUF) and
times ``--repeats`` requests of 128 prompt ids and ``--tokens`` new ones at the engine (a plain
callback, token ids only: no Python layer above it), so the two builds see the same machine state
as nearly as two processes can. The other build is imported from its folder with this one's
editable-install finder taken out of ``sys.meta_path``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from common import add_worker_args, cpu_info, emit, guarded_worker, load_average, log, run_worker

PROMPT_IDS = tuple(range(1000, 1128))


def decode_worker(args) -> dict:
    if args.other:
        sys.meta_path[:] = [f for f in sys.meta_path if 'ScikitBuild' not in type(f).__name__]
        sys.path.insert(0, args.other)
    from lmd.async_engine import AsyncEngine
    from lmd.engine import EngineRequest, SamplingParams
    from lmd.messages import TurbomindEngineConfig
    import lmd

    engine = AsyncEngine(args.model, backend='turbomind', backend_config=TurbomindEngineConfig(
        max_batch_size=1, session_len=1024, num_threads=args.num_threads)).engine

    def rate(n: int, session_id: int) -> float:
        done, stamps = threading.Event(), []

        def on_output(out):
            stamps.append(time.perf_counter())
            if out.finish_reason is not None:
                done.set()

        engine.add_request(EngineRequest(session_id, PROMPT_IDS, SamplingParams(max_new_tokens=n,
                                                                               stop_token_ids=())), on_output)
        done.wait()
        return (len(stamps) - 2) / (stamps[-1] - stamps[1])  # from the second token: decode only

    try:
        rate(8, 1)  # warm up
        return {'lmd': lmd.__file__, 'tokens_per_s': [round(rate(args.tokens, 10 + i), 2)
                                                      for i in range(args.repeats)]}
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--other', help='folder holding the other build (an unpacked wheel: <folder>/lmd)')
    p.add_argument('--model', default='smollm2')
    p.add_argument('--num-threads', type=int, default=2)
    p.add_argument('--tokens', type=int, default=128)
    p.add_argument('--repeats', type=int, default=5, help='requests timed per process')
    p.add_argument('--rounds', type=int, default=2, help='processes per build, alternating')
    add_worker_args(p, ['decode'])
    args = p.parse_args()
    if args.worker:
        return guarded_worker(decode_worker, args)
    if not args.other:
        p.error('--other is required (a folder with another build of lmd)')
    load_start = load_average()
    common = ['--model', args.model, '--num-threads', str(args.num_threads), '--tokens', str(args.tokens),
              '--repeats', str(args.repeats)]
    runs = {'this': [], 'other': []}
    for r in range(args.rounds):
        for build in ('other', 'this'):
            extra = ['--other', args.other] if build == 'other' else []
            result = run_worker(__file__, 'decode', common + extra, timeout=900)
            if 'error' in result:
                raise SystemExit(f'{build} build: {result["error"]}')
            log(f'round {r} {build}: {result["tokens_per_s"]} ({result["lmd"]})')
            runs[build] += result['tokens_per_s']
    emit({'cpu': cpu_info(), 'num_threads': args.num_threads, 'other': args.other,
          'median_tokens_per_s': {b: round(statistics.median(v), 2) for b, v in runs.items()},
          'runs': runs}, load_start)


if __name__ == '__main__':
    main()
