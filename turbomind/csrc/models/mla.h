// DeepSeek-V2's multi-head latent attention: the attention of a LlamaModel layer that has MlaWeights
// (lmd/weights/mla.py has the math and the weights' layouts).
//
// q comes from q_proj (or q_a_proj -> RMSNorm -> q_b_proj), per head `nope` plain dims then `rope`
// rotated ones; kv_a_proj_with_mqa gives each token a latent of L dims, RMS-normed, and one rotated key
// of `rope` dims shared by every head. That row [L + rope] is all the cache holds, one a token and layer.
// With the weights absorbed, each head's latent query [q_nope · W_UK | q_pe] attends over the cached rows
// as its keys and their first L dims as its values (cpu::paged_latent_attention, one shared KV head),
// and its latent output times W_UVᵀ is the head's output, then o_proj. Prefill chunks take the same path.
// The rope rows of the projections come de-interleaved (NeoX order), so the rotation is rotate-half.
#pragma once

#include "models/llama.h"

namespace turbomind {

struct MlaWeights {
    int64_t kv_lora_rank = 0;       // L
    int64_t qk_nope_head_dim = 0;
    int64_t qk_rope_head_dim = 0;
    int64_t v_head_dim = 0;
    LinearWeights q_a;              // [r, H], or none: q straight from q
    TensorView q_a_norm;            // [r], or none
    LinearWeights q;                // [Hq (nope + rope), H] (q_proj), or [Hq (nope + rope), r] (q_b_proj)
    LinearWeights kv_a;             // [L + rope, H]
    TensorView kv_a_norm;           // [L]
    TensorView w_uk_t;              // [Hq, L, nope]: per head W_UKᵀ, the plain query into the latent space
    TensorView w_uv;                // [Hq, v, L]: per head W_UV, the latent output out of it
    int64_t cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }
};

// out[T, H] = o_proj of the latent attention over x[T, H] (contiguous, the model dtype); writes each row's
// [normed latent | rotated key] into cache [num_blocks, block_size, 1, L + rope] at slots[T]. positions,
// slots [T] int64; tables [S, max_blocks], row_seqs [T], lens [T] int32 (StepInputs); cos_sin [max_position,
// rope] = cat(cos, sin).
void mla_attention(const MlaWeights & w, const LinearWeights & o, int64_t num_heads, float eps, float scale,
                   const TensorView & x, const TensorView & positions, const TensorView & cos_sin,
                   const TensorView & cache, const TensorView & slots, const TensorView & tables,
                   const TensorView & row_seqs, const TensorView & lens, const TensorView & out,
                   bool int8_activations);

}  // namespace turbomind
