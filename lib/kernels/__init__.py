"""lmd's kernel library (``lmd.kernels``): the kernels both engines run on, owned by neither.

``ops`` holds the CPU kernels on DLPack tensors (``lib/kernels/csrc/cpu``, chosen at run time:
AVX2/FMA/F16C where the CPU has them, a scalar reference everywhere); TurboMind links the same
kernels into its engine, and the PyTorch engine, ``lite`` and the tests call them through here.
``cuda`` holds the GPU kernels (``csrc/cuda``) when lmd was built with them, else None.
See README.md in this folder for the layout.
"""
import importlib
import importlib.util
import os
import sys


def load_extension(package: str, name: str, env_var: str):
    """``package``'s compiled module ``name``, or the build the environment variable ``env_var``
    names instead (tools/sanitize.sh's ASan build). TurboMind loads its extension through this too."""
    path = os.environ.get(env_var)
    if not path:
        return importlib.import_module(f'{package}.{name}')
    spec = importlib.util.spec_from_file_location(f'{package}.{name}', path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_kernels = load_extension(__name__, '_kernels', 'LMD_KERNELS_EXT')
ops = _kernels.ops
__version__ = _kernels.__version__
with_cuda: bool = _kernels.with_cuda
# The CUDA kernels (csrc/cuda) on DLPack views of device tensors; None in a build without them
# (pip install . -C cmake.define.LMD_WITH_CUDA=ON builds them; see README.md here).
cuda = getattr(_kernels, 'cuda', None)
with_openmp: bool = _kernels.with_openmp


def cpu_features() -> dict:
    """Instruction sets the CPU kernels may use here, e.g. ``{'avx2': True, ...}``."""
    return _kernels.cpu_features()


def pack_w4a16_panels(qweight, scales, mins):
    """(qpanels, spanels, mpanels): a W4A16 matmul (qweight [N, K / 2], scales and mins [N, K / G]) in the
    64-wide panels ``ops.linear_w4a16_packed`` reads (``ops.pack_w4a16``; csrc/cpu/gemm.h)."""
    import torch
    from torch.utils.dlpack import to_dlpack

    panels = -(-qweight.shape[0] // 64)
    qp = torch.empty(panels, qweight.shape[1] // 4, 64, dtype=torch.int32)
    sp, mp = (torch.empty(panels, scales.shape[1], 64, dtype=scales.dtype) for _ in range(2))
    ops.pack_w4a16(*(to_dlpack(t) for t in (qweight, scales, mins, qp, sp, mp)))
    return qp, sp, mp


def pack_w8a16_panels(qweight, scales):
    """(qpanels, spanels): a W8A16 matmul (qweight int8 [N, K], scales [N, K / G]) in the 16-wide
    panels ``ops.linear_w8a16_packed`` reads (``ops.pack_w8a16``; csrc/cpu/gemm.h), the scales in
    float16 where that holds every one exactly (GGUF Q8_0's: a sixth fewer bytes per weight)."""
    import torch
    from torch.utils.dlpack import to_dlpack

    half = scales.half()
    if torch.equal(half.float(), scales.float()):
        scales = half
    elif scales.dtype != torch.float32:
        scales = scales.float()
    panels = -(-qweight.shape[0] // 16)
    qp = torch.empty(panels, qweight.shape[1], 16, dtype=torch.int8)
    sp = torch.empty(panels, scales.shape[1], 16, dtype=scales.dtype)
    ops.pack_w8a16(*(to_dlpack(t.contiguous()) for t in (qweight, scales, qp, sp)))
    return qp, sp


def gguf_to_w8a16(raw, type_id: int):
    """(qweight int8 [N, K], scales float32 [N, K / G]): GGUF blocks (raw uint8 [N, row bytes]) of a type
    without float mins (Q4_0, Q5_0, Q8_0, IQ4_NL; Q6_K in groups G of 16) in the W8A16 layout, the same
    weights exactly (``ops.gguf_to_w8a16``; csrc/cpu/gguf.h)."""
    import torch
    from torch.utils.dlpack import to_dlpack

    group = ops.gguf_w8a16_group(type_id)
    block = next((v for v in ops.GGUF_TYPES.values() if v[0] == type_id), None)
    if not group or block is None:
        raise ValueError(f'GGUF type {type_id} has float mins or is not one lmd runs: it has no W8A16 form')
    k = raw.shape[1] // block[2] * block[1]
    qweight = torch.empty(raw.shape[0], k, dtype=torch.int8)
    scales = torch.empty(raw.shape[0], k // group, dtype=torch.float32)
    ops.gguf_to_w8a16(to_dlpack(raw.contiguous()), type_id, to_dlpack(qweight), to_dlpack(scales))
    return qweight, scales


def release_openmp_threads() -> bool:
    """Let the calling thread's idle OpenMP workers exit (torch's pool, once loaded), so that the
    kernels' team does not share the cores with a second, idle one (see bindings/module.cc)."""
    return _kernels.release_openmp_threads()
