"""The PyTorch engine: Python scheduler and paged KV cache, models in torch (see README.md)."""
from .engine import PytorchEngine

__all__ = ['PytorchEngine']
