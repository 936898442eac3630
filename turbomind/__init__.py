"""TurboMind: lmd's C++ engine (``lmd.turbomind._turbomind``); see README.md here.

``TurbomindEngine`` (``engine.py``) is the Engine interface over it; ``TurbomindModel``
(``model.py``) the model alone, driven step by step; ``_turbomind.ops`` the CPU kernels.
"""
from . import _turbomind

__version__ = _turbomind.__version__


def cpu_features() -> dict:
    """Instruction sets the CPU kernels may use here, e.g. ``{'avx2': True, ...}``."""
    return _turbomind.cpu_features()
