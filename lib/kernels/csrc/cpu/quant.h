// Quantized matmuls on the CPU: W4A16 and W8A16 (group-wise int4 / int8 weights, float
// activations) and W8A8 (int8 weights and int8 activations quantized per token). As in
// kernels.h, each has a scalar reference (quant_ref.cc) and an AVX2 version (quant_avx2.cc)
// picked at run time; quant.cc splits the work across threads.
//
// W4A16 weight layout, for w[N, K] in groups of G consecutive k (G a multiple of 32, K of G):
//   qweight: uint8 [N, K / 2]  element k of row n in byte k / 2, low nibble = even k
//   scales:  float32 [N, K / G]
//   mins:    float32 [N, K / G]
//   w[n, k] = q[n, k] * scales[n, k / G] + mins[n, k / G]          q in 0..15
// This one form holds, exactly after dequantization in float32:
//   GGUF Q4_1 (w = d q + m, fp16 d and m, G = 32):   scale = d, min = m
//   GGUF Q4_0 (w = d (q - 8), fp16 d, G = 32):       scale = d, min = -8 d
//   AWQ (w = (q - z) s, fp16 s, integer z):          scale = s, min = -z s
// (every product of a 4-bit integer and an fp16 value is exact in float32). The kernels never
// dequantize: per group they compute scale * dot(q, x) + min * sum(x), with the group sums of
// x taken once per call. Row m of y is bitwise the same whatever M and the thread count.
//
// W8A16 weight layout, for w[N, K] in groups of G consecutive k (G a multiple of 32, K of G):
//   qweight: int8 [N, K]
//   scales:  float32 [N, K / G]
//   w[n, k] = q[n, k] * scales[n, k / G]                           q in -128..127
// GGUF Q8_0 (w = d q, fp16 d, G = 32) is scale = d, exactly (an fp16 times an int8 is exact
// in float32). Per group the kernels compute scale * dot(q, x) in float32; row m of y is
// bitwise the same whatever M and the thread count.
//
// W8A8 by groups, on the W8A16 layout (llama.cpp's Q8_0 x Q8_0): x quantized per block of 32 k
// as in gemm.h's W4A8 (dx[m, b], xq[m, k]); per row m, column n and block b, eight lanes l hold
// I[l] = the int32 sum of q[n, k] xq[m, k] over k = 32 b + 4 l .. 32 b + 4 l + 3 (exact), and
//   L[l] = fma(float(I[l]), scales[n, k / G] * dx[m, b], ...) over the blocks in increasing b, from 0
//   y[m, n] = ((L0 + L4) + (L2 + L6)) + ((L1 + L5) + (L3 + L7)) (+ bias[n]), rounded once to y's dtype.
// The AVX2 kernel equals the reference bit for bit, for any M and thread count.
//
// W8A8: w int8 [N, K] with per-output-channel scales sw[N]; x is quantized per row (token)
// to int8, xq = round(x * (127 / absmax(x[m]))) to nearest even, so |xq| <= 127, with
// sx[m] = absmax(x[m]) / 127 (0 for a zero row); y[m, n] = float(int32 dot(xq[m], w[n]))
// * sx[m] * sw[n] (+ bias[n]).
// The int32 dot is exact, so the AVX2 and reference results are bitwise equal.
#pragma once

#include "core/tensor.h"

namespace lmd::cpu {

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]) with w in the W4A16 layout above.
// x, y: 2-D, unit stride in the last dim, any row stride, one dtype (f32, bf16, f16);
// qweight, scales, mins, bias (f32, or null): contiguous.
void linear_w4a16(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                  const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t group_size,
                  bool reference = false);

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]) with w in the W8A16 layout above; x, y, bias as
// for linear_w4a16; qweight, scales: contiguous.
void linear_w8a16(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                  const TensorView * bias, const TensorView & y, int64_t group_size, bool reference = false);

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]) with w in the W8A16 layout and x quantized to int8
// per 32 k (W8A8 by groups, above); arguments as for linear_w8a16.
void linear_w8a8_group(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                       const TensorView * bias, const TensorView & y, int64_t group_size, bool reference = false);

