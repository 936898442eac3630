"""What the CUDA kernel tests share: the skip (no device, or lmd built without its CUDA half),
DLPack capsules and the stream."""
import pytest
import torch
from torch.utils.dlpack import to_dlpack

import lmd.kernels


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return 'no CUDA device'
    if lmd.kernels.cuda is None:
        return 'lmd built without its CUDA half (pip install . -C cmake.define.LMD_WITH_CUDA=ON)'
    return None


requires_cuda_kernels = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or '')


def cap(t: torch.Tensor):
    """The DLPack capsule the kernels take (no copy)."""
    return to_dlpack(t)


def stream() -> int:
    """The address of torch's current CUDA stream: the kernels run on it, in order with torch's work."""
    return torch.cuda.current_stream().cuda_stream
