// TurboMind's CPU kernels. Each has a scalar reference (kernels_ref.cc), the yardstick of
// the tests, and an AVX2/FMA/F16C version (kernels_avx2.cc, compiled with those flags and
// chosen at run time). Threads come from the kernels' own pool (thread_pool.h), which a busy
// core cannot stall; set_num_threads() sets how many a kernel uses.
#pragma once

#include "core/tensor.h"

namespace lmd::cpu {

using ::lmd::KVQuant;  // core/tensor.h: the layout of a quantized KV cache


// Row x[D] (float32) into q (D * bits / 8 bytes) and params[2]: the one quantizer of the cache.
void kv_quantize_row(const float * x, int64_t D, int bits, uint8_t * q, float * params);

inline int kv_code(const uint8_t * q, int64_t d, int bits) {
    return bits == 8 ? q[d] : (q[d >> 1] >> ((d & 1) << 2)) & 0xF;
}

void set_num_threads(int n);
int num_threads();

// The instruction sets the dispatch picks from, in order: the scalar reference; AVX2 + FMA +
// F16C, the baseline every kernel has; AVX-512 (F, BW, VL, DQ) for the packed matmuls, whose
// W4A8 kernel also takes VNNI where the CPU has it. A kernel without a path at the level in use
// runs the highest one it has below it; every path gives its reference's bits (or its stated bound).
enum class Isa : int { ref = 0, avx2 = 1, avx512 = 2 };

// The level in use: the best this CPU has, capped by set_isa or, at start, the environment
// variable LMD_CPU_ISA ('ref', 'avx2', 'avx512').
Isa isa_level();
inline bool isa_at_least(Isa level) { return static_cast<int>(isa_level()) >= static_cast<int>(level); }
// A level's name ('avx512', 'avx2', 'ref'), and the name of the one in use.
const char * isa_name(Isa level);
const char * isa();
// The best level this CPU has.
Isa isa_supported();
// Caps the level ('ref', 'avx2', 'avx512'; '' for the best); false if name is unknown or above
// what the CPU has (the level is then left as it was).
bool set_isa(const char * name);
// The W4A8 kernel's AVX-512 path uses VNNI: level avx512 and a CPU with AVX512-VNNI.
bool use_avx512_vnni();

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]); accumulation in float32.
// x, y: 2-D, unit stride in the last dim, any row stride; w: contiguous; bias: contiguous or null.
// w and bias share a dtype (f32, bf16, f16); x and y share one (f32, bf16, f16).
void linear(const TensorView & x, const TensorView & w, const TensorView * bias, const TensorView & y,
            bool reference = false);

// Decode attention over a paged cache: each of the B sequences brings one query.
// q, out: [B, Hq, D] (unit stride in D, any stride between heads and rows);
// k_cache, v_cache: [num_blocks, block_size, Hk, D] contiguous; block_tables: [B, max_blocks] int32;
// context_lens: [B] int32 (tokens each query attends to, itself included).
// window > 0 (a sliding-window layer): each query attends to its last `window` tokens only,
// [max(0, len - window), len); the table's entries before them are never read (their blocks
// may have been freed). softcap > 0 (Gemma 2): each scaled score s becomes tanh(s / softcap) * softcap
// before the softmax. sinks (gpt-oss; null: none): float32 [Hq], a learned logit per query head
// that joins its softmax's denominator, a key without a value: p_t = exp(s_t) / (exp(sink) + sum exp(s)).
// q, out and the caches share a dtype; scores and softmax run in float32.
// With kv_quant, the caches hold quantized rows (KVQuant, core/tensor.h).
void paged_decode_attention(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                            const TensorView & block_tables, const TensorView & context_lens, float scale,
                            const TensorView & out, const KVQuant * kv_quant = nullptr, bool reference = false,
                            int64_t window = 0, float softcap = 0.f, const float * sinks = nullptr);
// The same over query rows of several sequences, each sequence's table given once:
// block_tables: [S, max_blocks] int32; row_seqs: [B] int32, the table each query row reads.
void paged_decode_attention(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                            const TensorView & block_tables, const TensorView & row_seqs,
                            const TensorView & context_lens, float scale, const TensorView & out,
                            const KVQuant * kv_quant = nullptr, bool reference = false, int64_t window = 0,
                            float softcap = 0.f, const float * sinks = nullptr);

