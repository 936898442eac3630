"""Triton kernels for CUDA (run on CPU tensors under TRITON_INTERPRET=1 for the tests).

One launcher per file, each with the same signature and layouts as its twin in
``kernels/torch_ops.py``. Prefill (non-decode) attention has no Triton kernel yet
and runs the torch version (gather + SDPA) on the same device.
"""
from .activation import silu_and_mul
from .kv_cache import fill_kv_cache
from .attention import paged_attention
from .norm import rms_norm
from .rotary import apply_rotary

__all__ = ['apply_rotary', 'fill_kv_cache', 'paged_attention', 'rms_norm', 'silu_and_mul']
