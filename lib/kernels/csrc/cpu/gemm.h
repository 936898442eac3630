// Matmuls over pre-packed weights: TurboMind's GEMM (prefill) and GEMV (decode) for float32,
// bfloat16 and float16 weights, and for W4A16 weights (quant.h) in panels too. As in
// kernels.h, a scalar reference (gemm_ref.cc) defines each result and an AVX2/FMA/F16C
// version (gemm_avx2.cc, gemm_w4a16_avx2.cc; their tile: gemm_tile_avx2.h) or an AVX-512 one
// (gemm_avx512.cc) is picked at run time; gemm.cc packs and splits the work across threads.
//
// Packed layout, for w[N, K] (any float dtype, kept as is):
//   packed: [P, K, 16] with P = ceil(N / 16), packed[p, k, j] = w[16 p + j, k], zero for
//   16 p + j >= N. A panel (one p) is a contiguous [K, 16] run: the kernels read it front to
//   back, two 8-wide vectors a k, and broadcast x[m, k] against them.
//
// Result: y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 1], w[n, 1], x[m, 0] * w[n, 0]) ...)
// (+ bias[n]), one fused multiply-add a k in increasing k, in float32, then rounded once to
// y's dtype. Nothing in it depends on M, on the tiling or on the thread count: row m of y is
// bitwise the same whatever rows come with it, and the AVX2 kernel equals the reference
// bit for bit (16-bit x and w widen to float32 exactly).
//
// W4A16 packed, for the W4A16 layout of quant.h (qweight [N, K / 2], scales and mins [N, K / G]),
// in panels 64 wide (four of 16 interleaved k by k: the four panels of a decode tile are one
// stream from memory), P4 = ceil(N / 64):
//   qpanels: int32 [P4, K / 8, 64], word (p, c, j) = the eight 4-bit q[64 p + j, 8 c + i] in
//            nibble i (i = 0..7: the bytes of qweight's row as a little-endian word)
//   spanels, mpanels: float32 or float16 (both the same) [P4, K / G, 64], [p, g, j] =
//   scales / mins[64 p + j, g] (zero past N); float16 when that holds them exactly (GGUF's
//   Q4_0 / Q4_1 blocks: a quarter fewer bytes to read per weight, 0.625 instead of 0.75).
// Result, in float32, per group g of G k (as the W4A16 kernel of quant.h, in broadcast form):
//   D[m, n, g] = fma(xp[m, k], qp[n, k], ...) over the group's k in increasing k, from 0, where
//                xp = x 2^(-4 j) and qp = q 2^(4 j) for j = k mod 8 < 7 (xp = x, qp = q for
//                j = 7): their product is x q (bar x 2^-24 below the normal range), and a
//                packed word turns into qp with one AND (gemm_w4a16_avx2.cc)
//   X[m, g]    = the sum of x[m, k] over the group in eight lanes: lane l adds k = l mod 8 in
//                increasing k, then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
//   T[m, n]    = fma(scales[n, g], D[m, n, g], ...) over the groups in increasing g, from 0
//   U[m, n]    = fma(mins[n, g], X[m, g], ...) over the groups in increasing g, from 0
//   y[m, n]    = T + U (+ bias[n]), rounded once to y's dtype.
// The same for any M and thread count; the AVX2 kernel equals the reference bit for bit.
//
// W4A8, on the same panels: x quantized to int8 per block of 32 k as llama.cpp's Q8_0 / Q8_1
// (the Q4_1 x Q8_1 product of its CPU backend), the 4-bit weights multiplied by it in
// integers. Per row m and block b of 32 k:
//   dx[m, b]   = max |x[m, k]| over the block / 127 (float32); id = 1 / dx (0 when dx is 0)
//   xq[m, k]   = round-to-nearest-even(x[m, k] * id), in -127..127
//   I[m, n, b] = the int32 sum of q[n, k] xq[m, k] over the block (exact)
//   D[m, n, g] = fma(float(I[m, n, b]), dx[m, b], ...) over the group's blocks in increasing b, from 0
//   X[m, g]    = fma(float(S[m, b]), dx[m, b], ...) likewise, S the int32 sum of xq over the block
// and T, U and y as above. So y = the float product of w and x' = xq dx (Q8_1's sum, as llama.cpp
// takes it: the exact sum of x would leave the mins' offset uncancelled and double the error),
// |y - x w| <= sum over k of |w[n, k]| dx / 2.
//
// W8A16 packed, for the W8A16 layout of quant.h (qweight int8 [N, K], scales [N, K / G]), in the
// float panels' 16-wide form (P = ceil(N / 16)):
//   qpanels: int8 [P, K, 16], qpanels[p, k, j] = q[16 p + j, k] (zero past N)
//   spanels: float32 or float16 [P, K / G, 16], [p, g, j] = scales[16 p + j, g] (zero past N);
//            float16 when that holds them exactly (GGUF's Q8_0 blocks)
// Result, in float32, per group g of G k:
//   D[m, n, g] = fma(x[m, k], q[n, k], ...) over the group's k in increasing k, from 0
//   T[m, n]    = fma(scales[n, g], D[m, n, g], ...) over the groups in increasing g, from 0
//   y[m, n]    = T (+ bias[n]), rounded once to y's dtype.
// Broadcast form like the others, so the same for any M and thread count; the vector kernels
// equal the reference bit for bit. (quant.h's linear_w8a16 on the row layout sums in eight
// lanes per output and adds them at the end: another order, other bits.)
#pragma once

