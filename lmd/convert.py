"""``lmd convert MODEL.gguf OUT_DIR``: a GGUF file as an HF-style directory.

The output (model.safetensors in float32, config.json, tokenizer.json,
tokenizer_config.json, generation_config.json) loads in ``transformers`` and in
both lmd engines. It also carries ``lmd_conversion.json`` (source, size, mtime),
by which a later ``convert`` knows it may replace the directory.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from .errors import LmdError, ModelFormatError
from .model_path import CONVERSION_MARKER, conversion_info, resolve_model_path

# Files a conversion writes; with overwrite=True into a foreign directory, other
# weight files are removed too so a stale shard index cannot shadow the new weights.
_OUTPUT_FILES = ('model.safetensors', 'config.json', 'tokenizer.json', 'tokenizer_config.json',
                 'generation_config.json', CONVERSION_MARKER)
_WEIGHT_SUFFIXES = ('.safetensors', '.safetensors.index.json', '.bin', '.bin.index.json')


class OutputDirNotEmptyError(LmdError, FileExistsError):
    """The output directory has files that an earlier conversion did not write."""


def write_conversion(gguf_path: str, out_dir: str, keep_existing: bool = False) -> str:
    """Convert into a hidden temp sibling of ``out_dir``, then rename it into place.

    An interrupted run leaves no directory under the final name. An existing
    ``out_dir`` is replaced, unless ``keep_existing`` and it already holds a
    finished conversion (another process won the race).
    """
    from .gguf_model import convert_gguf
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{name}.tmp-', dir=parent)
    trash = None
    try:
        convert_gguf(gguf_path, tmp)
        with open(os.path.join(tmp, CONVERSION_MARKER), 'w', encoding='utf-8') as f:
            json.dump(conversion_info(gguf_path), f, indent=2)
        if os.path.isdir(out_dir):
            if keep_existing and os.path.isfile(os.path.join(out_dir, CONVERSION_MARKER)):
                return out_dir
            trash = tempfile.mkdtemp(prefix=f'.{name}.old-', dir=parent)
            os.replace(out_dir, os.path.join(trash, name))
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if trash:
            shutil.rmtree(trash, ignore_errors=True)
    return out_dir


def _write_into(gguf_path: str, out_dir: str) -> None:
    """overwrite=True into a directory that is not ours: replace only what a conversion owns."""
    tmp = tempfile.mkdtemp(prefix='.lmd-convert-tmp-', dir=out_dir)
    try:
        write_conversion(gguf_path, os.path.join(tmp, 'out'))
        for f in os.listdir(out_dir):
            p = os.path.join(out_dir, f)
            if f.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(p):
                os.remove(p)
        for f in _OUTPUT_FILES:
            os.replace(os.path.join(tmp, 'out', f), os.path.join(out_dir, f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert(model: str, out_dir: str, overwrite: bool = False) -> str:
    """Convert the GGUF ``model`` (a path, or 'smollm2') into ``out_dir``; returns its absolute path."""
    src = resolve_model_path(model)
    if not os.path.isfile(src):
        raise ModelFormatError(f'{src} is a directory; lmd convert takes a .gguf file')
    out = os.path.abspath(os.path.expanduser(out_dir))
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputDirNotEmptyError(f'{out} exists and is not a directory')
    if os.path.isdir(out) and os.listdir(out):
        if os.path.isfile(os.path.join(out, CONVERSION_MARKER)):
            return write_conversion(src, out)
        if not overwrite:
            raise OutputDirNotEmptyError(
                f'{out} is not empty and is not an earlier lmd conversion; '
                'pick another directory or pass overwrite=True (--overwrite)')
        _write_into(src, out)
        return out
    return write_conversion(src, out)
