"""``lmd.kernels.ops.lora_apply`` (lib/kernels/csrc/cpu/lora.h), the grouped multi-LoRA of a step
whose rows run different adapters, against a plain torch version in float64: over dtypes, mixed
slots with rows of no adapter, different ranks per slot, runs of one row and long runs, a slot that
leaves the matmul alone, and a strided y; then its arguments' checks."""
from __future__ import annotations

import pytest
import torch
from torch.utils.dlpack import to_dlpack as dl

from lmd import kernels

ops = kernels.ops
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def reference(x, y, row_slots, a, b):
    """y + per row (x a[s]ᵀ) b[s]ᵀ in float64, rounded once to y's dtype: the kernel's promise."""
    out = y.double().clone()
    for t, s in enumerate(row_slots.tolist()):
        if s >= 0 and a[s] is not None:
            out[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    return out.to(y.dtype)


def adapters(K, N, ranks, dtype, seed=10):
    """Per slot A [R, K] and B [N, R] (None for rank None: the slot leaves this matmul alone)."""
    a = [None if r is None else rand(r, K, dtype=dtype, seed=seed + 2 * i, scale=K ** -0.5) for i, r in enumerate(ranks)]
    b = [None if r is None else rand(N, r, dtype=dtype, seed=seed + 2 * i + 1) for i, r in enumerate(ranks)]
    return a, b


def run(x, y, row_slots, a, b, reference=False):
    ops.lora_apply(dl(x), dl(y), dl(row_slots), [None if t is None else dl(t) for t in a],
                   [None if t is None else dl(t) for t in b], reference=reference)


# a step's rows: decode rows alternating adapters (runs of one), a long prefill run, rows without one
SLOT_PATTERNS = {
    'decode-mix': [0, 1, -1, 2, 0, 0, 3, 1],
    'prefill-runs': [1] * 37 + [-1] * 5 + [0] * 20 + [2],
    'one-row': [2],
    'none': [-1, -1, -1],
}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('pattern', list(SLOT_PATTERNS))
@pytest.mark.parametrize('K,N', [(64, 96), (136, 40)])
def test_lora_apply_matches_torch(dtype, pattern, K, N):
    row_slots = torch.tensor(SLOT_PATTERNS[pattern], dtype=torch.int32)
    T = len(row_slots)
    x, y = rand(T, K, dtype=dtype, seed=1), rand(T, N, dtype=dtype, seed=2)
    a, b = adapters(K, N, [8, 4, 16, None], dtype)  # slot 3 does not adapt this matmul
    want = reference(x, y, row_slots, a, b)
    for ref in (False, True):
        got = y.clone()
        run(x, got, row_slots, a, b, reference=ref)
        tol = {torch.float32: dict(atol=1e-5, rtol=1e-5)}.get(dtype, dict(atol=0, rtol=0))
        if dtype != torch.float32:  # one rounding of y's sum; the float32 sums may sit across a tie
            ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
            tol = dict(atol=1e-3, rtol=ulp)
        torch.testing.assert_close(got.double(), want.double(), **tol)
        untouched = (row_slots < 0) | (row_slots == 3)
        assert torch.equal(got[untouched], y[untouched])  # rows without an adapter keep their bits


def test_lora_apply_strided_y():
    """y a column slice of a wider buffer (its rows ld apart): only those columns change."""
    T, K, N = 9, 48, 32
    row_slots = torch.tensor([0, 0, 0, 1, -1, 1, 1, 0, 1], dtype=torch.int32)
    x = rand(T, K, seed=3)
    buf = rand(T, 3 * N, seed=4)
    a, b = adapters(K, N, [6, 2], torch.float32)
    y = buf[:, N:2 * N]
    assert y.stride(0) == 3 * N
    want = reference(x, y.clone(), row_slots, a, b)
    before = buf.clone()
    run(x, y, row_slots, a, b)
    torch.testing.assert_close(buf[:, N:2 * N], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(buf[:, :N], before[:, :N]) and torch.equal(buf[:, 2 * N:], before[:, 2 * N:])


def test_lora_apply_strided_x():
    T, K, N = 5, 40, 24
    row_slots = torch.tensor([1, 1, 0, -1, 0], dtype=torch.int32)
    wide = rand(T, 2 * K, seed=5)
    x = wide[:, K:]
    a, b = adapters(K, N, [3, 5], torch.float32)
    y = rand(T, N, seed=6)
    want = reference(x, y, row_slots, a, b)
    run(x, y, row_slots, a, b)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_lora_apply_rows_do_not_depend_on_the_batch():
    """A row's result has the same bits alone as inside a run of its adapter, on 1 or 2 threads."""
    T, K, N = 24, 256, 512
    row_slots = torch.tensor([0] * 12 + [1] * 12, dtype=torch.int32)
    x, y = rand(T, K, seed=7), rand(T, N, seed=8)
    a, b = adapters(K, N, [16, 8], torch.float32)
    batched = y.clone()
    run(x, batched, row_slots, a, b)
    alone = y[5:6].clone()
    run(x[5:6], alone, row_slots[5:6], a, b)
    assert torch.equal(alone[0], batched[5])
    threads = ops.num_threads()
    try:
        ops.set_num_threads(1)
        single = y.clone()
        run(x, single, row_slots, a, b)
    finally:
        ops.set_num_threads(threads)
    assert torch.equal(single, batched)


def test_lora_apply_checks_its_arguments():
    x, y = rand(3, 16), rand(3, 8)
    a, b = adapters(16, 8, [4], torch.float32)
    with pytest.raises(ValueError, match=r'row_slots\[1\] = 1'):
        run(x, y, torch.tensor([0, 1, -1], dtype=torch.int32), a, b)
    with pytest.raises(ValueError, match='row_slots'):
        run(x, y, torch.tensor([0, 0], dtype=torch.int32), a, b)
    with pytest.raises(ValueError, match=r'a\[0\]'):
        run(x, y, torch.zeros(3, dtype=torch.int32), [rand(4, 15)], b)
    with pytest.raises(ValueError, match=r'b\[0\]'):
        run(x, y, torch.zeros(3, dtype=torch.int32), a, [rand(8, 5)])
    with pytest.raises(ValueError, match='only one of a and b'):
        run(x, y, torch.zeros(3, dtype=torch.int32), a, [None])
