"""``lmd convert MODEL OUT_DIR``: a GGUF file as an HF-style directory, or (``--backend
turbomind``) any model TurboMind runs in TurboMind's own layout.

The HF-style output (model.safetensors in float32, config.json, tokenizer.json,
tokenizer_config.json, generation_config.json) loads in ``transformers`` and in
both lmd engines. The TurboMind output (``lmd/weights/turbomind_layout.py``) holds the
fused, already quantized tensors and the same config and tokenizer files; it loads
in TurboMind alone, without its source. Both carry ``lmd_conversion.json`` (source,
size, mtime, layout), by which a later ``convert`` knows it may replace the directory.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from .conversion import CONVERSION_MARKER, Writer, write_conversion, write_hf, write_marked
from .errors import LmdError, ModelFormatError
from .model_path import resolve_model_path

# With overwrite=True into a foreign directory, its weight files are removed too so a
# stale shard index cannot shadow the new weights.
_WEIGHT_SUFFIXES = ('.safetensors', '.safetensors.index.json', '.bin', '.bin.index.json')
LAYOUTS = {None: 'hf', 'pytorch': 'hf', 'turbomind': 'turbomind'}  # --backend -> what is written


class OutputDirNotEmptyError(LmdError, FileExistsError):
    """The output directory has files that an earlier conversion did not write."""


def _writer(layout: str, dtype: str) -> Writer:
    """What writes ``layout``: the HF-style one, or TurboMind's (``lmd.weights.turbomind_layout``)."""
    if layout == 'hf':
        return write_hf

    def write_turbomind(src: str, out_dir: str) -> None:
        from .weights.turbomind_layout import export
        if os.path.isdir(src):
            export(src, out_dir, dtype)
        else:  # a GGUF: through its HF layout, from which TurboMind takes the 4- and 8-bit matmuls as they are
            staging = os.path.join(out_dir, '.gguf')
            write_marked(src, staging)
            export(staging, out_dir, dtype)
            shutil.rmtree(staging)
    return write_turbomind


def _write_into(src: str, out_dir: str, layout: str, dtype: str) -> None:
    """overwrite=True into a directory that is not ours: replace only what a conversion owns."""
    tmp = tempfile.mkdtemp(prefix='.lmd-convert-tmp-', dir=out_dir)
    try:
        built = write_conversion(src, os.path.join(tmp, 'out'), layout=layout, writer=_writer(layout, dtype))
        for f in os.listdir(out_dir):
            p = os.path.join(out_dir, f)
            if f.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(p):
                os.remove(p)
        for f in os.listdir(built):
            dst = os.path.join(out_dir, f)
            if os.path.isdir(dst) and not os.path.islink(dst):
                shutil.rmtree(dst)
            os.replace(os.path.join(built, f), dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert(model: str, out_dir: str, overwrite: bool = False, backend: str | None = None,
            dtype: str = 'auto') -> str:
    """Convert ``model`` into ``out_dir``; returns its absolute path.

    ``backend`` None or 'pytorch': a GGUF file (a path, or 'smollm2') as an HF-style directory.
    'turbomind': a GGUF file, or an HF directory (float, AWQ, W8A8), in TurboMind's layout, with
    its tensors in ``dtype`` ('auto': the checkpoint's).
    """
    if backend not in LAYOUTS:
        raise ValueError(f"--backend {backend!r} is invalid: allowed values are 'pytorch', 'turbomind'")
    layout = LAYOUTS[backend]
    if layout == 'hf' and dtype != 'auto':
        raise ValueError('--dtype applies to --backend turbomind; the HF-style output is float32')
    if dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
        raise ValueError(f"--dtype {dtype!r} is invalid: allowed values are 'auto', 'float32', 'bfloat16', 'float16'")
    src = resolve_model_path(model)
    if layout == 'hf' and not os.path.isfile(src):
        raise ModelFormatError(f'{src} is a directory; lmd convert takes a .gguf file '
                               '(with --backend turbomind, also a model directory)')
    out = os.path.abspath(os.path.expanduser(out_dir))
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputDirNotEmptyError(f'{out} exists and is not a directory')
    if os.path.isdir(out) and os.listdir(out):
        if os.path.isfile(os.path.join(out, CONVERSION_MARKER)):
            return write_conversion(src, out, layout=layout, writer=_writer(layout, dtype))
        if not overwrite:
            raise OutputDirNotEmptyError(
                f'{out} is not empty and is not an earlier lmd conversion; '
                'pick another directory or pass overwrite=True (--overwrite)')
        _write_into(src, out, layout, dtype)
        return out
    return write_conversion(src, out, layout=layout, writer=_writer(layout, dtype))