// xq[M, K] int8 and sx[M] float32 from x[M, K] (f32, bf16, f16; unit stride in K): the
// per-token activation quantizer of W8A8.
void quantize_per_token(const TensorView & x, const TensorView & xq, const TensorView & sx, bool reference = false);

// y[M, N] = dequant(quantize_per_token(x)) · dequant(w)ᵀ (+ bias[N]); w int8 [N, K] and
// sw, bias float32 [N], contiguous; x and y as for linear_w4a16. K at most kW8A8MaxK, so
// that the int32 dot cannot overflow (127 * 127 * K < 2^31).
constexpr int64_t kW8A8MaxK = 131072;
void linear_w8a8(const TensorView & x, const TensorView & w, const TensorView & sw, const TensorView * bias,
                 const TensorView & y, bool reference = false);

namespace ref {
void linear_w4a16_rows(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                       const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t group_size,
                       int64_t n0, int64_t n1);
void linear_w8a16_rows(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                       const TensorView * bias, const TensorView & y, int64_t group_size, int64_t n0, int64_t n1);
float quantize_row(const TensorView & x, int64_t m, int8_t * xq);  // row m into xq[K]; returns sx[m]
// x[0..32) as a Q8 block: returns d = max |x| / 127 and sets q[j] = round-half-even(x[j] * (1 / d))
// in -127..127 (0 when d = 0); the AVX2 twin is avx2::quantize_block32 (simd_avx2.h)
float quantize_block32(const float * x, int32_t * q);
void linear_w8a8_group_rows(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                            const TensorView * bias, const TensorView & y, int64_t group_size, int64_t n0, int64_t n1);
// xq: [M, K] int8 rows, sx: [M]
void linear_w8a8_rows(const int8_t * xq, const float * sx, int64_t M, int64_t K, const TensorView & w,
                      const TensorView & sw, const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1);
}  // namespace ref

namespace avx2 {
// Activations as the W4A16 kernel reads them, built once per call (w4a16_prepare):
// xp[M, K64] with K64 = K rounded up to 64, zero-padded. Within each 64-wide chunk c, the
// weight bytes load as eight 32-bit words, word d holding k = 64 c + 8 d + j in nibble j;
// xp[m, 64 c + 8 j + d] = x[m, 64 c + 8 d + j] * 2^(-4 j) (j < 7; 1 for j = 7), so that
// masking nibble j in place and converting gives q * 2^(4 j), and the products are q * x.
// xsum[M, K / G]: the group sums of x.
struct W4A16Activations {
    const float * xp;
    const float * xsum;
    int64_t M, K, K64, group_size;
};
void w4a16_prepare_row(const TensorView & x, int64_t m, int64_t group_size, float * xp, float * xsum);
void linear_w4a16_rows(const W4A16Activations & a, const TensorView & qweight, const TensorView & scales,
                       const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1);
// W8A16 on float32 activations xf[M, K] with row stride ldx (x itself when it is f32, else
// converted once per call: w8a16_prepare_row).
void w8a16_prepare_row(const TensorView & x, int64_t m, float * xf);
void linear_w8a16_rows(const float * xf, int64_t ldx, int64_t M, int64_t K, const TensorView & qweight,
                       const TensorView & scales, const TensorView * bias, const TensorView & y, int64_t group_size,
                       int64_t n0, int64_t n1);
float quantize_row(const TensorView & x, int64_t m, int8_t * xq);  // row m into xq[K]; returns sx[m]
// W8A8 by groups: rows [m0, m1) of x (float32, row stride ldx) as xq [M, K] and dx [M, K / 32],
// then the columns [n0, n1) from them (quant_a8_avx2.cc).
void q8_prepare_rows(const float * x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, int8_t * xq, float * dx);
void linear_w8a8_group_rows(const int8_t * xq, const float * dx, int64_t M, int64_t K, const TensorView & qweight,
                            const TensorView & scales, const TensorView * bias, const TensorView & y,
                            int64_t group_size, int64_t n0, int64_t n1);
// xw: [M, K] int16 (xq widened once per call), sx: [M]
void linear_w8a8_rows(const int16_t * xw, const float * sx, int64_t M, int64_t K, const TensorView & w,
                      const TensorView & sw, const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1);
}  // namespace avx2

}  // namespace lmd::cpu
