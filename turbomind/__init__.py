"""TurboMind: lmd's C++ engine (``lmd.turbomind._turbomind``).

The engine itself lands with its own issue; today the native module proves the
build path and reports the CPU features its kernels will dispatch on.
"""
from . import _turbomind

__version__ = _turbomind.__version__


def cpu_features() -> dict:
    """Instruction sets the CPU kernels may use here, e.g. ``{'avx2': True, ...}``."""
    return _turbomind.cpu_features()
