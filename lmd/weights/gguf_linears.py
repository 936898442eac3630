"""A GGUF conversion's quantized matmuls as they are, instead of the dequantized float weights
``lmd convert`` wrote beside them: its Q4_0 / Q4_1 / Q4_K matmuls in the W4A16 layout (a Q4_K block's
eight sub-blocks are eight groups of 32) and a Q8_0 lm_head in W8A16 (``quant_layouts.py``), bit-exact; and every matmul of a block type the kernel library
multiplies in place (``gguf_blocks_for``: Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL at their own bit
widths; lib/kernels/csrc/cpu/gguf.h), as the file stores them. The engines run the Q5_0 / Q8_0 / Q6_K
ones as W8A16 where they can (``quant_layouts.gguf_as_w8a16``), exactly.

``gguf_w4a16_for`` / ``gguf_head_w8a16_for`` take a directory ``lmd convert`` made from a GGUF
file (its marker names the file, ``lmd.conversion``) and cache what they read in it::

    DIR/turbomind/w4a16.2.safetensors      <hf name>.qweight / .scales / .mins
    DIR/turbomind/head_w8a16.safetensors   qweight, scales
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

from lmd.conversion import conversion_source
from lmd.gguf_model import (STACKED_EXPERTS, gguf_arch, gguf_metadata, hf_tensor_name, open_gguf, rope_permuted_heads,
                            unpermute_rope)

from .quant_layouts import from_gguf_q4_0, from_gguf_q4_1, from_gguf_q4_k, from_gguf_q8_0
from .schema import CHECKPOINT_FUSED, LINEARS


@functools.lru_cache(maxsize=2)
def _reader(path: str, stamp: tuple[int, int]):
    """``open_gguf(path)``, parsed once for every reader below (a GGUF's metadata, its vocabulary above
    all, takes seconds to parse); ``stamp`` (mtime, size) keys it to the file's current contents."""
    return open_gguf(path)


def _open(path: str):
    st = os.stat(path)
    return _reader(path, (st.st_mtime_ns, st.st_size))


# The matmul weights that run in W4A16 straight from a GGUF file.
_GGUF_W4_READERS = {'Q4_0': from_gguf_q4_0, 'Q4_1': from_gguf_q4_1, 'Q4_K': from_gguf_q4_k}
# every matmul a GGUF may hold, Phi-3's fused ones too
_LINEAR_SUFFIXES = tuple(f'.{name}.weight' for name in LINEARS + sum(CHECKPOINT_FUSED.values(), ()))


