"""The one dispatch table of the PyTorch backend's kernels.

``get_kernels(device, backend)`` returns a ``Kernels`` namespace; models call
only through it. ``torch`` (the reference, and the CPU path) runs anywhere;
``triton`` runs the Triton kernels of ``kernels/triton`` on CUDA tensors (or on
CPU tensors under ``TRITON_INTERPRET=1``, which is how the tests check them),
and borrows the torch version wherever it has none of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import torch_ops

BACKENDS = ('torch', 'triton')


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable          # (x[T, H], weight[H], eps) -> [T, H]
    apply_rotary: Callable      # (q[T, Hq, D], k[T, Hk, D], positions[T], cos_sin_cache) -> (q, k)
    silu_and_mul: Callable      # (x[T, 2I]) -> [T, I]
    fill_kv_cache: Callable     # (k, v[T, Hk, D], k_cache, v_cache, slot_mapping[T]) -> None
    paged_attention: Callable   # (q[T, Hq, D], k_cache, v_cache, ctx, scale) -> [T, Hq, D]


TORCH_KERNELS = Kernels(
    name='torch',
    rms_norm=torch_ops.rms_norm,
    apply_rotary=torch_ops.apply_rotary,
    silu_and_mul=torch_ops.silu_and_mul,
    fill_kv_cache=torch_ops.fill_kv_cache,
    paged_attention=torch_ops.paged_attention,
)


def _triton_kernels() -> Kernels:
    try:
        from . import triton as triton_ops
    except ImportError as e:
        raise RuntimeError(f"kernel backend 'triton' needs the triton package: {e}") from None
    return Kernels(
        name='triton',
        rms_norm=triton_ops.rms_norm,
        apply_rotary=triton_ops.apply_rotary,
        silu_and_mul=triton_ops.silu_and_mul,
        fill_kv_cache=triton_ops.fill_kv_cache,
        paged_attention=triton_ops.paged_attention,
    )


def get_kernels(device: torch.device | str = 'cpu', backend: str | None = None) -> Kernels:
    """Kernels for ``device``; backend None picks 'torch' on CPU and 'triton' on CUDA."""
    device = torch.device(device)
    if backend is None:
        backend = 'triton' if device.type == 'cuda' else 'torch'
    if backend == 'torch':
        return TORCH_KERNELS
    if backend == 'triton':
        return _triton_kernels()
    raise ValueError(f'unknown kernel backend {backend!r}; choose one of {", ".join(BACKENDS)}')
