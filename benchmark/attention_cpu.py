"""Decode attention over a paged float cache as a serving step runs it, and how close it reads the
cache to the machine's bandwidth: ``ops.paged_decode_attention`` for B decode rows of ``--ctx``
tokens each over ``--layers`` layers' caches (SmolLM2-135M's heads: 9 query, 3 KV of 64), the
layers taken in turn so that each layer's cache comes from memory (``cold``) and one layer over
and over (``warm``: its cache in the last-level cache). Unless ``--layers`` says otherwise, there
are as many layers as hold ``COLD_BYTES`` of cache, at least 30: fewer (30 layers of one row at 200
tokens are 9 MB) would stay in the last-level cache and read warm as cold. Beside it, in the same
run, the read bandwidth of a plain streaming sum on the same threads (``common.measure_bandwidth``).

    python benchmark/attention_cpu.py                       # 16 rows of 400 tokens, 2 threads
    python benchmark/attention_cpu.py --rows 1 --ctx 2048 --block-size 16

Prints one JSON object: µs a layer and the cache's GB/s, cold and warm, and the fraction of the
streaming read bandwidth the cold run reaches. At 16 clients the decode attention over a float32
cache is about a quarter of the api_server's CPU time (README, serving).
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
from common import best_seconds, cpu_info, load_average, measure_bandwidth  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
COLD_BYTES = 128 << 20  # four times these machines' 32 MB L3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rows', type=int, default=16, help='decode rows (sequences) a step')
    p.add_argument('--ctx', type=int, default=400, help='tokens in each row\'s context')
    p.add_argument('--layers', type=int, default=None,
                   help=f'layers\' caches taken in turn (cold); default: {COLD_BYTES >> 20} MB of them, at least 30')
    p.add_argument('--block-size', type=int, default=64, help="the cache's tokens a block (TurboMind's default)")
    p.add_argument('--dtype', choices=('float32', 'bfloat16', 'float16'), default='float32')
    p.add_argument('--num-threads', type=int, default=2)
    p.add_argument('--repeats', type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    ops.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    B, bs = args.rows, args.block_size
    nb = (args.ctx + bs - 1) // bs
    blocks = B * nb + 1
    shape = (blocks, bs, KV_HEADS, HEAD_DIM)
    layer_bytes = 2 * blocks * bs * KV_HEADS * HEAD_DIM * dtype.itemsize
    args.layers = args.layers or max(30, -(-COLD_BYTES // layer_bytes))
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
    tables = torch.randperm(blocks)[:B * nb].view(B, nb).to(torch.int32).contiguous()  # scattered, as a served cache
    lens = torch.full((B,), args.ctx, dtype=torch.int32)
    q = torch.randn(B, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5

    def layer(k, v):
        ops.paged_decode_attention(dl(q), dl(k), dl(v), dl(tables), dl(lens), scale, dl(out))

    cold = best_seconds(lambda: [layer(k, v) for k, v in caches], args.repeats) / args.layers
    warm = best_seconds(lambda: [layer(*caches[0]) for _ in range(args.layers)], args.repeats) / args.layers
    cache_bytes = 2 * B * args.ctx * KV_HEADS * HEAD_DIM * q.element_size()  # keys and values a layer
    bandwidth = measure_bandwidth(args.num_threads)
    cold_gbs = cache_bytes / cold / 1e9
    report = {
        'cpu': cpu_info(), 'load_average': load_average(),
        'shape': {'rows': B, 'ctx': args.ctx, 'layers': args.layers, 'block_size': bs, 'dtype': args.dtype,
                  'heads': HEADS, 'kv_heads': KV_HEADS, 'head_dim': HEAD_DIM, 'threads': args.num_threads},
        'cache_mb_per_layer': round(cache_bytes / 1e6, 2),
        'cold': {'us_per_layer': round(cold * 1e6, 1), 'gb_per_s': round(cold_gbs, 1)},
        'warm': {'us_per_layer': round(warm * 1e6, 1), 'gb_per_s': round(cache_bytes / warm / 1e9, 1)},
        'streaming_read_gb_per_s': bandwidth['read_gb_per_s'],
        'cold_fraction_of_streaming_read': round(cold_gbs / bandwidth['read_gb_per_s'], 2),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == '__main__':
    main()