def read_gguf_w4a16(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF name -> (qweight, scales, mins) for every Q4_0 / Q4_1 / Q4_K matmul weight of a GGUF file,
    in the W4A16 layout (group size 32), bit-exact; llama.cpp's row permutation of q and k
    undone as ``lmd.gguf_model`` undoes it. Tensors of other types are left out (the caller
    takes them from the dequantized model)."""
    reader = _open(path)
    meta = gguf_metadata(reader, path)
    permuted, arch = rope_permuted_heads(meta), gguf_arch(meta)
    heads = None if permuted is None else dict(zip(('q_proj.weight', 'k_proj.weight'), permuted))
    out = {}
    for t in reader.tensors:
        convert = _GGUF_W4_READERS.get(t.tensor_type.name)
        name = hf_tensor_name(t.name, path, arch)
        if convert is None or not name.endswith(_LINEAR_SUFFIXES):
            continue
        k, n = (int(d) for d in t.shape)  # GGUF lists dims fastest first
        qweight, scales, mins = convert(t.data, n, k)
        suffix = name.rsplit('.', 2)[-2] + '.weight'
        if heads is not None and suffix in heads:  # a row permutation: whole rows move, groups intact
            rows = torch.from_numpy(unpermute_rope(np.arange(n), heads[suffix]).copy())
            qweight, scales, mins = qweight[rows], scales[rows], mins[rows]
        out[name] = (qweight.contiguous(), scales.contiguous(), mins.contiguous())
    return out


# Beside the converted model, in a folder of its own so weight loaders never mistake them for shards.
W4A16_CACHE_FILE = os.path.join('turbomind', 'w4a16.2.safetensors')  # .2: Q4_K too (.1 had Q4_0 / Q4_1)
HEAD_W8A16_CACHE_FILE = os.path.join('turbomind', 'head_w8a16.safetensors')
BLOCKS_CACHE_FILE = os.path.join('turbomind', 'gguf_blocks.2.safetensors')  # .2: MoE experts too
_EMPTY = '__empty__'  # what a cache of nothing holds, so that nothing is not looked for again


def _cached(model_dir: str, cache_file: str, build) -> dict[str, torch.Tensor] | None:
    """Flat tensors from model_dir/cache_file, or ``build(gguf_source)`` (None or empty: nothing, which
    is cached too), then written there atomically (skipped in a read-only directory). None when
    model_dir is not a GGUF conversion (or its file is gone) and has no cache."""
    import tempfile

    from safetensors.torch import load_file, save_file
    cache = os.path.join(model_dir, cache_file)
    if os.path.isfile(cache):
        return {k: v for k, v in load_file(cache).items() if k != _EMPTY}
    source = conversion_source(model_dir)
    if source is None or not os.path.isfile(source):
        return None
    flat = build(source) or {}
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix='.cache-', suffix='.tmp', dir=os.path.dirname(cache))
        os.close(fd)
        save_file(flat or {_EMPTY: torch.zeros(0)}, tmp)
        os.replace(tmp, cache)
    except OSError:
        pass
    return flat


def gguf_w4a16_for(model_dir: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """The W4A16 matmul weights of a directory that ``lmd convert`` made from a GGUF file
    (``read_gguf_w4a16``), cached in the directory; None for any other directory."""
    fields = ('qweight', 'scales', 'mins')

    def build(source):
        return {f'{n}.{f}': t for n, parts in read_gguf_w4a16(source).items() for f, t in zip(fields, parts)}
    flat = _cached(model_dir, W4A16_CACHE_FILE, build)
    if not flat:
        return None
    names = {k.rsplit('.', 1)[0] for k in flat}
    return {n: tuple(flat[f'{n}.{f}'] for f in fields) for n in names}


# The block types ops.linear_gguf multiplies as stored (lib/kernels/csrc/cpu/gguf.h).
GGUF_BLOCK_TYPES = ('Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0', 'Q4_K', 'Q5_K', 'Q6_K', 'IQ4_NL')


def read_gguf_blocks(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF name -> (raw uint8 [N, row bytes], ggml type id as int32 [1]) for every matmul weight of a
    GGUF file (the lm_head too: ``output.weight``, or the tied ``token_embd.weight``) whose type is
    one of ``GGUF_BLOCK_TYPES``: the blocks as stored, with llama.cpp's row permutation of q and k
    undone (whole rows move); a stacked experts tensor (``ffn_*_exps`` [E, N, K]) as one matmul per
    expert under HF's per-expert names. Other tensors are left out (the caller takes them in float)."""
    reader = _open(path)
    meta = gguf_metadata(reader, path)
    permuted, arch = rope_permuted_heads(meta), gguf_arch(meta)
    heads = None if permuted is None else dict(zip(('q_proj.weight', 'k_proj.weight'), permuted))
    tensors = {t.name: t for t in reader.tensors}
    head = 'output.weight' if 'output.weight' in tensors else 'token_embd.weight'
    out = {}
    for t in reader.tensors:
        if t.tensor_type.name not in GGUF_BLOCK_TYPES:
            continue
        name = 'lm_head.weight' if t.name == head else hf_tensor_name(t.name, path, arch)
        type_id = torch.tensor([int(t.tensor_type)], dtype=torch.int32)
        stacked = STACKED_EXPERTS.match(name or '')
        if stacked:  # [E, N, row bytes] -> expert e's blocks under its own name
            prefix, matmul = stacked.groups()
            raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[2]), int(t.shape[1]), -1)
            out.update({f'{prefix}{e}.{matmul}.weight': (torch.from_numpy(np.array(raw[e], order='C')),
                                                        type_id.clone()) for e in range(len(raw))})
            continue
        if name != 'lm_head.weight' and not name.endswith(_LINEAR_SUFFIXES):
            continue
        n = int(t.shape[1])
        raw = np.asarray(t.data).view(np.uint8).reshape(n, -1)
        suffix = name.rsplit('.', 2)[-2] + '.weight'
        if heads is not None and suffix in heads:
            raw = unpermute_rope(raw, heads[suffix])
        out[name] = (torch.from_numpy(np.array(raw, order='C')), type_id)
    return out


def gguf_blocks_for(model_dir: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """``read_gguf_blocks`` of the GGUF file a directory ``lmd convert`` made was converted from,
    cached in the directory; None for any other directory."""
    def build(source):
        return {f'{n}.{f}': t for n, parts in read_gguf_blocks(source).items() for f, t in zip(('raw', 'type'), parts)}
    flat = _cached(model_dir, BLOCKS_CACHE_FILE, build)
    if not flat:
        return None
    return {n: (flat[f'{n}.raw'], flat[f'{n}.type']) for n in {k.rsplit('.', 1)[0] for k in flat}}


def gguf_head_w8a16_for(model_dir: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qweight int8, scales) of the lm_head of a GGUF conversion whose head (``output.weight``,
    or the tied ``token_embd.weight``) is Q8_0, bit-exact; None otherwise."""
    def build(source):
        head = read_gguf_head_q8_0(source)
        return None if head is None else {'qweight': head[0], 'scales': head[1]}
    flat = _cached(model_dir, HEAD_W8A16_CACHE_FILE, build)
    return None if not flat else (flat['qweight'], flat['scales'])


def read_gguf_head_q8_0(path: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qweight int8, scales) in the W8A16 layout of a GGUF's lm_head (``output.weight``, or the tied
    ``token_embd.weight``) when it is Q8_0, bit-exact; None otherwise."""
    reader = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get('output.weight', tensors.get('token_embd.weight'))
    if t is None or t.tensor_type.name != 'Q8_0':
        return None
    k, n = (int(d) for d in t.shape)
    return from_gguf_q8_0(t.data, n, k)
