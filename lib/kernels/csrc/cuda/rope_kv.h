// Rotary embedding of q and k, and the write of k and v into the paged KV cache, on the GPU
// (rope_kv.cu); CPU reference in cpu/kernels.h (rope_fill_kv).
#pragma once

#include <cuda_runtime.h>

#include "core/tensor.h"

namespace lmd::cuda {

// NeoX rotary on the q and k heads of qkv[T, (Hq + 2 Hk) * D]: rotated q into q_out[T, Hq, D]
// (contiguous), rotated k and plain v into the caches [num_blocks, block_size, Hk, D] at slots[T]
// (int64), quantized as cpu::kv_quantize_row does when kv_quant is given. cos_sin [max_position, rot]
// (qkv's dtype, unit stride) = cat(cos, sin); positions [T] int64. positions and slots live on the
// device, so they are not checked by the caller; the kernel never reads or writes out of bounds:
// a token whose position is outside the table gets a q_out of zeros and writes no k / v, and a
// token whose slot is outside the cache (e.g. -1, padding) writes no k / v.
void rope_fill_kv(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                  const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                  const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, const KVQuant * kv_quant,
                  cudaStream_t stream);

}  // namespace lmd::cuda
