"""TurboMind: lmd's C++ engine (``lmd.turbomind._turbomind``); see README.md here.

``TurbomindEngine`` (``engine.py``) is the Engine interface over it; ``TurbomindModel``
(``model.py``) the model alone, driven step by step. Its kernels are the kernel library's
(``lmd.kernels``), linked into the extension.
"""
import os

if os.environ.get('LMD_TURBOMIND_EXT'):  # another build of the extension, e.g. tools/sanitize.sh's
    import importlib.util
    import sys
    _spec = importlib.util.spec_from_file_location(f'{__name__}._turbomind', os.environ['LMD_TURBOMIND_EXT'])
    _turbomind = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _turbomind
    _spec.loader.exec_module(_turbomind)
else:
    from . import _turbomind  # imports lmd.kernels first: LlamaModel takes its HostTensors

__version__ = _turbomind.__version__