#include "core/tensor.h"

namespace lmd::cpu {

constexpr int64_t kPanelWidth = 16;
constexpr int64_t kW4A16PanelWidth = 64;
inline int64_t num_panels(int64_t N) { return (N + kPanelWidth - 1) / kPanelWidth; }

// packed[P, K, W] from w[N, K] in panels W = packed.size(2) wide (16; 64 for W4A16's parts):
// both contiguous, one 8-, 16- or 32-bit dtype.
void pack_linear(const TensorView & w, const TensorView & packed);
// w[N, K] back from packed[P, K, W] (N <= W P).
void unpack_linear(const TensorView & packed, const TensorView & w);
// Row n of w, in packed's dtype, into out[K]: the embedding lookup of a tied, packed lm_head.
void packed_row(const TensorView & packed, int64_t n, void * out);

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]) with w packed; N = y.size(1) <= 16 P.
// x, y: 2-D, unit stride in the last dim, any row stride, one dtype (f32, bf16, f16);
// packed and bias (or null): contiguous, one dtype (f32, bf16, f16).
void linear_packed(const TensorView & x, const TensorView & packed, const TensorView * bias, const TensorView & y,
                   bool reference = false);

// The W4A16 panels from qweight uint8 [N, K / 2], scales and mins float32 [N, K / G]; and back.
void pack_w4a16(const TensorView & qweight, const TensorView & scales, const TensorView & mins,
                const TensorView & qpanels, const TensorView & spanels, const TensorView & mpanels);
void unpack_w4a16(const TensorView & qpanels, const TensorView & spanels, const TensorView & mpanels,
                  const TensorView & qweight, const TensorView & scales, const TensorView & mins);

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]) with w W4A16 in panels (above); G = K / spanels.size(1),
// a multiple of 32. x, y as for linear_packed; bias float32 [N] or null.
void linear_w4a16_packed(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                         const TensorView & mpanels, const TensorView * bias, const TensorView & y,
                         bool reference = false);

// The W8A16 panels from qweight int8 [N, K] and scales float32 or float16 [N, K / G]; and back.
void pack_w8a16(const TensorView & qweight, const TensorView & scales, const TensorView & qpanels,
                const TensorView & spanels);
void unpack_w8a16(const TensorView & qpanels, const TensorView & spanels, const TensorView & qweight,
                  const TensorView & scales);

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]) with w W8A16 in panels (above); G = K / spanels.size(1),
// a multiple of 16 (GGUF's Q6_K scales every 16 k: gguf.h's gguf_to_w8a16). x, y as for linear_packed; bias float32 [N] or null.
void linear_w8a16_packed(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                         const TensorView * bias, const TensorView & y, bool reference = false);

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]) with w W4A16 in panels and x quantized per 32 k
// (W4A8 above); arguments as for linear_w4a16_packed.
void linear_w4a8_packed(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                        const TensorView & mpanels, const TensorView * bias, const TensorView & y,
                        bool reference = false);

namespace ref {
void linear_packed_rows(const TensorView & x, const TensorView & packed, const TensorView * bias,
                        const TensorView & y, int64_t n0, int64_t n1);
void linear_w4a16_packed_rows(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                              const TensorView & mpanels, const TensorView * bias, const TensorView & y, int64_t n0,
                              int64_t n1);
void linear_w4a8_packed_rows(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                             const TensorView & mpanels, const TensorView * bias, const TensorView & y, int64_t n0,
                             int64_t n1);
void linear_w8a16_packed_rows(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                              const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1);
}  // namespace ref

