"""KV-cache planning, the same for both engines: bytes per block, blocks from free memory, and the
``session_len`` those blocks hold.

A block holds ``block_size`` tokens of K and V for every layer and KV head; a row (one token,
one head, K or V) is ``head_dim`` elements of the model dtype, or under ``quant_policy`` 8 / 4
int8 / int4 codes and a float32 (scale, zero) pair. Latent attention (DeepSeek-V2, ``ModelConfig.mla``)
caches one row per token and layer instead, shared by every head: the normed latent and the rotated key,
``kv_lora_rank + qk_rope_head_dim`` elements, never quantized.
"""
from __future__ import annotations

import logging
import os

import torch

from lmd.model_config import ModelConfig

from .rope import longrope_original_len

logger = logging.getLogger('lmd.weights')

# A session never asks for more than this unless session_len says so.
DEFAULT_MAX_SESSION_LEN = 8192
_GIB = 1 << 30


def available_memory_bytes(device: torch.device) -> int:
    """Memory the KV cache may come out of: free GPU memory, or the host's available RAM."""
    if device.type == 'cuda':
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open('/proc/meminfo', encoding='ascii') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def kv_row_bytes(head_dim: int, dtype: torch.dtype, quant_policy: int = 0) -> int:
    """Bytes of one token's K (or V) for one KV head: the model dtype, or int8 / int4 codes
    and a float32 (scale, zero) pair under quant_policy 8 / 4."""
    if quant_policy:
        return head_dim * quant_policy // 8 + 8
    return head_dim * torch.empty((), dtype=dtype).element_size()


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, quant_policy: int = 0) -> int:
    """K and V of every layer for one block of ``block_size`` tokens (latent attention: one row a token)."""
    if config.mla is not None:
        if quant_policy:
            raise ValueError(f'quant_policy={quant_policy}: the latent KV cache of {config.architecture} is not '
                             'quantized; use quant_policy=0')
        return config.num_layers * block_size * kv_row_bytes(config.mla.cache_dim, dtype)
    return 2 * config.num_layers * block_size * config.num_kv_heads * kv_row_bytes(config.head_dim, dtype,
                                                                                  quant_policy)


def default_session_len(config: ModelConfig, session_len: int | None) -> int:
    """``session_len`` as asked, else the model's context capped at ``DEFAULT_MAX_SESSION_LEN`` and at
    a LongRoPE model's original context (``rope.py``: there every sequence gets the rotary factors HF
    gives it). Sliding windows cap nothing: both engines' attention keeps to them."""
    if session_len:
        return session_len
    limits = [config.max_position_embeddings, DEFAULT_MAX_SESSION_LEN, longrope_original_len(config)]
    return min(n for n in limits if n is not None)


def num_blocks_from_memory(block_bytes: int, device: torch.device, cache_max_entry_count: float,
                           max_bytes: float | None, session_len: int, block_size: int) -> int:
    """How many blocks ``cache_max_entry_count`` of the free memory holds (at most ``max_bytes``),
    at least one session's worth."""
    min_num_blocks = (session_len + block_size - 1) // block_size
    budget = available_memory_bytes(device) * cache_max_entry_count
    if max_bytes is not None:
        budget = min(budget, max_bytes)
    num_blocks = int(budget // block_bytes)
    if num_blocks < min_num_blocks:
        logger.warning('KV cache: %d blocks fit in %.2f GiB, fewer than one session needs; allocating %d',
                       num_blocks, budget / _GIB, min_num_blocks)
        num_blocks = min_num_blocks
    return num_blocks


def window_blocks(window: int, chunk: int, block_size: int) -> int:
    """The most blocks a sequence holds at once when every layer reads only its last ``window`` tokens
    (``ModelConfig.kv_window``) and a step computes up to ``chunk`` new ones: those of a window and a
    chunk, one more where they straddle a block boundary."""
    return -(-(window - 1 + chunk) // block_size) + 1


def fit_session_len(session_len: int, num_blocks: int, block_size: int, window: int = 0, chunk: int = 0) -> int:
    """``session_len``, cut (with a warning) to what ``num_blocks`` blocks hold; with a ``window``, any
    length fits in ``window_blocks``."""
    if window and num_blocks >= window_blocks(window, chunk, block_size):
        return session_len
    if num_blocks * block_size < session_len:
        logger.warning('session_len %d is cut to %d: the KV cache holds only %d blocks of %d tokens',
                       session_len, num_blocks * block_size, num_blocks, block_size)
        return num_blocks * block_size
    return session_len


def cache_size(config: ModelConfig, engine_config, block_bytes: int, device: torch.device,
               max_bytes: float | None) -> tuple[int, int]:
    """(KV blocks, session_len) of an engine's cache: ``num_cache_blocks``, or what ``cache_max_entry_count``
    of the free memory holds in blocks of ``block_bytes`` (at most ``max_bytes``); the session length
    ``default_session_len`` gives, cut to what the blocks hold (``fit_session_len``). ``engine_config``:
    the settings both engines share (``lmd.messages.EngineConfig``)."""
    block_size = engine_config.cache_block_seq_len
    session_len = default_session_len(config, engine_config.session_len)
    num_blocks = engine_config.num_cache_blocks
    if num_blocks is None:
        num_blocks = num_blocks_from_memory(block_bytes, device, engine_config.cache_max_entry_count, max_bytes,
                                            session_len, block_size)
    return num_blocks, fit_session_len(session_len, num_blocks, block_size, config.kv_window,
                                       engine_config.max_prefill_token_num or session_len)
