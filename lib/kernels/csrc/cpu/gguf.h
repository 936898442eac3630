// GGUF's block-quantized weights as llama.cpp writes them, multiplied in place: every ggml type a
// GGUF file mixes (Q4_0 ... Q8_0, the k-quants Q4_K, Q5_K, Q6_K, and IQ4_NL) at its own bit width
// (or, for the types without float mins, moved exactly into the W8A16 layout: gguf_to_w8a16 below,
// whose panels run faster than these blocks). As elsewhere in cpu/, a scalar reference (gguf_ref.cc) defines
// each result and an AVX2 version (gguf_avx2.cc) equals it bit for bit; gguf.cc splits the work.
//
// Layout: a weight w[N, K] is N rows of K / QK blocks, a row's blocks back to back, as the file
// stores them: raw uint8 [N, K / QK * B]. Types (ggml id: QK values in B bytes), fp16 fields
// little-endian:
//   Q4_0   (2):  32 in  18   d; qs[16]                    q = nibble (value j < 16: low nibble of qs[j], else high of qs[j - 16])
//   Q4_1   (3):  32 in  20   d, m; qs[16]                 q as Q4_0
//   Q5_0   (6):  32 in  22   d; qh[4]; qs[16]             q = nibble | bit j of qh (as uint32) << 4
//   Q5_1   (7):  32 in  24   d, m; qh[4]; qs[16]          q as Q5_0
//   Q8_0   (8):  32 in  34   d; int8 qs[32]               q = qs[j]
//   Q4_K  (12): 256 in 144   d, dmin; scales[12]; qs[128]     eight sub-blocks of 32, 6-bit scale and min each
//   Q5_K  (13): 256 in 176   d, dmin; scales[12]; qh[32]; qs[128]
//   Q6_K  (14): 256 in 210   ql[128]; qh[64]; int8 scales[16]; d    sixteen sub-blocks of 16
//   IQ4_NL(20):  32 in  18   d; qs[16]                    q = kIQ4NLValues[nibble]
// Each reads, per sub-block j of 16 values, as a scale s[j] (float32), integer codes q and either
// an integer offset o or a float min m[j]:
//   w[k] = s[j] * float(q[k] - o)        Q4_0 (o = 8), Q5_0 (16), Q6_K (32), Q8_0 and IQ4_NL (0)
//   w[k] = fma(s[j], q[k], m[j])         Q4_1 / Q5_1 (m = m), Q4_K / Q5_K (m = -(dmin mn))
//   s = d, or d sc for the k-quants (sc, mn the sub-block's 6-bit pair; Q6_K's int8 scale)
// The product s q is exact in float32 for every type, so w is exactly what gguf.quants.dequantize
// (and llama.cpp) computes, down to the sign of a zero. Where the products below need a min, an
// offset type's is m[j] = -o s[j] (exact).
//
// Two products, for x[M, K] (any float dtype, widened to float32 exactly):
//
// Float activations (W A16): eight lanes l per row m and column n, lane l over k = l mod 8:
//   L[l] = fma(x[m, k], w[n, k], L[l]) in increasing k, from 0
//   y[m, n] = ((L0 + L4) + (L2 + L6)) + ((L1 + L5) + (L3 + L7)) (+ bias[n]), rounded once to y's dtype
// i.e. the float matmul of the dequantized weights, summed in a fixed order.
//
// Int8 activations (W A8, llama.cpp's arithmetic: x in Q8 blocks): per block b of 32 k,
// dx[m, b] and xq[m, k] as quantize_block32 (quant.h), S[m, b] the int32 sum of the block's xq;
// per lane l of the block (k = 32 b + 4 l .. 32 b + 4 l + 3, inside one sub-block j):
//   I = the int32 sum of (q[n, k] - o) xq[m, k] (exact; o = 0 for the float-min types)
//   L[l] = fma(float(I), s[j] * dx[m, b], L[l])                     over b increasing, from 0
// and, for the float-min types (their sub-blocks are the blocks of 32),
//   U = fma(m[j], float(S[m, b]) * dx[m, b], U)                      over b increasing, from 0
//   y[m, n] = (((L0 + L4) + (L2 + L6)) + ((L1 + L5) + (L3 + L7))) + U (+ bias[n]), rounded once.
// So y = the float product of w and x' = xq dx (each lane's integer sum exact before its rounding).
//
// Neither depends on M, the tiling or the thread count: row m of y is bitwise the same whatever
// rows come with it.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace lmd::cpu {