namespace avx2 {
// Rows [m0, m1) of x (any float dtype) as float32 into out[M, K].
void widen_rows(const TensorView & x, int64_t m0, int64_t m1, float * out);
// x: float32 [M, K], row stride ldx (16-bit activations are widened once by the dispatch);
// output panels [p0, p1).
void linear_packed_panels(const float * x, int64_t ldx, int64_t M, const TensorView & packed,
                          const TensorView * bias, const TensorView & y, int64_t p0, int64_t p1);
// W4A16: rows [m0, m1) of x (float32, row stride ldx) as xp [M, K] and xsum [M, K / G] (above),
// then the panels [p0, p1) from them.
void w4a16_prepare_rows(const float * x, int64_t ldx, int64_t K, int64_t G, int64_t m0, int64_t m1, float * xp,
                        float * xsum);
void linear_w4a16_packed_panels(const float * xp, const float * xsum, int64_t M, const TensorView & qpanels,
                                const TensorView & spanels, const TensorView & mpanels, const TensorView * bias,
                                const TensorView & y, int64_t p0, int64_t p1);
// W4A8: rows [m0, m1) of x (float32, row stride ldx) as xq [M, K] (each 8 k stored in the
// order 0 2 4 6 1 3 5 7: gemm_w4a8_avx2.cc), dx [M, K / 32] and xsum [M, K / G]; then the
// panels [p0, p1) from them.
void w4a8_prepare_rows(const float * x, int64_t ldx, int64_t K, int64_t G, int64_t m0, int64_t m1, int8_t * xq,
                       float * dx, float * xsum);
void linear_w4a8_packed_panels(const int8_t * xq, const float * dx, const float * xsum, int64_t M,
                               const TensorView & qpanels, const TensorView & spanels, const TensorView & mpanels,
                               const TensorView * bias, const TensorView & y, int64_t p0, int64_t p1);
// W8A16 (gemm_w8a16_avx2.cc): x float32 [M, K], row stride ldx; output panels [p0, p1).
void linear_w8a16_packed_panels(const float * x, int64_t ldx, int64_t M, const TensorView & qpanels,
                                const TensorView & spanels, const TensorView * bias, const TensorView & y, int64_t p0,
                                int64_t p1);
}  // namespace avx2

// Rows interleaved in tiles for the AVX-512 kernels' 16-row tiles: the M rows in row_tiles(M) tiles of
// near-equal height (5 or 6 to 16 rows), tile i the rows [tile_row(M, i), tile_row(M, i + 1));
// interleave_rows writes tiles [t0, t1) of x [M, K] (row stride ldx) into xt [M * K], tile i from
// xt + tile_row(M, i) K as [K, its rows]: every broadcast of a k then at a fixed offset from one pointer.
inline int64_t row_tiles(int64_t M) { return (M + 15) / 16; }
inline int64_t tile_row(int64_t M, int64_t i) { return M * i / row_tiles(M); }
void interleave_rows(const float * x, int64_t ldx, int64_t M, int64_t K, int64_t t0, int64_t t1, float * xt);

// The same panels with AVX-512 (F, BW, VL, DQ; gemm_avx512.cc), from the AVX2 kernels' prepared
// rows; the W4A8 one needs AVX512-VNNI too. The bits are the AVX2 kernels'. Where rows_interleaved(M, K),
// the float, W4A16 and W8A16 ones take their x (xp) interleaved (interleave_rows; ldx unused).
namespace avx512 {
// W4A16 takes the 16-row tiles from 5 rows (an n-gram verification step of 4 drafts), the others from 6:
// its 5-row GEMV tile runs two panels at a time and converts each word once per panel pair, the batch tile
// once for all 5 rows (30 layers of SmolLM2's matmuls, 2 threads, cold: 8.9 -> 7.5-8.0 ms).
constexpr int64_t kW4a16BatchRows = 5;
bool rows_interleaved(int64_t M, int64_t K, int64_t min_rows = 6);
void linear_packed_panels(const float * x, int64_t ldx, int64_t M, const TensorView & packed,
                          const TensorView * bias, const TensorView & y, int64_t p0, int64_t p1);
void linear_w4a16_packed_panels(const float * xp, const float * xsum, int64_t M, const TensorView & qpanels,
                                const TensorView & spanels, const TensorView & mpanels, const TensorView * bias,
                                const TensorView & y, int64_t p0, int64_t p1);
void linear_w4a8_packed_panels(const int8_t * xq, const float * dx, const float * xsum, int64_t M,
                               const TensorView & qpanels, const TensorView & spanels, const TensorView & mpanels,
                               const TensorView * bias, const TensorView & y, int64_t p0, int64_t p1);
void linear_w8a16_packed_panels(const float * x, int64_t ldx, int64_t M, const TensorView & qpanels,
                                const TensorView & spanels, const TensorView * bias, const TensorView & y, int64_t p0,
                                int64_t p1);
}  // namespace avx512

}  // namespace lmd::cpu
