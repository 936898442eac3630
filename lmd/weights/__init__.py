"""The weights layer: what both engines, ``lmd convert`` and ``lmd lite`` know about a model's
weights, so that none of them imports an engine to get it.

Reading order:

- ``schema.py``: HF tensor names and shapes per architecture (``check_weights``), the seven
  matmuls of a layer and how they fuse (q/k/v -> ``qkv``, gate/up -> ``gate_up``; ``fuse_weights``).
- ``moe.py``: a mixture-of-experts layer's tensors (Mixtral, Qwen2-MoE, Qwen3-MoE: router, experts,
  shared expert) and its experts stacked into [E, N, K] at load (``stack_experts``);
  ``stacked_experts.py``: gpt-oss's experts, stored stacked, gate/up interleaved, with biases.
- ``quant_layouts.py``: the quantized matmul layouts the kernels run (W4A16, W8A16, W8A8) and the
  exact converters into them from GGUF blocks and AWQ, and back to AWQ.
- ``source_format.py``: what a checkpoint directory is ('hf', 'gguf', 'awq', 'w8a8', 'gptq',
  'compressed-tensors', 'fp8') and its AWQ / W8A8 matmuls read into those layouts; the others' readers:
  ``gptq.py`` (GPTQ, act-order included), ``compressed_tensors.py`` (llm-compressor's int4 / int8 /
  FP8), ``fp8.py`` (FP8 weights, dequantized at load), ``mxfp4.py`` (gpt-oss's MXFP4 experts, likewise).
- ``gguf_linears.py``: a GGUF conversion's 4-bit matmuls and 8-bit head, bit-exact, cached.
- ``turbomind_layout.py``: TurboMind's own layout (the fused checkpoint ``lmd convert --backend
  turbomind`` writes): ``load_fused`` for any directory, ``export``, ``read``.
- ``rope.py``: the RoPE cos/sin tables.
- ``dtype.py``: dtype names and ``resolve_dtype``.
- ``memory.py``: KV-cache planning: bytes per block, blocks from free memory, ``session_len``.

The modules import nothing at package import: ``import lmd.weights.rope`` costs only that file.
"""
