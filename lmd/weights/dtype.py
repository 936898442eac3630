"""The dtypes weights run in, by name, and ``dtype='auto'`` resolved against a checkpoint."""
from __future__ import annotations

import torch

from lmd.model_config import ModelConfig

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


def resolve_dtype(dtype: str, model_config: ModelConfig) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype; an explicit dtype wins."""
    return DTYPES[model_config.torch_dtype if dtype == 'auto' else dtype]
