"""lmd TurboMind side by side with llama.cpp: same model, same prompt token ids, same thread count.

    bash benchmark/setup_llamacpp.sh          # once: llama-cpp-python (+ llama-server), never an lmd dependency
    python benchmark/compare_llamacpp.py

Figures, each engine in its own subprocess (so peak RSS is its own):

- batch-1 decode tokens/s (``--decode-tokens`` in / out), greedy, EOS ignored;
- prefill tokens/s of a ``--prefill-tokens`` prompt (time to the first token);
- total output tokens/s of ``--concurrency`` requests submitted at once: lmd through
  ``AsyncEngine``, llama.cpp through its own ``llama-server`` with that many slots and
  continuous batching (``-np N -cb``), driven over HTTP; skipped when no server was built.

lmd runs TurboMind in float32 (``--lmd-formats float32``, the weights of the HF directory
``lmd convert`` makes from the shipped GGUF) and, where the model came from a GGUF with 4-bit
matmuls, in W4A16 (``w4a16``: the Q4_0/Q4_1 blocks kept at 4 bits) and W4A8 (``w4a8``: the same with
activations quantized to int8 per 32, ``TurbomindEngineConfig(int8_activations=True)``, the arithmetic
of llama.cpp's Q4_1 x Q8_1 dot product). llama.cpp runs the shipped
Q4_1 GGUF and an F16 GGUF written from it (same tensors and metadata; the quantized tensors
dequantized to F16). Pairs compared: lmd float32 vs llama.cpp F16 (16-bit), and lmd float32 /
W4A16 vs llama.cpp Q4_1 (4-bit). The batch-1 roofline of each: tokens/s <= read bandwidth /
weight bytes read per token, the bandwidth the median of those every worker measured right after its
decode rounds (on these machines one worker in a few measures 45-59 GB/s where most measure 30-35).
With ``--repeats N`` every side runs N times, their order reversed each other time, and each figure
is the side's best run: these shared machines drift by 10-30% within minutes, which one run of each
side, one after the other, would read as a difference between the engines.

Prints one JSON object on stdout; progress goes to stderr. Exits 2 when a side failed.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RequestTiming, add_engine_args, add_llamacpp_extra_bufts_arg, add_worker_args, alternating,
                    best_of_runs, concurrent_round, cpu_seconds, decode_rate, emit, engine_config, guarded_worker,
                    llamacpp_extra_bufts, lmd_batch, load_average, log, measure_bandwidth, peak_rss_mib, percentiles,
                    ratio, rss_mib, run_worker, set_threads, summarize)
import llamacpp_server  # noqa: E402
from gguf_files import (LLAMA_SERVER, LLAMACPP_DIR, f16_gguf, gguf_file_type, gguf_type_counts, gguf_weight_bytes,
                        shipped_gguf)
from prompts import Prompt, describe, make_prompts, resolve_model_dir

CHECK_TOKENS = 16  # greedy tokens compared across engines and precisions
WARMUP_TOKENS = 8

# lmd TurboMind formats: what TurbomindEngineConfig gets, and what the run checks it really got
LMD_FORMATS = {
    'float32': {'model_format': 'hf', 'dtype': 'float32'},   # 'hf': the float weights even of a GGUF conversion
    'float16': {'model_format': 'hf', 'dtype': 'float16'},   # 16-bit weights, activations and KV cache
    'w4a16': {'model_format': 'gguf', 'dtype': 'float32'},   # Q4_0/Q4_1 matmuls at 4 bits, float32 activations
    # the same weights, activations quantized to int8 per 32 as llama.cpp's Q4_1 x Q8_1
    'w4a8': {'model_format': 'gguf', 'dtype': 'float32', 'int8_activations': True},
}


def pairs(quant: str) -> list[tuple[str, str]]:
    """The llama.cpp file each lmd format is set against, by figure; ``quant`` names the quantized
    GGUF by its file type ('Q4_1', 'Q4_K_M', ...)."""
    return [('float16', 'F16'), ('float32', 'F16'), ('float32', quant), ('w4a16', quant), ('w4a8', quant)]


# ---- lmd worker ---------------------------------------------------------------------------------------


def lmd_weight_bytes(tb_engine) -> int:
    """Bytes of the tensors the TurboMind model holds, each once (tied lm_head = embedding); the
    float embedding is left out when the lm_head has its own quantized copy (then only rows are looked up)."""
    tensors = tb_engine.model.tensors
    seen, total = set(), 0
    for name, t in tensors.items():
        if name == 'cos_sin' or (name == 'embed' and 'lm_head.qweight' in tensors):
            continue
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


async def lmd_tokens(engine, ids: list[int], n: int) -> list[int]:
    from lmd.messages import GenerationConfig
    gen = GenerationConfig(max_new_tokens=n, ignore_eos=True, do_sample=False)
    out = []
    async for r in engine.generate(None, gen_config=gen, input_ids=list(ids), stream_response=True,
                                   do_preprocess=False):
        out.extend(r.token_ids)
    return out


def lmd_worker(args, work: dict) -> dict:
    from lmd.async_engine import AsyncEngine
    set_threads(args.num_threads)
    cfg = engine_config('turbomind', max(1, work['concurrency']), args.num_threads, **LMD_FORMATS[args.lmd_format])
    t = time.perf_counter()
    engine = AsyncEngine(args.model_dir, backend='turbomind', backend_config=cfg)
    tb = engine.engine
    formats = collections.Counter(f for n, f in tb.model.linear_formats.items() if n != 'lm_head')
    if args.lmd_format in ('w4a16', 'w4a8') and set(formats) <= {'float'}:
        engine.close()
        raise RuntimeError(f'{args.model_dir} has no quantized matmuls (it is not a conversion of a GGUF with '
                           'quantized weights)')
    result = {'engine': 'lmd TurboMind', 'format': args.lmd_format, 'config': {k: v for k, v in vars(cfg).items()},
              'layer_matmul_formats': dict(formats), 'lm_head_format': tb.model.linear_formats.get('lm_head'),
              'load_s': round(time.perf_counter() - t, 2),
              'rss_after_load_mib': round(rss_mib(), 1), 'weight_bytes_per_token': lmd_weight_bytes(tb)}
    loop = asyncio.new_event_loop()

    def run(ps: list[Prompt]) -> list[RequestTiming]:
        return loop.run_until_complete(lmd_batch(engine, ps))

    result['check_tokens'] = loop.run_until_complete(lmd_tokens(engine, work['check'], CHECK_TOKENS))
    t_run, cpu_run = time.perf_counter(), cpu_seconds()
    result.update(run_phases(run, work, args.worker))
    wall = time.perf_counter() - t_run
    result['cpu_utilization'] = round((cpu_seconds() - cpu_run) / wall, 2)
    result['peak_rss_mib'] = round(peak_rss_mib(), 1)
    engine.close()
    return result


# ---- llama.cpp worker (llama-cpp-python, one sequence) ----------------------------------------------


def open_llama(path: str, use_extra_bufts: bool, **kwargs):
    """llama-cpp-python's ``Llama(model_path=path, verbose=False, **kwargs)``, with its repacked (CPU-specific /
    AMX) weight buffers on or off: ``Llama()`` takes no use_extra_bufts, its model params start from
    ``llama_model_default_params()``, which is wrapped for the call."""
    import llama_cpp.llama_cpp as c_api
    from llama_cpp import Llama
    default_params = c_api.llama_model_default_params

    def model_params():
        params = default_params()
        params.use_extra_bufts = use_extra_bufts
        return params
    c_api.llama_model_default_params = model_params
    try:
        return Llama(model_path=path, verbose=False, **kwargs)
    finally:
        c_api.llama_model_default_params = default_params


class LlamaCppRunner:
    """Greedy decoding of token ids through llama-cpp-python's ``Llama.eval``; no prefix reuse
    (every request starts from an empty context), EOS never checked."""

    def __init__(self, path: str, num_threads: int, n_ctx: int, n_batch: int, use_extra_bufts: bool):
        self.llm = open_llama(path, use_extra_bufts, n_threads=num_threads, n_threads_batch=num_threads, n_ctx=n_ctx,
                              n_batch=n_batch, n_ubatch=n_batch, logits_all=False)
        self.n_vocab = self.llm.n_vocab()

    def _eval_argmax(self, ids: list[int]) -> int:
        """Evaluate ``ids`` after the context so far; the greedy next token. With logits_all=False
        ``eval`` keeps no logits, so the last row is read from the context itself."""
        import llama_cpp
        import numpy as np
        self.llm.eval(ids)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def request(self, prompt: Prompt) -> tuple[RequestTiming, list[int]]:
        self.llm.reset()
        timing = RequestTiming(time.perf_counter(), prompt.output_len)
        tok = self._eval_argmax(list(prompt.token_ids))
        timing.add(time.perf_counter(), 1)
        out = [tok]
        for n in range(2, prompt.output_len + 1):
            tok = self._eval_argmax([tok])
            timing.add(time.perf_counter(), n)
            out.append(tok)
        return timing, out


def llamacpp_worker(args, work: dict) -> dict:
    import llama_cpp
    t = time.perf_counter()
    extra = llamacpp_extra_bufts(args.llamacpp_extra_bufts)
    runner = LlamaCppRunner(args.gguf, args.num_threads, work['n_ctx'], work['n_batch'], extra)
    result = {'engine': 'llama.cpp (llama-cpp-python)', 'llama_cpp_python': llama_cpp.__version__,
              'gguf': args.gguf, 'tensor_types': gguf_type_counts(args.gguf),
              'load_s': round(time.perf_counter() - t, 2), 'rss_after_load_mib': round(rss_mib(), 1),
              'weight_bytes_per_token': gguf_weight_bytes(args.gguf),
              'system_info': llama_cpp.llama_print_system_info().decode(errors='replace').strip()}

    def run(ps: list[Prompt]) -> list[RequestTiming]:
        return [runner.request(p)[0] for p in ps]

    result['check_tokens'] = runner.request(Prompt(tuple(work['check']), CHECK_TOKENS))[1]
    t_run, cpu_run = time.perf_counter(), cpu_seconds()
    work = dict(work, concurrency=0)  # one sequence at a time here; llama-server does the concurrent run
    result.update(run_phases(run, work, args.worker))
    wall = time.perf_counter() - t_run
    result['cpu_utilization'] = round((cpu_seconds() - cpu_run) / wall, 2)
    result['peak_rss_mib'] = round(peak_rss_mib(), 1)
    return result


def run_phases(run, work: dict, name: str) -> dict:
    """Decode (batch 1), prefill, and (concurrency > 0) the concurrent round, through ``run``."""
    def load(key: str) -> list[Prompt]:
        return [Prompt(tuple(p['ids']), p['out']) for p in work[key]]
    out = {}
    decode, prefill = load('decode'), load('prefill')
    w = work['warmup']
    for p in decode[:w]:
        run([Prompt(p.token_ids, min(p.output_len, WARMUP_TOKENS))])
    rates, timings = [], []
    for i, p in enumerate(decode[w:]):
        (t,) = run([p])
        timings.append(t)
        rates.append(decode_rate([t]))
        log(f'{name} decode round {i}: {rates[-1]:.1f} tok/s')
    out['decode_batch_1'] = {'prompt_tokens': decode[0].input_len, 'output_tokens': decode[0].output_len,
                             'decode_tokens_per_s': percentiles(rates, 2), **summarize(timings),
                             'exact_token_counts': all(t.num_tokens == t.output_len for t in timings)}
    if work['roofline']:  # the roofline's bandwidth, in this process right after its decode
        out['decode_batch_1']['read_bandwidth'] = measure_bandwidth(work['num_threads'])
    for p in prefill[:w]:
        run([p])
    rates = []
    for i, p in enumerate(prefill[w:]):
        (t,) = run([p])
        rates.append(p.input_len / t.ttft)
        log(f'{name} prefill round {i}: {rates[-1]:.1f} tok/s')
    out['prefill'] = {'prompt_tokens': prefill[0].input_len, 'prefill_tokens_per_s': percentiles(rates, 2),
                      'method': 'prompt tokens / time to the first token (prompt evaluated, first token chosen)'}
    if work['concurrency'] > 0:
        run([Prompt(p.token_ids[:16], WARMUP_TOKENS) for p in load('concurrent')[:2]])
        out['concurrent'] = concurrent_round(run, load('concurrent'), name)
    return out


WORKERS = {'lmd': lmd_worker, 'llamacpp': llamacpp_worker,
           'server': lambda args, work: llamacpp_server.server_worker(args, work, WARMUP_TOKENS)}


def worker_main(args) -> dict:
    with open(args.work_file) as f:
        work = json.load(f)
    return WORKERS[args.worker](args, work)


# ---- main -----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p, backends=None, model_help="lmd model: 'smollm2' (the shipped GGUF, converted) or a path")
    p.add_argument('--gguf', default=None, help='llama.cpp quantized model (default: --model when it is a .gguf '
                   'file, else the shipped SmolLM2 Q4_1 GGUF)')
    add_llamacpp_extra_bufts_arg(p)
    p.add_argument('--f16-gguf', default=None,
                   help=f'llama.cpp 16-bit model; written from --gguf when missing '
                        f'(default: {LLAMACPP_DIR}/<gguf name>.F16.gguf)')
    p.add_argument('--lmd-formats', default='float16,float32,w4a16',
                   help=f'lmd TurboMind formats, comma-separated: {", ".join(LMD_FORMATS)}')
    p.add_argument('--decode-tokens', default='128,128', help='batch-1 decode: prompt,output tokens')
    p.add_argument('--prefill-tokens', type=int, default=512)
    p.add_argument('--concurrency', type=int, default=32, help='requests of the throughput round (0: skip it)')
    p.add_argument('--concurrent-tokens', default='128,128', help='concurrent round: prompt,output tokens each')
    p.add_argument('--rounds', type=int, default=3, help='timed decode and prefill rounds (fresh prompts each)')
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--repeats', type=int, default=1,
                   help='run every side this many times, alternating their order; each figure the best run')
    p.add_argument('--server', default=LLAMA_SERVER, help="llama-server binary ('' skips it)")
    p.add_argument('--no-roofline', action='store_true')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--quick', action='store_true', help='smoke run: 64,32 decode, 128 prefill, 4 concurrent, 1 round')
    p.add_argument('--timeout', type=float, default=1800, help='seconds each worker may run')
    add_worker_args(p, None, '--work-file', '--lmd-format')
    args = p.parse_args(argv)
    if args.quick:
        args.decode_tokens, args.prefill_tokens, args.concurrent_tokens = '64,32', 128, '64,32'
        args.concurrency, args.rounds = min(args.concurrency, 4), 1
    try:
        args.decode_in, args.decode_out = (int(x) for x in args.decode_tokens.split(','))
        args.conc_in, args.conc_out = (int(x) for x in args.concurrent_tokens.split(','))
    except ValueError:
        p.error('--decode-tokens and --concurrent-tokens take PROMPT,OUTPUT')
    args.lmd_format_list = [f for f in args.lmd_formats.split(',') if f]
    bad = [f for f in args.lmd_format_list if f not in LMD_FORMATS]
    if bad:
        p.error(f'--lmd-formats: unknown {bad}; choose from {list(LMD_FORMATS)}')
    if args.decode_out < 2 or args.rounds < 1 or args.warmup < 0 or args.repeats < 1:
        p.error('decode output tokens must be >= 2, --rounds >= 1, --warmup >= 0, --repeats >= 1')
    return args


def build_work(args, model_dir: str) -> dict:
    """The prompts every engine gets, as token ids: decode, prefill, concurrent, and the greedy check."""
    n = args.warmup + args.rounds
    decode = make_prompts(model_dir, n, (args.decode_in,) * 2, (args.decode_out,) * 2, seed=args.seed)
    prefill = make_prompts(model_dir, n, (args.prefill_tokens,) * 2, (1, 1), seed=args.seed + 1)
    conc = make_prompts(model_dir, max(args.concurrency, 2), (args.conc_in,) * 2, (args.conc_out,) * 2,
                        seed=args.seed + 2)
    def enc(ps: list[Prompt]) -> list[dict]:
        return [{'ids': list(p.token_ids), 'out': p.output_len} for p in ps]
    longest = max(args.decode_in + args.decode_out, args.prefill_tokens + 1, args.conc_in + args.conc_out)
    return {'decode': enc(decode), 'prefill': enc(prefill), 'concurrent': enc(conc[:args.concurrency]),
            'check': list(decode[0].token_ids[:32]), 'warmup': args.warmup, 'concurrency': args.concurrency,
            'n_ctx': longest + 16, 'n_batch': max(512, args.prefill_tokens),
            'roofline': not args.no_roofline, 'num_threads': args.num_threads,
            'workload': {'decode': describe(decode), 'prefill': describe(prefill), 'concurrent': describe(conc)}}


def figure(side: dict, key: str):
    try:
        if key == 'decode':
            return side['decode_batch_1']['decode_tokens_per_s']['p50']
        if key == 'prefill':
            return side['prefill']['prefill_tokens_per_s']['p50']
        return side['concurrent']['output_tokens_per_s']
    except (KeyError, TypeError):
        return None


def read_gb_per_s(side: dict) -> float | None:
    """The roofline's bandwidth a worker measured after its decode rounds (None: it measured none)."""
    return ((side.get('decode_batch_1') or {}).get('read_bandwidth') or {}).get('read_gb_per_s')