enum class GgufType : int {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20,
};

// IQ4_NL's sixteen non-linear levels (llama.cpp's kvalues_iq4nl).
constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct GgufTypeInfo {
    int block_values;  // QK
    int block_bytes;   // B
};

// The block of a type this file runs, or {0, 0} for any other id.
GgufTypeInfo gguf_type_info(int type);
inline int64_t gguf_row_bytes(int type, int64_t K) {
    const GgufTypeInfo t = gguf_type_info(type);
    return t.block_values ? K / t.block_values * t.block_bytes : 0;
}

// out[N, K] float32 (contiguous) = w of raw [N, K / QK * B] (contiguous), exactly.
void gguf_dequantize(const TensorView & raw, int type, const TensorView & out, bool reference = false);

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]) with w GGUF blocks of `type` (raw [N, row bytes],
// contiguous); int8_activations picks the W A8 product above, else W A16. x, y: 2-D, unit stride
// in the last dim, any row stride, one dtype (f32, bf16, f16); bias float32 [N] or null.
void linear_gguf(const TensorView & x, const TensorView & raw, int type, const TensorView * bias,
                 const TensorView & y, bool int8_activations, bool reference = false);

// The W8A16 layout (quant.h) of a type without float mins, whose weights are an integer code times
// one scale per group (w = s (q - o) above): Q4_0, Q5_0, Q8_0 and IQ4_NL in groups of 32, Q6_K in
// groups of 16. qweight int8 [N, K] = q - o (IQ4_NL: its level), scales float32 [N, K / G] = s:
// the same weights, exactly. gguf_w8a16_group(type) is G, or 0 for a type with float mins.
int gguf_w8a16_group(int type);
void gguf_to_w8a16(const TensorView & raw, int type, const TensorView & qweight, const TensorView & scales);

namespace ref {
// One block: codes q[QK], the per-16 scales s[QK / 16] and mins m[QK / 16] (above); returns the
// type's offset o, or -1 for a type with float mins.
int gguf_block(int type, const uint8_t * block, int32_t * q, float * s, float * m);
void gguf_dequantize_rows(const TensorView & raw, int type, const TensorView & out, int64_t n0, int64_t n1);
void linear_gguf_rows(const TensorView & x, const TensorView & raw, int type, const TensorView * bias,
                      const TensorView & y, bool int8_activations, int64_t n0, int64_t n1);
}  // namespace ref

namespace avx2 {
// Rows [n0, n1) of w into out (row stride K), exactly.
void gguf_dequantize_rows(const uint8_t * raw, int type, int64_t K, float * out, int64_t n0, int64_t n1);
// W A16 over x widened to float32 rows (row stride ldx): columns [n0, n1).
void linear_gguf_a16_rows(const float * x, int64_t ldx, int64_t M, int64_t K, const uint8_t * raw, int type,
                          const float * bias, const TensorView & y, int64_t n0, int64_t n1);
// W A8: x quantized once per call, xq [M, K], dx [M, K / 32] (q8_prepare_rows, quant.h), then
// sl [M, K / 32, 8] the lanes' int32 sums of xq and sb [M, K / 32] = float(S) * dx (gguf_a8_prepare);
// then columns [n0, n1).
void gguf_a8_prepare(const int8_t * xq, const float * dx, int64_t M, int64_t K, int32_t * sl, float * sb);
void linear_gguf_a8_rows(const int8_t * xq, const float * dx, const int32_t * sl, const float * sb, int64_t M,
                         int64_t K, const uint8_t * raw, int type, const float * bias, const TensorView & y,
                         int64_t n0, int64_t n1);
}  // namespace avx2

}  // namespace lmd::cpu
