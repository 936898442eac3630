// The tile of the packed matmuls' AVX-512 kernels (gemm_avx512.cc, gemm_w4a8_avx512.cc): element
// loads and stores, the accumulators, the tile loops and the W4A16 panels' accessors.
// Include only inside `#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")`,
// after every other header (see gemm_avx512.cc for why a pragma and not compile flags).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/gemm.h"

namespace lmd::cpu::avx512 {

namespace {


struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

constexpr int64_t kW = kPanelWidth;  // columns of a panel: one zmm
constexpr int64_t kW4 = kW4A16PanelWidth;

// No vector (nor struct of them) is passed or returned by value between functions that may stay
// apart: GCC 12 keeps only their low 128 bits there, since a function's target here comes from a
// pragma and not the command line (seen with the W4A8 kernel's VNNI target, and in the sanitizer's
// build, which inlines less). Tiles write through references; the helpers below are always inlined.
#define LMD_AVX512_INLINE __attribute__((always_inline)) inline

LMD_AVX512_INLINE __mmask16 first(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// Sixteen consecutive elements as float32 (the first n; the rest 0).
LMD_AVX512_INLINE __m512 load16(const float * p, int64_t n = 16) { return _mm512_maskz_loadu_ps(first(n), p); }
LMD_AVX512_INLINE __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
LMD_AVX512_INLINE __m512 load16(const bf16 * p, int64_t n = 16) { return widen_bf16(_mm256_maskz_loadu_epi16(first(n), p)); }
LMD_AVX512_INLINE __m512 load16(const f16 * p, int64_t n = 16) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p)); }

// The first n of sixteen float32 lanes rounded to the destination's dtype: bfloat16 to nearest
// even with NaN kept quiet, float16 to nearest (simd_avx2.h's store8, sixteen wide).
LMD_AVX512_INLINE void store16(float * p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
LMD_AVX512_INLINE void store16(bf16 * p, __m512 v, int64_t n) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __m512i r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet);
    _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtepi32_epi16(r));  // every lane < 2^16: exact
}
LMD_AVX512_INLINE void store16(f16 * p, __m512 v, int64_t n) {
    _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

LMD_AVX512_INLINE __m512i load_words(const int32_t * p) { return _mm512_loadu_si512(p); }

// The accumulators of an MR-row by NP-panel tile (copied into locals by the loops, as in
// gemm_tile_avx2.h, so that they stay in registers).
template <int MR, int NP>
struct Acc {
    __m512 v[MR][NP];
};

template <int MR, int NP>
__attribute__((always_inline)) inline Acc<MR, NP> acc_zero() {
    Acc<MR, NP> a;
    for (int m = 0; m < MR; ++m)
        for (int i = 0; i < NP; ++i) a.v[m][i] = _mm512_setzero_ps();
    return a;
}

// y[m, c] = acc (+ bias[c]) for the `cols` valid columns of each panel's 16 (NP panels in a row).
template <int MR, int NP, typename BT, typename YT>
inline void tile_store(const Acc<MR, NP> & acc, const BT * bias, int64_t cols, YT * y, int64_t ldy) {
    for (int i = 0; i < NP; ++i) {
        const int64_t n = std::min<int64_t>(kW, cols - i * kW);
        const __m512 b = bias ? load16(bias + i * kW, n) : _mm512_setzero_ps();
        for (int m = 0; m < MR; ++m) {
            store16(y + m * ldy + i * kW, bias ? _mm512_add_ps(acc.v[m][i], b) : acc.v[m][i], n);
        }
    }
}

// acc += x[0..MR) · w over kc steps of k; w: one panel at its first k (16 elements a k).
template <int MR, typename WT>
__attribute__((always_inline)) inline void tile_steps(const float * x, int64_t ldx, const WT * w, int64_t kc,
                                                      Acc<MR, 1> & acc_io) {
    Acc<MR, 1> acc = acc_io;
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) {
        const __m512 wv = load16(w + k * kW);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) acc.v[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), wv, acc.v[m][0]);
    }
    acc_io = acc;
}

// Rows of the GEMM tile: 8 x 16 keeps 8 independent chains, enough for two 512-bit FMA units
// of 4 cycles' latency, and the row tail in few shapes.
constexpr int kMR = 8;

