"""Multi-LoRA throughput: 16 concurrent requests spread over 4 LoRA adapters, against the same 16 on
the base model alone, in one engine of each backend.

    python benchmark/profile_lora.py                         # SmolLM2 float32, both engines, rank 16
    python benchmark/profile_lora.py --backends pytorch --rank 64 --max-new-tokens 64

The adapters are random (a benchmark measures time, not quality), written as PEFT saves them
(``adapter_config.json`` + ``adapter_model.safetensors``) for every matmul of every layer
(q/k/v/o/gate/up/down) at ``--rank``, and served together through ``--adapters``' path
(``EngineConfig.adapters``): each request names one, four requests an adapter, so every step of the
run mixes all four, as a multi-tenant server's would. Answers are greedy, ``--max-new-tokens`` each
with the end token ignored, so both runs generate the same number of tokens; the figure is
generated tokens over the wall time from the first request to the last answer. The model runs
unquantized (``--dtype``) because a LoRA's cost is measured against the matmuls it rides on.

Prints one JSON object on stdout (progress on stderr) and a markdown table on stderr.
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
from common import DEFAULT_THREADS, emit, load_average, log, set_threads  # noqa: E402

MODULES = {'self_attn': ('q_proj', 'k_proj', 'v_proj', 'o_proj'), 'mlp': ('gate_proj', 'up_proj', 'down_proj')}


def write_adapter(path: str, model_dir: str, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter of every matmul of the model in ``model_dir``, saved in ``path``."""
    import torch
    from safetensors.torch import save_file

    from lmd.model_config import ModelConfig
    from lmd.weights.schema import _matmul_shapes
    mc = ModelConfig.from_dir(model_dir)
    shapes = _matmul_shapes(mc)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_layers):
        for block, modules in MODULES.items():
            for m in modules:
                n, k = shapes[f'{block}.{m}']
                key = f'base_model.model.model.layers.{layer}.{block}.{m}'
                tensors[f'{key}.lora_A.weight'] = torch.randn(rank, k, generator=g) / k ** 0.5
                tensors[f'{key}.lora_B.weight'] = torch.randn(n, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, 'adapter_model.safetensors'))
    with open(os.path.join(path, 'adapter_config.json'), 'w') as f:
        json.dump({'peft_type': 'LORA', 'r': rank, 'lora_alpha': 2 * rank, 'bias': 'none',
                   'target_modules': [m for ms in MODULES.values() for m in ms]}, f)
    return path


async def run(engine, prompts: list[str], adapters: list[str | None], max_new_tokens: int) -> dict:
    from lmd import GenerationConfig
    gen = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)

    async def one(prompt, adapter):
        n = 0
        async for r in engine.generate(None, input_ids=list(prompt), gen_config=gen, stream_response=False,
                                       adapter_name=adapter):
            n = r.generate_token_len
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters)))
    wall = time.perf_counter() - start
    return dict(requests=len(prompts), tokens=sum(counts), wall_s=round(wall, 2),
                tok_s=round(sum(counts) / wall, 1))


def bench_backend(model_dir: str, backend: str, adapter_dirs: dict[str, str], args) -> dict:
    from lmd.async_engine import AsyncEngine
    from lmd.backend import CONFIGS
    from prompts import make_prompts
    config = CONFIGS[backend](session_len=1024, dtype=args.dtype, adapters=adapter_dirs,
                              max_batch_size=args.num_requests)
    engine = AsyncEngine(model_dir, backend=backend, backend_config=config)
    try:
        prompts = [p.token_ids for p in make_prompts(model_dir, args.num_requests, (args.input_len,) * 2, (1, 1))]
        names = list(adapter_dirs)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(run(engine, prompts[:2], [None, names[0]], 4))  # warm up
        base = loop.run_until_complete(run(engine, prompts, [None] * len(prompts), args.max_new_tokens))
        log(f'{backend}: base {base}')
        spread = [names[i % len(names)] for i in range(len(prompts))]
        lora = loop.run_until_complete(run(engine, prompts, spread, args.max_new_tokens))
        log(f'{backend}: {len(names)} adapters {lora}')
        loop.close()
    finally:
        engine.engine.close()
    return dict(base=base, lora=lora, lora_vs_base=round(lora['tok_s'] / base['tok_s'], 3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default=None, help='an HF model folder (default: SmolLM2, converted from its GGUF)')
    p.add_argument('--backends', default='pytorch,turbomind')
    p.add_argument('--num-adapters', type=int, default=4)
    p.add_argument('--num-requests', type=int, default=16)
    p.add_argument('--rank', type=int, default=16)
    p.add_argument('--max-new-tokens', type=int, default=128)
    p.add_argument('--input-len', type=int, default=128, help='prompt tokens of each request (prose)')
    p.add_argument('--dtype', default='float32')
    p.add_argument('--threads', type=int, default=DEFAULT_THREADS)
    args = p.parse_args(argv)
    set_threads(args.threads)
    load_start = load_average()
    from lmd.model_path import prepare_model_dir
    model_dir = prepare_model_dir(args.model)
    report = dict(model=model_dir, num_adapters=args.num_adapters, num_requests=args.num_requests, rank=args.rank,
                  input_len=args.input_len, max_new_tokens=args.max_new_tokens, dtype=args.dtype, threads=args.threads, results={})
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dirs = {f'lora{i}': write_adapter(f'{tmp}/lora{i}', model_dir, args.rank, seed=i)
                        for i in range(args.num_adapters)}
        for backend in args.backends.split(','):
            report['results'][backend] = bench_backend(model_dir, backend, adapter_dirs, args)
    rows = ['| engine | base tok/s | 4 adapters tok/s | ratio |', '| --- | --- | --- | --- |']
    for backend, r in report['results'].items():
        rows.append(f"| {backend} | {r['base']['tok_s']} | {r['lora']['tok_s']} | {r['lora_vs_base']} |")
    log('\n'.join(rows))
    emit(report, load_start)
    return 0


if __name__ == '__main__':
    sys.exit(main())
