"""Decode speed of the PyTorch engine on a CUDA GPU, beside HF transformers on the same GPU, one run.

No model hub is reachable where the GPU is lent, so the model is built from a config with random
weights (bfloat16; speed does not depend on the values) and saved once. Both sides get the same
prompts of random token ids and generate exactly ``--new`` tokens (no EOS). Two figures per batch
size: output tokens per second over the whole generate call (prefill included), and decode tokens
per second after the first token (lmd: from its output stamps; transformers: the call less a
one-token call's time). Batch 1's decode is also given as a fraction of its roofline: the weights'
bytes read once per token against a device-to-device copy bandwidth measured in the same run
(and a large bf16 matmul's rate, the tensor-core ceiling). Records the GPU, torch and triton
versions. JSON to stdout. ``--device cpu`` runs the same on the CPU (a check of the script).

    python benchmark/gpu_decode.py --preset llama-1b --batch 1 16 --prompt-len 128 --new 128
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time

import torch

PRESETS = {  # Llama-3.2-1B's shapes with a 32k vocabulary; a tiny one for a quick look
    'llama-1b': dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
    'tiny': dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096),
}


def build(preset: str, path: str, device: str) -> int:
    """Save a random bfloat16 model of ``preset``'s shapes in ``path``; its weights' bytes."""
    import transformers
    cfg = transformers.LlamaConfig(**PRESETS[preset], tie_word_embeddings=False, torch_dtype='bfloat16')
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def timed(fn, device: str, repeats: int) -> float:
    """Seconds per call of ``fn``, after one warm-up, the device synchronized around."""
    fn()
    sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


def ceilings(device: str) -> dict:
    """The device's copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    n = (1 << 30) if device == 'cuda' else (1 << 27)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_s = timed(lambda: b.copy_(a), device, 10)
    m = 8192 if device == 'cuda' else 512
    x = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    mm_s = timed(lambda: x @ y, device, 10)
    return dict(copy_gb_per_s=round(2 * n / copy_s / 1e9, 1), bf16_matmul_tflops=round(2 * m ** 3 / mm_s / 1e12, 1),
                matmul_size=m)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def time_lmd(path: str, batches: list[int], prompt_len: int, new: int, vocab: int, device: str) -> list[dict]:
    from lmd.engine import EngineRequest, SamplingParams
    from lmd.messages import PytorchEngineConfig
    from lmd.pytorch_backend import PytorchEngine

    rows = []
    cfg = PytorchEngineConfig(device=device, dtype='bfloat16', max_batch_size=max(batches),
                              session_len=prompt_len + new + 8, cache_max_entry_count=0.3)
    with PytorchEngine(path, cfg) as engine:
        for batch in [1] + batches:  # the first, batch-1 pass is the warm-up (Triton compiles)
            done, lock, counts, stamps = threading.Event(), threading.Lock(), {}, []

            def on_output(out, counts=counts, done=done, lock=lock, batch=batch, stamps=stamps):
                with lock:
                    stamps.append(time.perf_counter())
                    counts[out.session_id] = counts.get(out.session_id, 0) + len(out.token_ids)
                    if out.finish_reason is not None:
                        counts.setdefault('finished', 0)
                        counts['finished'] += 1
                        if counts['finished'] == batch:
                            done.set()
            sp = SamplingParams(max_new_tokens=new)  # no stop tokens: exactly `new` each
            base = 1000 * (len(rows) + 1)
            t0 = time.perf_counter()
            for i, p in enumerate(prompts(batch, prompt_len, vocab)):
                engine.add_request(EngineRequest(base + i, tuple(p), sp), on_output)
            assert done.wait(600), 'lmd: requests did not finish'
            dt = time.perf_counter() - t0
            tokens = sum(v for k, v in counts.items() if k != 'finished')
            # decode: after the step that gave every request its first token (the batch's prefill)
            first = stamps[min(batch, len(stamps)) - 1]
            rows.append(dict(engine='lmd pytorch (triton)' if device == 'cuda' else 'lmd pytorch (cpu)', batch=batch, output_tokens=tokens, seconds=round(dt, 3),
                             tok_per_s=round(tokens / dt, 1),
                             decode_tok_per_s=round((tokens - batch) / max(stamps[-1] - first, 1e-9), 1)))
    return rows[1:]


@torch.no_grad()
def time_hf(path: str, batches: list[int], prompt_len: int, new: int, vocab: int, device: str) -> list[dict]:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)

    def generate(ids, n):
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        sync()
        return out, time.perf_counter() - t0

    rows = []
    for batch in [1] + batches:
        ids = torch.tensor(prompts(batch, prompt_len, vocab), device=device)
        out, dt = generate(ids, new)
        _, first = generate(ids, 1)
        tokens = (out.shape[1] - prompt_len) * batch
        rows.append(dict(engine='transformers generate', batch=batch, output_tokens=tokens, seconds=round(dt, 3),
                         tok_per_s=round(tokens / dt, 1),
                         decode_tok_per_s=round((tokens - batch) / max(dt - first, 1e-9), 1)))
    return rows[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--preset', default='llama-1b', choices=sorted(PRESETS))
    ap.add_argument('--batch', type=int, nargs='+', default=[1, 16])
    ap.add_argument('--prompt-len', type=int, default=128)
    ap.add_argument('--new', type=int, default=128)
    ap.add_argument('--skip-hf', action='store_true')
    ap.add_argument('--device', default='cuda', choices=['cuda', 'cpu'])
    args = ap.parse_args()
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('gpu_decode.py: no CUDA device here')
    import triton
    limits = ceilings(args.device)
    with tempfile.TemporaryDirectory() as path:
        weight_bytes = build(args.preset, path, args.device)
        vocab = PRESETS[args.preset]['vocab_size']
        rows = time_lmd(path, args.batch, args.prompt_len, args.new, vocab, args.device)
        if not args.skip_hf:
            rows += time_hf(path, args.batch, args.prompt_len, args.new, vocab, args.device)
    # batch 1 reads every weight once per token (the KV cache of a short prompt is small beside it)
    bound = limits['copy_gb_per_s'] * 1e9 / weight_bytes
    for row in rows:
        if row['batch'] == 1:
            row['decode_fraction_of_roofline'] = round(row['decode_tok_per_s'] / bound, 3)
    device_name = torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'
    print(json.dumps(dict(gpu=device_name, torch=torch.__version__, triton=triton.__version__,
                          preset=args.preset, prompt_len=args.prompt_len, new_tokens=args.new,
                          weight_bytes=weight_bytes, roofline_decode_tok_per_s=round(bound, 1), **limits, rows=rows,
                          command='python benchmark/gpu_decode.py ' + ' '.join(sys.argv[1:])), indent=1))


if __name__ == '__main__':
    main()