// NP of the M <= 5 tiles: 8 to 12 accumulators.
constexpr int small_np(int mr) { return mr == 1 ? 8 : mr <= 3 ? 4 : 2; }

// Panels [p0, p1) for M <= 5 rows (MR = M) in tiles of NP panels, the rest one at a time;
// tile(p, acc) sets Acc<MR, np> acc for np panels from p (through a reference: see above).
template <int MR, int NP, typename Tile, typename BT, typename YT>
void panels_small(Tile && tile, int64_t N, const BT * bias, YT * y, int64_t ldy, int64_t p0, int64_t p1) {
    auto bias_at = [&](int64_t p) { return bias ? bias + p * kW : nullptr; };
    int64_t p = p0;
    for (; p + NP <= p1 && (p + NP) * kW <= N; p += NP) {
        Acc<MR, NP> acc;
        tile(p, acc);
        tile_store<MR, NP>(acc, bias_at(p), NP * kW, y + p * kW, ldy);
    }
    for (; p < p1; ++p) {
        Acc<MR, 1> acc;
        tile(p, acc);
        tile_store<MR, 1>(acc, bias_at(p), std::min<int64_t>(kW, N - p * kW), y + p * kW, ldy);
    }
}

// run<MR>() for MR = M in 1..5.
template <typename Run>
void small_m(int64_t M, Run && run) {
    switch (M) {
        case 1: run(std::integral_constant<int, 1>()); break;
        case 2: run(std::integral_constant<int, 2>()); break;
        case 3: run(std::integral_constant<int, 3>()); break;
        case 4: run(std::integral_constant<int, 4>()); break;
        default: run(std::integral_constant<int, 5>()); break;
    }
}

// run<MR>() for MR = mr in 1..kMR.
template <typename Run>
void tile_rows(int mr, Run && run) {
    switch (mr) {
        case 8: run(std::integral_constant<int, 8>()); break;
        case 7: run(std::integral_constant<int, 7>()); break;
        case 6: run(std::integral_constant<int, 6>()); break;
        case 5: run(std::integral_constant<int, 5>()); break;
        case 4: run(std::integral_constant<int, 4>()); break;
        case 3: run(std::integral_constant<int, 3>()); break;
        case 2: run(std::integral_constant<int, 2>()); break;
        default: run(std::integral_constant<int, 1>()); break;
    }
}

// ---- W4 panels -------------------------------------------------------------------------------------

// The W4A16 panels (gemm.h) with their scales and mins in ST, and X [M, K / G]: the 16-column
// panel p is columns 16 (p mod 4).. of 64-wide panel p / 4.
template <typename ST>
struct W4Panels {
    const int32_t * q;
    const ST * s;
    const ST * mn;
    int64_t K, G, ng;
    const float * xsum;

    const int32_t * words(int64_t p) const { return q + p / 4 * (K / 8) * kW4 + p % 4 * kW; }  // + c kW4
    const ST * scales(int64_t p) const { return s + p / 4 * ng * kW4 + p % 4 * kW; }            // + g kW4
    const ST * mins(int64_t p) const { return mn + p / 4 * ng * kW4 + p % 4 * kW; }

    // U, the fma chain of mins · X over the groups, for rows m0.. (MR) and panels p.. (NP).
    template <int MR, int NP>
    __attribute__((always_inline)) void mins_sum(int64_t m0, int64_t p, Acc<MR, NP> & out) const {
        Acc<MR, NP> u = acc_zero<MR, NP>();
        const float * xs = xsum + m0 * ng;
        for (int64_t g = 0; g < ng; ++g) {
            __m512 mv[NP];
            for (int i = 0; i < NP; ++i) mv[i] = load16(mins(p + i) + g * kW4);
            for (int m = 0; m < MR; ++m) {
                const __m512 xb = _mm512_set1_ps(xs[m * ng + g]);
                for (int i = 0; i < NP; ++i) u.v[m][i] = _mm512_fmadd_ps(mv[i], xb, u.v[m][i]);
            }
        }
        out = u;
    }
};

}  // namespace

}  // namespace lmd::cpu::avx512
