"""TurboMind: lmd's C++ engine (``lmd.turbomind._turbomind``); see README.md here.

``TurbomindEngine`` (``engine.py``) is the Engine interface over it; ``TurbomindModel``
(``model.py``) the model alone, driven step by step. Its kernels are the kernel library's
(``lmd.kernels``), linked into the extension.
"""
from lmd.kernels import load_extension

# imports lmd.kernels first either way: LlamaModel takes its HostTensors
_turbomind = load_extension(__name__, '_turbomind', 'LMD_TURBOMIND_EXT')

__version__ = _turbomind.__version__