// out[M, H] = rms_norm(x) * w, normalised in float32; with `residual` (same shape as x):
// residual += x first and the sum is normalised (the pre-norm residual stream).
// x, out, residual: unit stride in H; w: [H] contiguous; all one dtype.
void rms_norm(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
              const TensorView * residual, bool reference = false);

// NeoX-style rotary on the q and k parts of qkv[T, (Hq + 2 Hk) * D], rotated q into
// q_out[T, Hq, D], rotated k and plain v into the caches at slots[T] (int64).
// cos_sin: [max_position, rot] = cat(cos, sin) of rot / 2 frequencies; rot <= D (the
// tail of each head passes through). positions: [T] int64. With kv_quant, k (rotated in
// float32) and v are quantized into the caches (KVQuant, core/tensor.h).
void rope_fill_kv(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                  const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                  const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads,
                  const KVQuant * kv_quant = nullptr, bool reference = false);

// out[T, I] = silu(x[:, :I]) * x[:, I:].
void silu_and_mul(const TensorView & x, const TensorView & out, bool reference = false);

// out[T, I] = gelu_tanh(x[:, :I]) * x[:, I:] (GeGLU: Gemma's gelu_pytorch_tanh); scalar only.
void gelu_tanh_and_mul(const TensorView & x, const TensorView & out);

namespace ref {
void linear_rows(const TensorView & x, const TensorView & w, const TensorView * bias, const TensorView & y,
                 int64_t n0, int64_t n1);
void decode_attention_task(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                           const TensorView & block_tables, const TensorView & context_lens, float scale,
                           float softcap, const float * sinks, const TensorView & out, const KVQuant * kv_quant,
                           int64_t b, int64_t first, int64_t kv_head, float * scratch);
void rms_norm_row(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
                  const TensorView * residual, int64_t m);
void rope_fill_kv_row(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                      const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                      const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, const KVQuant * kv_quant,
                      int64_t t);
void silu_and_mul_row(const TensorView & x, const TensorView & out, int64_t m);
void gelu_tanh_and_mul_row(const TensorView & x, const TensorView & out, int64_t m);
}  // namespace ref

namespace avx2 {
// x is float32 here (the dispatch converts 16-bit activations once, up front).
void linear_rows(const float * x, int64_t ldx, int64_t M, int64_t K, const TensorView & w, const TensorView * bias,
                 const TensorView & y, int64_t n0, int64_t n1);
void decode_attention_task(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                           const TensorView & block_tables, const TensorView & context_lens, float scale,
                           float softcap, const float * sinks, const TensorView & out, int64_t b, int64_t first,
                           int64_t kv_head, float * scratch);
// decode_attention_task's results, bit for bit, for query rows [b0, b0 + rows) that share row b0's table
// (one sequence; no window) and one KV head: the rows and the KV head's query heads read each tile of
// keys and values once (prefill chunks, GQA). scratch: rows * group * (max len + head_dim) floats,
// rows * group <= 64.
void attention_rows_task(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                         const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                         const float * sinks, const TensorView & out, int64_t b0, int64_t rows, int64_t kv_head,
                         float * scratch);
// the same over a quantized cache (kv_quant_avx2.cc); head_dim a multiple of 8
void decode_attention_quant_task(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                                 const TensorView & block_tables, const TensorView & context_lens, float scale,
                                 float softcap, const float * sinks, const TensorView & out, const KVQuant & kv_quant,
                                 int64_t b, int64_t first, int64_t kv_head, float * scratch);
void rms_norm_row(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
                  const TensorView * residual, int64_t m);
void silu_and_mul_row(const TensorView & x, const TensorView & out, int64_t m);
// ref::rope_fill_kv_row bit for bit (its operations one by one, no fused multiply-add); head_dim <= kMaxHeadDim
void rope_fill_kv_row(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                      const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                      const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, const KVQuant * kv_quant,
                      int64_t t);
}  // namespace avx2

}  // namespace lmd::cpu
