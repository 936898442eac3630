"""Re-quantize a GGUF file with llama.cpp's own quantizer (``llama_cpp.llama_model_quantize`` of
llama-cpp-python, an optional dependency: ``benchmark/setup_llamacpp.sh`` installs it), into any type
llama.cpp writes: what users download (Q4_K_M's mixed file, Q5_0, Q6_K ...) made here from the shipped
SmolLM2 file, for the tests and benchmarks of the GGUF block kernels."""
from __future__ import annotations

import os


def llama_cpp_missing() -> str | None:
    """Why llama-cpp-python cannot be used here (None when it can): an installed package whose import
    fails (a missing dependency, a shared library that does not load) counts as missing, with its error."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # its loader raises RuntimeError/OSError as well as ImportError
        return f'llama-cpp-python is not usable ({type(e).__name__}: {e})'
    return None


def quantize_gguf(src: str, dst: str, ftype: str = 'Q4_K_M', threads: int = 2) -> str:
    """Write ``dst`` from ``src`` in llama.cpp's file type ``ftype`` (e.g. 'Q4_K_M', 'Q5_0', 'Q6_K'), its
    quantized tensors re-quantized from their dequantized values (as ``llama-quantize
    --allow-requantize`` does); returns ``dst``. Skips the work when ``dst`` exists."""
    if os.path.isfile(dst):
        return dst
    missing = llama_cpp_missing()
    if missing:
        raise RuntimeError(f'quantize_gguf needs llama-cpp-python (pip install llama-cpp-python, or '
                           f'benchmark/setup_llamacpp.sh): {missing}')
    import llama_cpp
    code = getattr(llama_cpp, f'LLAMA_FTYPE_MOSTLY_{ftype}', None)
    if code is None:
        raise ValueError(f'ftype {ftype!r} is not a llama.cpp file type (Q4_K_M, Q5_0, Q6_K, ...)')
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.nthread = threads
    params.allow_requantize = True
    tmp = f'{dst}.{os.getpid()}.tmp'
    if llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params) != 0:
        raise RuntimeError(f'llama.cpp could not quantize {src} to {ftype}')
    os.replace(tmp, dst)
    return dst
