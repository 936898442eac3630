"""The one dispatch table of the PyTorch backend's kernels.

``get_kernels(device, backend)`` returns a ``Kernels`` namespace; models call
only through it. ``torch`` (the reference) runs anywhere; ``native`` (the CPU
default) runs TurboMind's C++ kernels for decode matmuls and attention and
borrows torch's for the rest; ``triton`` runs the Triton kernels of
``kernels/triton`` on CUDA tensors (or on CPU tensors under
``TRITON_INTERPRET=1``, which is how the tests check them), and borrows the
torch version wherever it has none of its own; ``cuda`` runs lmd's own CUDA kernels
(``lmd.kernels.cuda``, see ``cuda.py``) on CUDA tensors and cuBLAS for float matmuls. On CUDA
the default stays 'triton' until the 'cuda' backend has passed tests/test_gpu.py on a GPU.

A linear layer's parameters go through ``prepare_linear(weight, bias)`` once at
load; ``linear(x, prepared)`` takes what it returned. A quantized weight (W4A16, W8A16,
W8A8) stays quantized: the torch kernels dequantize it at each call (the reference),
the native ones run TurboMind's quantized matmuls; the triton backend borrows torch's.
Models prepare through ``prepare_matmul``, which also takes the two forms no backend needs a
kernel for: a W4A16 matmul over permuted x (GPTQ act-order) and a matmul in parts.
The KV-cache kernels take ``k_params=``, ``v_params=`` for a quantized cache
(quant_policy 8 / 4); a backend without a quantized path of its own borrows torch's.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from lmd.weights.schema import dense_shape

from . import torch_ops

BACKENDS = ('torch', 'native', 'triton', 'cuda')


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable          # (x[T, H], weight[H], eps) -> [T, H]
    apply_rotary: Callable      # (q[T, Hq, D], k[T, Hk, D], positions[T], cos_sin_cache) -> (q, k)
    silu_and_mul: Callable      # (x[T, 2I]) -> [T, I]
    # The three cache kernels take k_params=, v_params= too: a quantized cache (torch_ops' docstring).
    fill_kv_cache: Callable     # (k, v[T, Hk, D], k_cache, v_cache, slot_mapping[T]) -> None
    # (q[T, Hq, D], k_cache, v_cache, ctx, scale, window=0, softcap=0.0, sinks=None) -> [T, Hq, D];
    # sinks: float32 [Hq], a logit per head in the softmax's denominator (gpt-oss)
    paged_attention: Callable
    # (x[T, H], residual[T, H], weight[H], eps) -> rms_norm(residual += x)
    add_rms_norm: Callable = torch_ops.add_rms_norm
    # (qkv[T, (Hq+2Hk)D], positions, cos_sin_cache, k_cache, v_cache, slot_mapping, Hq, Hk) -> rotated q[T, Hq, D]
    rope_fill_kv: Callable = torch_ops.rope_fill_kv
    # (weight[N, K] or a quantized tuple (lmd.weights.quant_layouts: W4A16, W8A8), bias[N] | None) -> params
    prepare_linear: Callable = torch_ops.prepare_linear
    linear: Callable = torch_ops.linear                  # (x[T, K], params) -> [T, N]
    gelu_tanh_and_mul: Callable = torch_ops.gelu_tanh_and_mul  # (x[T, 2I]) -> [T, I] (GeGLU: Gemma)
    # (x[T, H], gate_up[E, 2I, H], down[E, H, I], topk_weights[T, k], topk_ids[T, k], gate_up_bias=None,
    # down_bias=None, swiglu_limit=None, swiglu_alpha=1.0, linear=None) -> [T, H]: routed experts (torch_ops.moe;
    # quantized experts: gate_up and down lists of prepared matmuls, run by linear)
    moe: Callable = torch_ops.moe
    # (q[T, Hq, D], cache[num_blocks, block_size, 1, D], ctx, scale, v_dim) -> [T, Hq, v_dim]: latent attention,
    # values the first v_dim dims of the cached rows (DeepSeek-V2)
    paged_latent_attention: Callable = torch_ops.paged_latent_attention
    set_num_threads: Callable = lambda n: None           # threads of the backend's own kernels


TORCH_KERNELS = Kernels(
    name='torch',
    rms_norm=torch_ops.rms_norm,
    apply_rotary=torch_ops.apply_rotary,
    silu_and_mul=torch_ops.silu_and_mul,
    fill_kv_cache=torch_ops.fill_kv_cache,
    paged_attention=torch_ops.paged_attention,
)


def _native_kernels() -> Kernels:
    try:
        from . import native
    except ImportError as e:
        raise RuntimeError(f"kernel backend 'native' needs lmd's compiled extension: {e}") from None
    return Kernels(
        name='native',
        rms_norm=native.rms_norm,
        apply_rotary=torch_ops.apply_rotary,
        silu_and_mul=native.silu_and_mul,
        fill_kv_cache=torch_ops.fill_kv_cache,
        paged_attention=native.paged_attention,
        add_rms_norm=native.add_rms_norm,
        rope_fill_kv=native.rope_fill_kv,
        prepare_linear=native.prepare_linear,
        linear=native.linear,
        paged_latent_attention=native.paged_latent_attention,
        set_num_threads=native.set_num_threads,
    )


def _native_available() -> bool:
    try:
        from lmd import kernels  # noqa: F401
    except ImportError:  # a source tree with the extension not built
        return False
    return True


def _float_cache_only(kernel: Callable, reference: Callable) -> Callable:
    """``kernel`` for a float cache, ``reference`` (torch) for a quantized one."""
    def call(*args, k_params=None, v_params=None, **kwargs):
        if k_params is None:
            return kernel(*args, **kwargs)
        return reference(*args, k_params=k_params, v_params=v_params, **kwargs)
    return call


def _triton_kernels() -> Kernels:
    try:
        from . import triton as triton_ops
    except ImportError as e:
        raise RuntimeError(f"kernel backend 'triton' needs the triton package: {e}") from None
    fill_kv_cache = _float_cache_only(triton_ops.fill_kv_cache, torch_ops.fill_kv_cache)
    return Kernels(
        name='triton',
        rms_norm=triton_ops.rms_norm,
        apply_rotary=triton_ops.apply_rotary,
        silu_and_mul=triton_ops.silu_and_mul,
        fill_kv_cache=fill_kv_cache,
        paged_attention=_float_cache_only(triton_ops.paged_attention, torch_ops.paged_attention),
        add_rms_norm=lambda x, residual, weight, eps: triton_ops.rms_norm(residual.add_(x), weight, eps),
        rope_fill_kv=partial(torch_ops.rope_fill_kv, apply_rotary=triton_ops.apply_rotary,
                             fill_kv_cache=fill_kv_cache),
    )


def _cuda_kernels(device: torch.device) -> Kernels:
    if device.type != 'cuda':
        raise ValueError(f"kernel backend 'cuda' runs lmd's CUDA kernels on a CUDA device, not on {device}; "
                         "on the CPU choose 'native' or 'torch'")
    if device.index not in (None, 0):
        # the kernels launch on the current device, which is device 0 on the engine's thread
        raise ValueError(f"kernel backend 'cuda' runs on cuda:0 for now, not on {device}: choose 'triton' "
                         f"there, or run with CUDA_VISIBLE_DEVICES={device.index} and device='cuda'")
    try:
        from . import cuda as cuda_ops
    except ImportError as e:
        raise RuntimeError(f"kernel backend 'cuda' needs lmd built with its CUDA kernels ({e}): "
                           "pip install . -C cmake.define.LMD_WITH_CUDA=ON") from None
    return Kernels(
        name='cuda',
        rms_norm=cuda_ops.rms_norm,
        apply_rotary=torch_ops.apply_rotary,
        silu_and_mul=cuda_ops.silu_and_mul,
        fill_kv_cache=torch_ops.fill_kv_cache,
        paged_attention=cuda_ops.paged_attention,
        add_rms_norm=cuda_ops.add_rms_norm,
        rope_fill_kv=cuda_ops.rope_fill_kv,
        prepare_linear=cuda_ops.prepare_linear,
        linear=cuda_ops.linear,
    )


def get_kernels(device: torch.device | str = 'cpu', backend: str | None = None) -> Kernels:
    """Kernels for ``device``; backend None picks 'native' on CPU (or 'torch' where the
    extension is missing) and 'triton' on CUDA ('cuda' only when asked for, for now)."""
    device = torch.device(device)
    if backend is None:
        if device.type == 'cuda':
            backend = 'triton'
        else:
            backend = 'native' if _native_available() else 'torch'
    if backend == 'torch':
        return TORCH_KERNELS
    if backend == 'native':
        if device.type != 'cpu':
            raise ValueError(f"kernel backend 'native' runs on the CPU, not on {device}")
        return _native_kernels()
    if backend == 'triton':
        return _triton_kernels()
    if backend == 'cuda':
        return _cuda_kernels(device)
    raise ValueError(f'unknown kernel backend {backend!r}; choose one of {", ".join(BACKENDS)}')


class PermutedLinear:
    """A matmul over x's columns gathered, x[:, perm] (its weight holds k in perm's order)."""
    __slots__ = ('perm', 'params', 'linear')

    def __init__(self, perm: torch.Tensor, params, linear: Callable):
        self.perm, self.params, self.linear = perm, params, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.perm), self.params)


class LinearParts:
    """A matmul in parts, each the next columns of the output."""
    __slots__ = ('parts', 'linear')

    def __init__(self, parts: list, linear: Callable):
        self.parts, self.linear = parts, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.linear(x, p) for p in self.parts], dim=-1)


def prepare_matmul(kern: Kernels, weight: torch.Tensor | tuple | list, bias: torch.Tensor | None):
    """``kern.prepare_linear`` for any matmul ``lmd.weights.schema`` describes, these two included:
    (qweight, scales, mins, perm), W4A16 over x[:, perm]; and a list of quantized parts
    (``schema.fuse_quantized``), each the next rows of the weight, with those rows of ``bias``."""
    if isinstance(weight, list):
        rows = [dense_shape(w)[0] for w in weight]
        biases = [None] * len(weight) if bias is None else bias.split(rows)
        return LinearParts([prepare_matmul(kern, w, b) for w, b in zip(weight, biases)], kern.linear)
    if isinstance(weight, tuple) and len(weight) == 4:
        return PermutedLinear(weight[3].long(), kern.prepare_linear(weight[:3], bias), kern.linear)
    return kern.prepare_linear(weight, bias)
