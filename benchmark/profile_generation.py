"""Latency of one engine at fixed batch sizes: TTFT, TPOT, end-to-end, decode tokens/s.

    python benchmark/profile_generation.py --backend pytorch --batch-sizes 1,16 --compare-hf

Each round submits ``batch`` requests of exactly ``--prompt-tokens`` prompt ids
at once and generates exactly ``--output-tokens`` tokens each (greedy,
``ignore_eos``). lmd is timed through ``AsyncEngine.generate`` streaming: the
first Response is the time to first token (TTFT), the later ones give the time
per output token (TPOT). With ``--compare-hf`` transformers ``generate()`` runs
the same prompt ids (static batch, left padding) with a streamer that stamps
every step. Each engine runs in its own subprocess so its peak RSS is its own.
Every round uses fresh prompts, so no prefix cache can help.

The batch-1 roofline: decode reads every weight once per token, so
tokens/s <= read bandwidth / weight bytes (bandwidth measured here, in-script).

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
from common import (RequestTiming, add_engine_args, add_worker_args, build_lmd, cpu_seconds, decode_rate, emit,
                    guarded_worker, lmd_batch, load_average, load_prompt_sets, log, measure_bandwidth, peak_rss_mib,
                    percentiles, ratio, rss_mib, run_worker, save_prompt_sets, set_threads, summarize)
from prompts import Prompt, describe, make_prompts, resolve_model_dir

WARMUP_TOKENS = 8  # output tokens of a warmup round

# ---- transformers (profile_throughput.py runs it too) ---------------------------------------


def load_hf(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # generate exactly max_new_tokens, like lmd's ignore_eos: no EOS id means nothing stops a row early
    # (a chat workload's prompts put it back: hf_static_batch)
    model.lmd_eos_token_id = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    return model


class StepStamps:
    """A transformers streamer that stamps each put(): the prompt first, then one put per decode step."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_static_batch(model, prompts: list[Prompt], pad_id: int, t0: float | None = None) -> list[RequestTiming]:
    """One ``generate()`` over ``prompts`` left-padded to the longest, run to the longest output.

    A request's n-th token is ready at step n of the batch, so its TTFT/TPOT/e2e come from the
    step stamps; tokens a request gets beyond its own ``output_len`` are wasted work. Chat prompts
    (``stop_at_eos``) end at the model's EOS, stamped when it comes but not counted, as lmd counts; the
    batch runs until every row has ended.
    """
    import torch
    longest = max(p.input_len for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - p.input_len:] = torch.tensor(p.token_ids)
        mask[i, longest - p.input_len:] = 1
    steps = max(p.output_len for p in prompts)
    chat = prompts[0].stop_at_eos
    eos = getattr(model, 'lmd_eos_token_id', None) if chat else None
    streamer = StepStamps()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                             pad_token_id=pad_id, streamer=streamer, eos_token_id=eos)
    if not chat and out.shape[1] - longest != steps:
        raise RuntimeError(f'transformers generated {out.shape[1] - longest} tokens, asked for {steps}')
    token_stamps = streamer.stamps[1:]  # [0] is the prompt itself
    eos_ids = set([eos] if isinstance(eos, int) else eos or [])
    timings = []
    for i, p in enumerate(prompts):
        n_out, end = p.output_len, None
        if chat:  # the tokens before its first EOS; the EOS's step ends the request
            new = out[i, longest:].tolist()
            end = next((j for j, t in enumerate(new) if t in eos_ids), None)
            n_out = len(new) if end is None else end
        t = RequestTiming(start if t0 is None else t0, n_out)
        for n in range(1, n_out + 1):
            t.add(token_stamps[n - 1], n)
        if end is not None:
            t.add(token_stamps[end], n_out)
        timings.append(t)
    return timings


# ---- the worker: one engine per subprocess ----------------------------------------------------


