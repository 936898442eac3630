"""The side data of one forward pass: which cache slots each token reads and writes.

A step runs the tokens of several sequences flattened into one batch:
``input_ids[T]`` and ``positions[T]`` where sequence ``i`` owns rows
``cu_query_lens[i]:cu_query_lens[i+1]``. A sequence contributes either its next
prefill chunk or one decode token; its context is everything already in the
cache plus these new tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .lora import LoraStep


@dataclass
class StepContext:
    # k_cache, v_cache per layer: [num_blocks, block_size, num_kv_heads, head_dim]; quantized
    # (quant_policy 8 / 4): (k_cache, v_cache, k_params, v_params), see CausalLM.allocate_kv_cache
    kv_caches: list[tuple[torch.Tensor, ...]]
    block_size: int
    # [T] int64: cache slot (block_id * block_size + offset) each new token's K/V is written to
    slot_mapping: torch.Tensor
    # [B] int32: new tokens of each sequence this step
    query_lens: torch.Tensor
    # [B + 1] int32: prefix sums of query_lens
    cu_query_lens: torch.Tensor
    # [B] int32: tokens of each sequence in the cache after this step (history + new)
    context_lens: torch.Tensor
    # [B, max_num_blocks] int32: the sequence's blocks in order, padded with 0
    block_tables: torch.Tensor
    # every sequence brings exactly one token (lets kernels take the decode path)
    is_decode: bool
    # python copies of the lengths, so CPU kernels need no device sync
    query_lens_list: list[int]
    context_lens_list: list[int]
    # KV-cache quantization (0: none, 8: int8, 4: int4)
    quant_policy: int = 0
    # what a kernel derives from the above once per step and reuses in every layer
    derived: dict = field(default_factory=dict)
    # the LoRA adapters of the step's rows (lora.py); None: every row runs the base model
    lora: LoraStep | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_list)
