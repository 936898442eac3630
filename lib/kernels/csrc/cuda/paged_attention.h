// Paged attention on the GPU (paged_attention.cu): cpu::paged_decode_attention's twin, the same
// arguments and result (cpu/kernels.h, reference in cpu/kernels_ref.cc).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"

namespace lmd::cuda {

// A quantized cache (KVQuant, core/tensor.h) as the kernel takes it: uint8 rows of D codes (bits 8) or D / 2 bytes (bits 4), element
// 2i in the low nibble; params float32 [num_blocks, block_size, Hk, 2] = (scale, zero), x = q scale + zero.
struct PagedKVQuant {
    const float * k_params = nullptr;
    const float * v_params = nullptr;
    int bits = 0;
};

// Tokens one thread block attends to; longer contexts are split into partitions whose partial
// results a second kernel combines (flash-decoding).
constexpr int64_t kAttentionPartition = 512;

// The head dims the kernel takes: D <= 256 and D a multiple of E, the power of two >= D / 32 each
// lane reads (16, 24, 32, 64, 80, 96, 128, 256 ...).
bool paged_attention_supports(int64_t head_dim);

// float32 elements of the workspace for B rows of Hq heads over a table of max_context tokens
// (max_blocks * block_size): B * Hq * partitions * (D + 2), partitions = ceil(max_context / 512);
// 0 when one partition covers max_context (the kernel then writes out directly).
int64_t paged_attention_workspace_floats(int64_t rows, int64_t num_heads, int64_t head_dim, int64_t max_context);

// out[B, Hq, D] = softmax(q[b, h] · K[row's first context_lens[b] tokens, h / (Hq / Hk)]ᵀ scale) V.
// q, out: [B, Hq, D] unit stride in D; caches: contiguous [num_blocks, block_size, Hk, D or packed],
// 16-byte aligned; block_tables: [S, max_blocks] int32, unit stride in its last dim; row_seqs: [B]
// int32, the table of each row (null: row b reads table b, S = B); context_lens: [B] int32.
// All on the device, so their values are not checked on the host: a row whose length is outside
// [1, max_blocks * block_size], whose row_seqs entry is not a table, or whose table names a block
// outside the cache gets NaN, and nothing outside the tensors is read.
// workspace: paged_attention_workspace_floats(...) float32 elements of device memory; null: the
// call allocates it on the stream (cudaMallocAsync) when it needs one. window > 0: each row attends
// to its last `window` tokens only (a sliding-window layer; table entries before them are not read).
// sinks (gpt-oss; null: none): float32 [Hq] on the device, each head's logit in its softmax's denominator.
void paged_attention(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                     const TensorView & block_tables, const int32_t * row_seqs, const TensorView & context_lens,
                     float scale, const TensorView & out, const PagedKVQuant & kv_quant, float * workspace,
                     cudaStream_t stream, int64_t window = 0, const float * sinks = nullptr);

}  // namespace lmd::cuda