def worker_main(args) -> dict:
    """Run one engine over the prompt sets: set k is round k's batch (warmup sets first)."""
    set_threads(args.num_threads)
    plan = json.loads(args.plan)  # {"batch_sizes": [...], "warmup": w, "rounds": r}
    sets = load_prompt_sets(args.prompt_file)
    t_load = time.perf_counter()
    if args.worker == 'lmd':
        engine = build_lmd(args.model_dir, args.backend, max(plan['batch_sizes']), args.num_threads)
        loop = asyncio.new_event_loop()

        def run(ps):
            return loop.run_until_complete(lmd_batch(engine, ps))
    else:
        model = load_hf(args.model_dir)

        def run(ps):
            return hf_static_batch(model, ps, args.pad_id)
    result = {'load_s': round(time.perf_counter() - t_load, 2), 'rss_after_load_mib': round(rss_mib(), 1)}
    if args.worker == 'hf':
        import transformers
        result['transformers'] = transformers.__version__
        result['attn_implementation'] = model.config._attn_implementation
    it = iter(sets)
    t_run, cpu_run = time.perf_counter(), cpu_seconds()
    for bs in plan['batch_sizes']:
        for _ in range(plan['warmup']):  # full batch and prompt length, few tokens: warms every code path
            run([Prompt(p.token_ids, min(p.output_len, WARMUP_TOKENS)) for p in next(it)])
        rounds, walls, rates, exact = [], [], [], True
        for r in range(plan['rounds']):
            ps = next(it)
            timings = run(ps)
            rounds.extend(timings)
            walls.append(max(t.stamps[-1] for t in timings) - min(t.submit for t in timings))
            rates.append(decode_rate(timings))
            exact &= all(t.num_tokens == t.output_len for t in timings)
            log(f'{args.worker} batch {bs} round {r}: wall {walls[-1]:.2f}s decode {rates[-1]:.1f} tok/s')
        out_tokens = sum(t.num_tokens for t in rounds)
        entry = summarize(rounds)
        entry.update({
            'batch_size': bs,
            'decode_tokens_per_s': percentiles(rates, 2),
            'output_tokens_per_s': round(out_tokens / sum(walls), 2),
            'round_wall_s': [round(w, 3) for w in walls],
            'exact_token_counts': exact,
        })
        result[f'batch_{bs}'] = entry
    wall = time.perf_counter() - t_run
    result['run_wall_s'] = round(wall, 2)
    # under num_threads: the cores were shared with other work, or ops ran on one thread (fp32 GEMV does)
    result['cpu_utilization'] = round((cpu_seconds() - cpu_run) / wall, 2)
    result['peak_rss_mib'] = round(peak_rss_mib(), 1)
    if args.worker == 'lmd':
        engine.close()
    return result


# ---- roofline -------------------------------------------------------------------------------------


