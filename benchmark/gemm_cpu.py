"""GFLOP/s of TurboMind's matmuls at SmolLM2-135M's shapes, side by side in one run:
``ops.linear`` (dot-product form over w[N, K]), ``ops.linear_packed`` (broadcast form over
the panels of ``ops.pack_linear``) and ``torch.matmul``, for float32 and float16 weights
(the activations in the weights' dtype, as in the model) and M = 1, 16, 64, 512 rows; with
``--dtypes w4a16``, ``ops.linear_w4a16`` against ``ops.linear_w4a16_packed`` (float32
activations, groups of 32), ``ops.linear_w4a8_packed`` (the same panels, activations quantized
to int8 per 32: ``w4a8_packed``) and torch on the dequantized weights; with ``--dtypes w8a16``
(GGUF Q8_0's layout, SmolLM2's lm_head), ``ops.linear_w8a16`` and ``ops.linear_w8a16_packed``
(the panels TurboMind runs) against ``ops.linear_w8a8_group`` (activations int8 per 32:
``w8a8_group``); with ``--dtypes gguf``, ``ops.linear_gguf`` for every GGUF block type whose
block divides K (``Q5_0 a16`` float activations, ``Q5_0 a8`` int8).

    python benchmark/gemm_cpu.py                      # float32 and float16, 2 threads
    python benchmark/gemm_cpu.py --dtypes w4a16
    python benchmark/gemm_cpu.py --m 512 --dtypes float32 --repeats 7

Prints one JSON object: per dtype, M and matmul, the best GFLOP/s of each kernel over
--repeats timings (each of at least --min-time seconds), and the packed/linear ratio; the
summary gives FLOP-weighted GFLOP/s over one layer's four matmuls (qkv, o, gate_up, down).
Timings on shared machines vary by ~10%: compare kernels within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils.dlpack import to_dlpack as dl

from lmd.kernels import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import best_seconds, cpu_info  # noqa: E402


# SmolLM2-135M: hidden 576, intermediate 1536, 9 q / 3 kv heads of 64, vocab 49152
SHAPES = {'qkv': (960, 576), 'o': (576, 576), 'gate_up': (3072, 576), 'down': (576, 1536), 'lm_head': (49152, 576)}
LAYER = ('qkv', 'o', 'gate_up', 'down')
DTYPES = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16, 'w4a16': None,
          'w8a16': None, 'gguf': None}
W4A16_GROUP = 32


def float_kernels(M: int, N: int, K: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype) / K ** 0.5
    packed = torch.empty((N + 15) // 16, K, 16, dtype=dtype)
    ops.pack_linear(dl(w), dl(packed))
    x_h, w_h, p_h = dl(x), ops.HostTensor(dl(w)), ops.HostTensor(dl(packed))
    y_old, y_new = torch.empty(M, N, dtype=dtype), torch.empty(M, N, dtype=dtype)
    yo_h, yn_h = dl(y_old), dl(y_new)
    return {
        'linear': lambda: ops.linear(x_h, w_h, None, yo_h),
        'linear_packed': lambda: ops.linear_packed(x_h, p_h, None, yn_h),
        'torch': lambda: torch.matmul(x, w.T),
    }


def w4a16_kernels(M: int, N: int, K: int, g: torch.Generator) -> dict:
    from lmd.turbomind import quant
    x = torch.randn(M, K, generator=g)
    qweight = quant.pack_int4(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8))
    scales = torch.rand(N, K // W4A16_GROUP, generator=g) * 0.02 + 0.001
    mins = -8 * scales
    P = (N + 63) // 64
    qp, sp = torch.empty(P, K // 8, 64, dtype=torch.int32), torch.empty(P, K // W4A16_GROUP, 64)
    mp = torch.empty_like(sp)
    ops.pack_w4a16(dl(qweight), dl(scales), dl(mins), dl(qp), dl(sp), dl(mp))
    w = quant.dequantize_w4a16(qweight, scales, mins)
    x_h = dl(x)
    q_h, s_h, m_h = (ops.HostTensor(dl(t)) for t in (qweight, scales, mins))
    qp_h, sp_h, mp_h = (ops.HostTensor(dl(t)) for t in (qp, sp, mp))
    yo_h, yn_h = dl(torch.empty(M, N)), dl(torch.empty(M, N))
    return {
        'linear': lambda: ops.linear_w4a16(x_h, q_h, s_h, m_h, None, yo_h, W4A16_GROUP),
        'linear_packed': lambda: ops.linear_w4a16_packed(x_h, qp_h, sp_h, mp_h, None, yn_h),
        'w4a8_packed': lambda: ops.linear_w4a8_packed(x_h, qp_h, sp_h, mp_h, None, yn_h),
        'torch': lambda: torch.matmul(x, w.T),
    }


def w8a16_kernels(M: int, N: int, K: int, g: torch.Generator) -> dict:
    x = torch.randn(M, K, generator=g)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, K // W4A16_GROUP, generator=g) * 0.01
    x_h, q_h, s_h = dl(x), ops.HostTensor(dl(q)), ops.HostTensor(dl(s))
    yo_h, yn_h = dl(torch.empty(M, N)), dl(torch.empty(M, N))
    w = q.float() * s.repeat_interleave(W4A16_GROUP, 1)
    P = (N + 15) // 16
    qp, sp = torch.empty(P, K, 16, dtype=torch.int8), torch.empty(P, K // W4A16_GROUP, 16)
    ops.pack_w8a16(dl(q), dl(s), dl(qp), dl(sp))
    qp_h, sp_h = ops.HostTensor(dl(qp)), ops.HostTensor(dl(sp))
    return {
        'linear': lambda: ops.linear_w8a16(x_h, q_h, s_h, None, yo_h, W4A16_GROUP),
        'linear_packed': lambda: ops.linear_w8a16_packed(x_h, qp_h, sp_h, None, yo_h),
        'w8a8_group': lambda: ops.linear_w8a8_group(x_h, q_h, s_h, None, yn_h, W4A16_GROUP),
        'torch': lambda: torch.matmul(x, w.T),
    }


def gguf_kernels(M: int, N: int, K: int, g: torch.Generator) -> dict:
    """``ops.linear_gguf`` for each GGUF block type whose block fits K, float (a16) and int8 (a8)
    activations, over random blocks (any bytes are a valid block; the timing does not read values)."""
    x_h = dl(torch.randn(M, K, generator=g))
    y_h = dl(torch.empty(M, N))
    out = {}
    for t, (type_id, qk, block_bytes) in ops.GGUF_TYPES.items():
        if K % qk:
            continue
        raw = ops.HostTensor(dl(torch.randint(0, 256, (N, K // qk * block_bytes), generator=g, dtype=torch.uint8)))
        out[f'{t} a16'] = lambda raw=raw, i=type_id: ops.linear_gguf(x_h, raw, i, None, y_h)
        out[f'{t} a8'] = lambda raw=raw, i=type_id: ops.linear_gguf(x_h, raw, i, None, y_h, int8_activations=True)
    return out


def measure(name: str, M: int, dname: str, args) -> dict:
    N, K = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    make = {'w4a16': w4a16_kernels, 'w8a16': w8a16_kernels, 'gguf': gguf_kernels}.get(dname)
    kernels = make(M, N, K, g) if make else float_kernels(M, N, K, DTYPES[dname], g)
    flop = 2 * M * N * K
    out = {'N': N, 'K': K}
    for k, fn in kernels.items():
        if k == 'torch' and args.no_torch:
            continue
        out[k] = round(flop / best_seconds(fn, args.repeats, args.min_time) / 1e9, 1)
    if 'linear_packed' in out:
        out['packed/linear'] = round(out['linear_packed'] / out['linear'], 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--m', default='1,16,64,512', help='rows of x, comma-separated')
    p.add_argument('--dtypes', default='float32,float16', help=f'weight dtypes: {", ".join(DTYPES)}')
    p.add_argument('--shapes', default=','.join(SHAPES), help=f'matmuls: {", ".join(SHAPES)}')
    p.add_argument('--num-threads', type=int, default=2)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--min-time', type=float, default=0.05, help='seconds per timing')
    p.add_argument('--no-torch', action='store_true', help='skip torch.matmul')
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    ops.set_num_threads(args.num_threads)
    result = {'benchmark': 'gemm_cpu', 'num_threads': args.num_threads, 'isa': ops.isa(), 'cpu': cpu_info(),
              'gflops': {}, 'layer': {}}
    for dname in args.dtypes.split(','):
        if dname not in DTYPES:
            p.error(f'--dtypes: {dname!r} is not one of {", ".join(DTYPES)}')
        for M in (int(m) for m in args.m.split(',')):
            rows = {}
            for name in args.shapes.split(','):
                if name == 'lm_head' and M > 64:
                    continue  # prefill wants the logits of the last row only
                rows[name] = measure(name, M, dname, args)
                print(f'{dname} M={M} {name}: {rows[name]}', file=sys.stderr)
            result['gflops'][f'{dname} M={M}'] = rows
            if all(n in rows for n in LAYER):  # one layer's matmuls, time-weighted
                flop = {n: 2 * M * SHAPES[n][0] * SHAPES[n][1] for n in LAYER}
                summary = {}
                for k in ('linear', 'linear_packed', 'w4a8_packed', 'w8a8_group', 'torch'):
                    if all(k in rows[n] for n in LAYER):
                        seconds = sum(flop[n] / (rows[n][k] * 1e9) for n in LAYER)
                        summary[k] = round(sum(flop.values()) / seconds / 1e9, 1)
                result['layer'][f'{dname} M={M}'] = summary
    print(json.dumps(result, indent=1))
    return 0


if __name__ == '__main__':
    sys.exit(main())
