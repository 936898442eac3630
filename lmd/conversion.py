"""A directory ``lmd convert`` wrote: the marker that says so, and the atomic write that makes one.

Every converted directory carries ``lmd_conversion.json`` (source, size, mtime, version, layout),
by which a later ``convert`` knows it may replace the directory and the weights layer finds the
GGUF a directory came from. A conversion is written into a hidden temp sibling and renamed into
place, so a directory with the final name is always complete. This module sits under both
``model_path`` (which converts a GGUF once into the cache) and ``convert`` (the command).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable

# Bump when the GGUF conversion's output changes, so old cache entries are not reused.
CONVERSION_VERSION = 2  # 2: gpt-oss and DeepSeek-V2 files; MoE experts in the blocks cache
# Written into every converted directory; `lmd convert` recognises its own output by it.
CONVERSION_MARKER = 'lmd_conversion.json'
# A directory in TurboMind's own layout (`lmd convert --backend turbomind`) has this;
# see lmd/weights/turbomind_layout.py.
TURBOMIND_CONFIG = os.path.join('turbomind', 'config.json')

# writer(src, out_dir): fills out_dir (made, or empty) with the conversion of src
Writer = Callable[[str, str], object]


def conversion_info(gguf_path: str) -> dict:
    st = os.stat(gguf_path)
    return {'source': os.path.abspath(gguf_path), 'size': st.st_size, 'mtime_ns': st.st_mtime_ns,
            'version': CONVERSION_VERSION}


def conversion_source(model_dir: str) -> str | None:
    """The file ``model_dir`` was converted from, if it is a conversion and the file is still there."""
    marker = os.path.join(model_dir, CONVERSION_MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding='utf-8') as f:
        source = json.load(f).get('source')
    return source if source and os.path.isfile(source) else None


def write_hf(src: str, out_dir: str) -> None:
    """The HF-style layout: a GGUF file as safetensors, config and tokenizer (``gguf_model``)."""
    from . import gguf_model
    gguf_model.convert_gguf(src, out_dir)


def write_marked(src: str, out_dir: str, layout: str = 'hf', writer: Writer = write_hf) -> None:
    """``writer(src, out_dir)``, then the marker."""
    writer(src, out_dir)
    with open(os.path.join(out_dir, CONVERSION_MARKER), 'w', encoding='utf-8') as f:
        json.dump({**conversion_info(src), 'layout': layout}, f, indent=2)


def write_conversion(src: str, out_dir: str, keep_existing: bool = False, layout: str = 'hf',
                     writer: Writer = write_hf) -> str:
    """Convert into a hidden temp sibling of ``out_dir``, then rename it into place.

    An interrupted run leaves no directory under the final name. An existing
    ``out_dir`` is replaced, unless ``keep_existing`` and it already holds a
    finished conversion (another process won the race).
    """
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{name}.tmp-', dir=parent)
    trash = None
    try:
        write_marked(src, tmp, layout, writer)
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