def weight_bytes(model_dir: str) -> dict:
    """Bytes of weights one decode step reads, from the safetensors headers.

    Assumption: every parameter is read once per token from DRAM (the model is far larger than
    the caches); a tied embedding is one matrix read once, as the lm_head GEMV (the embedding
    lookup reads a single row, which is negligible); norms included; KV-cache reads not included.
    """
    import glob
    import struct
    with open(os.path.join(model_dir, 'config.json')) as f:
        config = json.load(f)
    sizes = {'F64': 8, 'F32': 4, 'F16': 2, 'BF16': 2, 'I64': 8, 'I32': 4, 'I16': 2, 'I8': 1, 'U8': 1}
    tensors = {}
    for path in sorted(glob.glob(os.path.join(model_dir, '*.safetensors'))):
        with open(path, 'rb') as f:
            (n,) = struct.unpack('<Q', f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == '__metadata__':
                continue
            count = 1
            for d in meta['shape']:
                count *= d
            tensors[name] = (count, count * sizes[meta['dtype']], meta['dtype'])
    tied = bool(config.get('tie_word_embeddings', False))
    if tied:
        tensors.pop('lm_head.weight', None)  # the same matrix as the embedding: read once
    total = sum(b for _, b, _ in tensors.values())
    params = sum(c for c, _, _ in tensors.values())
    kv_per_token = (2 * config['num_hidden_layers'] * config.get('num_key_value_heads', config['num_attention_heads'])
                    * config.get('head_dim', config['hidden_size'] // config['num_attention_heads']) * 4)
    return {'weight_bytes_per_token': total, 'num_params': params,
            'dtypes': sorted({d for _, _, d in tensors.values()}), 'tied_embeddings': tied,
            'kv_bytes_per_context_token_fp32': kv_per_token,
            'assumption': 'each weight read once per decoded token from DRAM; tied embedding counted once '
                          '(as the lm_head read; the embedding row lookup is negligible); KV-cache reads '
                          'excluded from the bound (kv_bytes_per_context_token_fp32 gives their size)'}


def roofline(model_dir: str, num_threads: int, lmd_decode_tok_s: float | None,
             hf_decode_tok_s: float | None) -> dict:
    wb = weight_bytes(model_dir)
    bw = measure_bandwidth(num_threads)
    bound = bw['read_gb_per_s'] * 1e9 / wb['weight_bytes_per_token']
    out = {**wb, 'bandwidth': bw, 'bound_tokens_per_s': round(bound, 2)}
    if lmd_decode_tok_s:
        out['lmd_fraction_of_bound'] = round(lmd_decode_tok_s / bound, 3)
    if hf_decode_tok_s:
        out['hf_fraction_of_bound'] = round(hf_decode_tok_s / bound, 3)
    return out


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p)
    p.add_argument('--batch-sizes', default='1,16', help='comma-separated batch sizes')
    p.add_argument('--prompt-tokens', type=int, default=128)
    p.add_argument('--output-tokens', type=int, default=128)
    p.add_argument('--warmup', type=int, default=1,
                   help=f'untimed rounds per batch size (same batch and prompts, {WARMUP_TOKENS} output tokens)')
    p.add_argument('--rounds', type=int, default=3, help='timed rounds per batch size')
    p.add_argument('--compare-hf', action='store_true', help='also run transformers generate() on the same prompts')
    p.add_argument('--skip-lmd', action='store_true', help='run only the transformers side (needs --compare-hf)')
    p.add_argument('--no-roofline', action='store_true', help='skip the bandwidth measurement')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--quick', action='store_true',
                   help='smoke run: batch sizes 1,4, 64 prompt / 32 output tokens, 1 warmup, 1 round')
    p.add_argument('--timeout', type=float, default=1800, help='seconds each engine worker may run')
    add_worker_args(p, ('lmd', 'hf'), '--prompt-file', '--plan')
    p.add_argument('--pad-id', type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.prompt_tokens, args.output_tokens = '1,4', 64, 32
        args.warmup, args.rounds = 1, 1
    try:
        args.batch_size_list = [int(b) for b in args.batch_sizes.split(',')]
    except ValueError:
        p.error(f'--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}')
    if any(b < 1 for b in args.batch_size_list) or args.rounds < 1 or args.warmup < 0:
        p.error('batch sizes and --rounds must be >= 1, --warmup >= 0')
    if args.prompt_tokens < 1 or args.output_tokens < 2:
        p.error('--prompt-tokens must be >= 1 and --output-tokens >= 2 (TPOT needs a second token)')
    if args.skip_lmd and not args.compare_hf:
        p.error('--skip-lmd leaves nothing to run without --compare-hf')
    return args


def pad_token_id(model_dir: str) -> int:
    for name in ('generation_config.json', 'config.json'):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                pid = json.load(f).get('pad_token_id')
            if isinstance(pid, int):
                return pid
    return 0


def worker_argv(args, model_dir: str, prompt_file: str, plan: dict) -> list[str]:
    return ['--backend', args.backend, '--num-threads', str(args.num_threads), '--model-dir', model_dir,
            '--prompt-file', prompt_file, '--plan', json.dumps(plan), '--pad-id', str(pad_token_id(model_dir))]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        guarded_worker(worker_main, args)
        return 0
    load0 = load_average()
    try:
        model_dir = resolve_model_dir(args.model)
    except Exception as e:
        print(json.dumps({'benchmark': 'profile_generation', 'error': f'{type(e).__name__}: {e}'}))
        return 2
    per_round = args.warmup + args.rounds
    rounds_needed = sum(b * per_round for b in args.batch_size_list)
    prompts = make_prompts(model_dir, rounds_needed, (args.prompt_tokens,) * 2, (args.output_tokens,) * 2,
                           seed=args.seed)
    sets, i = [], 0
    for b in args.batch_size_list:
        for _ in range(per_round):
            sets.append(prompts[i:i + b])
            i += b
    plan = {'batch_sizes': args.batch_size_list, 'warmup': args.warmup, 'rounds': args.rounds}
    report = {
        'benchmark': 'profile_generation', 'backend': args.backend, 'model': args.model, 'model_dir': model_dir,
        'num_threads': args.num_threads, 'cpu_count': os.cpu_count(), 'batch_sizes': args.batch_size_list,
        'prompt_tokens': args.prompt_tokens, 'output_tokens': args.output_tokens,
        'warmup': args.warmup, 'rounds': args.rounds, 'seed': args.seed,
        'workload': describe(prompts),
        'method': 'lmd: AsyncEngine.generate(stream_response=True), all of a round submitted at once, '
                  'TTFT = first Response, TPOT = (last - first) / (tokens - 1); transformers: generate() static '
                  'batch, left padding, a streamer stamps each step (TTFT = first step, TPOT = (total - ttft) / '
                  '(n - 1)); greedy, EOS ignored, float32; percentiles pool rounds x requests; '
                  'decode_tokens_per_s = tokens after each first token / (last token - earliest first token)',
    }
    with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:
        prompt_file = f.name
    save_prompt_sets(prompt_file, sets)
    wargv = worker_argv(args, model_dir, prompt_file, plan)
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

    def b1_decode(side):
        return side.get('batch_1', {}).get('decode_tokens_per_s', {}).get('p50')

    if args.compare_hf and 'error' not in lmd and 'error' not in hf and lmd:
        report['ratios_lmd_over_hf'] = {}
        for b in args.batch_size_list:
            lb, hb = lmd[f'batch_{b}'], hf[f'batch_{b}']
            report['ratios_lmd_over_hf'][f'batch_{b}'] = {
                'decode_tokens_per_s': ratio(lb['decode_tokens_per_s']['p50'], hb['decode_tokens_per_s']['p50']),
                'output_tokens_per_s': ratio(lb['output_tokens_per_s'], hb['output_tokens_per_s']),
                'ttft_speedup_p50': ratio(hb['ttft_s']['p50'], lb['ttft_s']['p50']),
                'tpot_speedup_p50': ratio(hb['tpot_s']['p50'], lb['tpot_s']['p50']),
            }
        if 1 in args.batch_size_list:
            measured = report['ratios_lmd_over_hf']['batch_1']['decode_tokens_per_s']
            report['targets'] = {'batch1_decode_vs_hf': {'target': 2.0, 'measured': measured,
                                                         'met': bool(measured and measured >= 2.0)}}
    if not args.no_roofline and 1 in args.batch_size_list:
        log('measuring memory bandwidth for the roofline')
        report['roofline_batch_1'] = roofline(model_dir, args.num_threads,
                                              b1_decode(lmd) if 'error' not in lmd else None,
                                              b1_decode(hf) if 'error' not in hf else None)
    emit(report, load0)
    return 2 if 'error' in lmd or 'error' in hf else 0


if __name__ == '__main__':
    sys.exit(main())