def agreement(a: list[int] | None, b: list[int] | None) -> dict | None:
    if not a or not b:
        return None
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return {'equal_prefix_tokens': same, 'equal_positions': sum(x == y for x, y in zip(a, b)),
            'of': min(len(a), len(b))}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        guarded_worker(worker_main, args)
        return 0
    load0 = load_average()
    report = {'benchmark': 'compare_llamacpp', 'model': args.model, 'num_threads': args.num_threads,
              'cpu_count': os.cpu_count()}
    try:
        model_dir = resolve_model_dir(args.model)
        q4 = args.gguf or (args.model if args.model.endswith('.gguf') else shipped_gguf())
        quant = gguf_file_type(q4)
        f16, written = f16_gguf(q4, args.f16_gguf)
        if written:
            report['f16_gguf'] = written
        import llama_cpp  # noqa: F401  (only to fail early with the setup hint)
    except ImportError:
        report['error'] = 'llama-cpp-python is not installed: run bash benchmark/setup_llamacpp.sh'
        print(json.dumps(report, indent=2))
        return 2
    except Exception as e:
        report['error'] = f'{type(e).__name__}: {e}'
        print(json.dumps(report, indent=2))
        return 2
    ggufs = {'F16': f16, quant: q4}
    server = args.server if args.server and os.access(args.server, os.X_OK) else None
    report.update({
        'model_dir': model_dir, 'ggufs': ggufs, 'lmd_formats': args.lmd_format_list,
        'llama_server': server or (f'{args.server or "--server"}: not built or not given; the concurrent round '
                                   'runs on lmd alone'),
        'llamacpp_extra_bufts': llamacpp_extra_bufts(args.llamacpp_extra_bufts),
        'note': f'lmd float32 is compared with llama.cpp F16 (16-bit figures: lmd reads twice the bytes) and {quant}; '
                f'lmd w4a16 (the GGUF\'s quantized matmuls kept at their own bit widths, float32 activations) '
                f'with llama.cpp {quant}; lmd w4a8 (the same, activations quantized to int8 per 32 as llama.cpp '
                'does) with it. Same prompt token ids for every engine, greedy, EOS ignored, no prefix reuse.',
    })
    work = build_work(args, model_dir)
    report['workload'] = work.pop('workload')
    with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:
        json.dump(work, f)
        work_file = f.name
    script = os.path.abspath(__file__)
    wargv = ['--num-threads', str(args.num_threads), '--model-dir', model_dir, '--work-file', work_file,
             '--llamacpp-extra-bufts', args.llamacpp_extra_bufts]
    # every side once a repeat, the order reversed each other repeat, so that a drift of the machine's
    # speed does not favour one side; each figure the best of a side's runs
    order = [(f'lmd_{fmt}', 'lmd', ['--lmd-format', fmt]) for fmt in args.lmd_format_list]
    for name, path in ggufs.items():
        order.append((f'llamacpp_{name}', 'llamacpp', ['--gguf', path]))
        if server and args.concurrency > 0:
            order.append((f'llamaserver_{name}', 'server', ['--gguf', path, '--server', server,
                                                             '--timeout', str(args.timeout)]))
    runs = collections.defaultdict(list)
    try:
        for rep, (side, worker, extra) in alternating(order, args.repeats):
            log(f'{side} worker starting' + (f' (repeat {rep + 1} of {args.repeats})' if args.repeats > 1 else ''))
            runs[side].append(run_worker(script, worker, wargv + extra, args.timeout))
    finally:
        os.unlink(work_file)
    sections = {'decode_batch_1': 'decode', 'prefill': 'prefill', 'concurrent': 'concurrent'}
    sides = {side: best_of_runs(rs, {s: lambda r, k=k: figure(r, k) for s, k in sections.items()},
                                {'read_gb_per_s': read_gb_per_s})
             for side, rs in runs.items()}
    report.update(sides, repeats=args.repeats)

    # lmd / llama.cpp for each figure and pair; the concurrent llama.cpp side is llama-server
    comparison = []
    for fmt, ggml in pairs(quant):
        lmd = sides.get(f'lmd_{fmt}')
        if lmd is None:
            continue
        for key, other in (('decode', f'llamacpp_{ggml}'), ('prefill', f'llamacpp_{ggml}'),
                           ('concurrent', f'llamaserver_{ggml}')):
            a, b = figure(lmd, key), figure(sides.get(other, {}), key)
            if a is None and b is None:
                continue
            comparison.append({'figure': {'decode': 'batch-1 decode tok/s',
                                          'prefill': f'{args.prefill_tokens}-token prefill tok/s',
                                          'concurrent': f'{args.concurrency} concurrent, output tok/s'}[key],
                               'lmd': fmt, 'llama.cpp': ggml, 'lmd_value': a, 'llamacpp_value': b,
                               'ratio_lmd_over_llamacpp': ratio(a, b)})
    report['comparison'] = comparison

    checks = {name: side.get('check_tokens') for name, side in sides.items() if side.get('check_tokens')}
    ref = checks.get('llamacpp_F16')
    report['greedy_check'] = {
        'prompt_tokens': len(work['check']), 'generated': CHECK_TOKENS,
        'vs_llamacpp_F16': {n: agreement(ref, c) for n, c in checks.items() if n != 'llamacpp_F16'},
        'vs_lmd_float32': {n: agreement(checks.get('lmd_float32'), c) for n, c in checks.items()
                           if n != 'lmd_float32'},
    }
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, 'tokenizer.json'))
    report['greedy_check']['text'] = {n: tok.decode(c) for n, c in checks.items()}

    # the roofline's bandwidth: the median of every worker's (one in a few spikes to 45-59 GB/s where most
    # measure 30-35): the machine's, not one moment's
    bws = sorted(b for rs in runs.values() for r in rs if (b := read_gb_per_s(r)) is not None)
    if bws:
        bw = statistics.median(bws)
        roof = {'read_gb_per_s': round(bw, 2), 'read_gb_per_s_each_worker': bws,
                'method': 'bound tokens/s = read bandwidth / weight bytes read per decoded token (every weight once; '
                          'tied embedding once, as the lm_head read; KV reads excluded); the read bandwidth '
                          '(common.measure_bandwidth) is the median of those every worker measured right after its '
                          'decode rounds; fraction = measured batch-1 decode tokens/s / bound'}
        for name, side in sides.items():
            wb, dec = side.get('weight_bytes_per_token'), figure(side, 'decode')
            if wb and dec:
                bound = bw * 1e9 / wb
                roof[name] = {'weight_bytes_per_token': wb, 'bound_tokens_per_s': round(bound, 1),
                              'decode_tokens_per_s': dec, 'fraction_of_bound': round(dec / bound, 3)}
        report['roofline_batch_1'] = roof
    emit(report, load0)
    return 2 if any('error' in s for s in sides.values()) else 0


if __name__ == '__main__':
    sys.exit(main())
