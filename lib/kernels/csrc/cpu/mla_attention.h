// Latent attention over a paged cache: DeepSeek-V2's multi-head latent attention with absorbed
// weights (lmd/weights/mla.py). Every query head attends over one cache shared by all heads whose
// rows are the keys and whose first v_dim dims are the values, so the latent is stored once.
// The scalar reference (mla_attention_ref.cc) defines the result; mla_attention_avx2.cc is checked
// against it.
#pragma once

#include "core/tensor.h"

namespace lmd::cpu {

// q: [B, Hq, D] (unit stride in D, any stride between heads and rows); cache: [num_blocks,
// block_size, 1, D] contiguous; block_tables: [S, max_blocks] int32 (unit stride in its last dim);
// row_seqs: null (query row b reads table row b) or B int32 table rows; context_lens: [B] int32 (the
// tokens row b attends to, itself included: a prefill chunk's rows each see their own prefix);
// out: [B, Hq, v_dim], v_dim <= D (unit stride in its last dim). q, cache and out share a dtype
// (f32, bf16, f16); scores, softmax and sums run in float32.
void paged_latent_attention(const TensorView & q, const TensorView & cache, const TensorView & block_tables,
                            const int32_t * row_seqs, const TensorView & context_lens, float scale,
                            const TensorView & out, bool reference = false);

namespace ref {
// One query row b and head h over its len tokens; table: row b's block table. Scratch: scores, len
// floats; acc, D floats.
void latent_attention_task(const TensorView & q, const TensorView & cache, const int32_t * table,
                           int64_t len, float scale, const TensorView & out, int64_t b, int64_t h, float * scores,
                           float * acc);
}  // namespace ref

namespace avx2 {
// The same; D and v_dim multiples of 8.
void latent_attention_task(const TensorView & q, const TensorView & cache, const int32_t * table,
                           int64_t len, float scale, const TensorView & out, int64_t b, int64_t h, float * scores,
                           float * acc);
}  // namespace avx2

}  // namespace lmd::cpu
