"""lmd's kernel library (``lmd.kernels``): the kernels both engines run on, owned by neither.

``ops`` holds the CPU kernels on DLPack tensors (``lib/kernels/csrc/cpu``, chosen at run time:
AVX2/FMA/F16C where the CPU has them, a scalar reference everywhere); TurboMind links the same
kernels into its engine, and the PyTorch engine, ``lite`` and the tests call them through here.
See README.md in this folder for the layout.
"""
import os

if os.environ.get('LMD_KERNELS_EXT'):  # another build of the extension, e.g. tools/sanitize.sh's
    import importlib.util
    import sys
    _spec = importlib.util.spec_from_file_location(f'{__name__}._kernels', os.environ['LMD_KERNELS_EXT'])
    _kernels = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _kernels
    _spec.loader.exec_module(_kernels)
else:
    from . import _kernels

ops = _kernels.ops
__version__ = _kernels.__version__
with_cuda: bool = _kernels.with_cuda
with_openmp: bool = _kernels.with_openmp


def cpu_features() -> dict:
    """Instruction sets the CPU kernels may use here, e.g. ``{'avx2': True, ...}``."""
    return _kernels.cpu_features()


def release_openmp_threads() -> bool:
    """Let the calling thread's idle OpenMP workers exit (torch's pool, once loaded), so that the
    kernels' team does not share the cores with a second, idle one (see bindings/module.cc)."""
    return _kernels.release_openmp_threads()
