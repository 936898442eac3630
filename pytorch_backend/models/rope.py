"""The RoPE tables the models read: the weights layer's (``lmd.weights.rope``), shared with TurboMind."""
from lmd.weights.rope import (MAX_CACHED_POSITIONS, build_cos_sin_cache, compute_inv_freq, rope_params,  # noqa: F401
                              rotary_dim)
