"""The quantized layouts TurboMind runs, by the names its callers know.

They are the weights layer's, shared with the PyTorch engine and ``lmd lite``:
``lmd.weights.quant_layouts`` (W4A16 / W8A16 / W8A8 and the exact converters from GGUF and AWQ),
``lmd.weights.source_format`` (AWQ and W8A8 checkpoints), ``lmd.weights.gguf_linears`` (a GGUF
conversion's 4- and 8-bit matmuls). What is TurboMind's own, the panels its GEMM reads, is packed
at load in ``model.py`` (``pack_matmuls``).
"""
from lmd.weights.gguf_linears import (HEAD_W8A16_CACHE_FILE, W4A16_CACHE_FILE, gguf_head_w8a16_for,  # noqa: F401
                                      gguf_w4a16_for, read_gguf_head_q8_0, read_gguf_w4a16)
from lmd.weights.quant_layouts import (AWQ_ORDER, GGUF_BLOCK, Q4_0_BLOCK_BYTES, Q4_1_BLOCK_BYTES,  # noqa: F401
                                       Q8_0_BLOCK_BYTES, awq_pack, awq_unpack, dequantize_w4a16, dequantize_w8a8,
                                       dequantize_w8a16, from_awq, from_gguf_q4_0, from_gguf_q4_1, from_gguf_q8_0,
                                       pack_int4, quantize_w8, to_awq, unpack_int4)
from lmd.weights.source_format import awq_linears, w8a8_linears  # noqa: F401

_awq_unpack = awq_unpack  # its name before it was public
