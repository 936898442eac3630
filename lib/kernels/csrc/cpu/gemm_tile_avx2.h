// The tile of the packed matmuls' AVX2 kernels (gemm_avx2.cc, gemm_w4a16_avx2.cc): its
// shape and accumulators (the blocking: gemm_blocks.h). Include only from translation units compiled with
// -mavx2 -mfma -mf16c.
//
// Broadcast form: a tile of MR rows of x by NP panels (16 NP columns) keeps MR x 2 NP
// accumulators of eight columns each; per k it loads the panels' two vectors, broadcasts
// x[m, k] and does MR x 2 NP FMAs. Each accumulator lane is one output's fma chain over k,
// so the tile shape never changes a bit of the result (gemm.h).
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "cpu/gemm.h"
#include "cpu/gemm_blocks.h"
#include "cpu/simd_avx2.h"

namespace lmd::cpu::avx2::tile {

constexpr int64_t kW = kPanelWidth;
// Rows of the GEMM tile: 6 x 16 keeps 12 accumulators, two weight vectors and a broadcast
// in the 16 ymm registers, and 12 independent FMAs a k cover the FMA latency (4 cycles, 2 a cycle).
constexpr int kMR = 6;

// The accumulators of an MR x NP-panel tile. (Tiles copy them into a local before their
// loop: there the compiler can hold them in registers, as it cannot prove that stores
// through x or w never alias a struct it was handed.)
template <int MR, int NP>
struct Acc {
    __m256 v[MR][2 * NP];
};

template <int MR, int NP>
inline Acc<MR, NP> acc_zero() {
    Acc<MR, NP> acc;
    for (int m = 0; m < MR; ++m)
        for (int j = 0; j < 2 * NP; ++j) acc.v[m][j] = _mm256_setzero_ps();
    return acc;
}

// acc += x[0..MR) · w over kc steps of k. x: MR rows at stride ldx, at the first k;
// w: NP panels at stride ps (elements), at the first k (16 elements a k).
template <int MR, int NP, typename WT>
__attribute__((always_inline)) inline void tile_steps(const float * x, int64_t ldx, const WT * w, int64_t ps,
                                                      int64_t kc, Acc<MR, NP> & acc_io) {
    Acc<MR, NP> acc = acc_io;
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) {
        __m256 wv[2 * NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
            wv[2 * p] = load8(w + p * ps + k * kW);
            wv[2 * p + 1] = load8(w + p * ps + k * kW + 8);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
            const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
            for (int j = 0; j < 2 * NP; ++j) acc.v[m][j] = _mm256_fmadd_ps(xb, wv[j], acc.v[m][j]);
        }
    }
    acc_io = acc;
}

// y[m, c] = acc (+ bias[c]) for the `cols` valid columns of a tile (cols <= 16 NP).
template <int MR, int NP, typename BT, typename YT>
inline void tile_store(const Acc<MR, NP> & acc, const BT * bias, int64_t cols, YT * y, int64_t ldy) {
    __m256 bv[2 * NP] = {};
    if (bias) {
        alignas(32) float b[16 * NP] = {};
        for (int64_t c = 0; c < cols; ++c) b[c] = to_f32(bias[c]);
        for (int j = 0; j < 2 * NP; ++j) bv[j] = _mm256_load_ps(b + 8 * j);
    }
    for (int m = 0; m < MR; ++m) {
        YT * row = y + m * ldy;
        if (cols == 16 * NP) {
            for (int j = 0; j < 2 * NP; ++j) store8(row + 8 * j, bias ? _mm256_add_ps(acc.v[m][j], bv[j]) : acc.v[m][j]);
        } else {
            alignas(32) float t[16 * NP];
            for (int j = 0; j < 2 * NP; ++j) {
                _mm256_store_ps(t + 8 * j, bias ? _mm256_add_ps(acc.v[m][j], bv[j]) : acc.v[m][j]);
            }
            for (int64_t c = 0; c < cols; ++c) store1(row + c, t[c]);
        }
    }
}

// NP of the M <= 5 tiles: 8 to 12 accumulators cover the FMA latency.
constexpr int small_np(int mr) { return mr == 1 ? 4 : mr <= 3 ? 2 : 1; }

// Panels [p0, p1) for M <= 5 rows of a source whose tile<MR, NP>(x, ldx, p) converts its weights in
// registers (the float and W8A16 panels): MR = M, NP panels a pass so that the MR x 2 NP
// accumulators cover the FMA latency; the last, partial panel alone.
template <int MR, int NP, typename Src, typename BT, typename YT>
void panels_small(const Src & src, const float * x, int64_t ldx, int64_t N, const BT * bias, YT * y, int64_t ldy,
                  int64_t p0, int64_t p1) {
    auto bias_at = [&](int64_t p) { return bias ? bias + p * kW : nullptr; };
    int64_t p = p0;
    for (; p + NP <= p1 && (p + NP) * kW <= N; p += NP) {
        tile_store<MR, NP>(src.template tile<MR, NP>(x, ldx, p), bias_at(p), NP * kW, y + p * kW, ldy);
    }
    for (; p < p1; ++p) {
        tile_store<MR, 1>(src.template tile<MR, 1>(x, ldx, p), bias_at(p), std::min<int64_t>(kW, N - p * kW),
                          y + p * kW, ldy);
    }
}

inline __m256i load_words(const int32_t * p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

// The W4A16 panels (gemm.h) as the W4A16 and W4A8 kernels read them: the words, their scales
// and mins in ST (float or f16), and X [M, K / G], the group sums of the prepared rows.
template <typename ST>
struct W4Panels {
    const int32_t * q;
    const ST * s;
    const ST * mn;
    int64_t K, G, ng;  // ng = K / G
    const float * xsum;

    // 16-column panel p is columns 16 (p mod 4).. of 64-wide panel p / 4
    static constexpr int64_t kW4 = kW4A16PanelWidth;
    const int32_t * words(int64_t p, int64_t c) const { return q + (p / 4 * (K / 8) + c) * kW4 + p % 4 * kW; }
    const ST * scales(int64_t p, int64_t g) const { return s + (p / 4 * ng + g) * kW4 + p % 4 * kW; }
    const ST * mins(int64_t p, int64_t g) const { return mn + (p / 4 * ng + g) * kW4 + p % 4 * kW; }

    // U, the fma chain of mins · X over the groups, for rows m0.. (MR) and panels p.. (NP).
    template <int MR, int NP>
    __attribute__((always_inline)) Acc<MR, NP> mins_sum(int64_t m0, int64_t p) const {
        Acc<MR, NP> u = acc_zero<MR, NP>();
        const float * xs = xsum + m0 * ng;
        for (int64_t g = 0; g < ng; ++g) {
            __m256 mv[2 * NP];
            for (int i = 0; i < 2 * NP; ++i) mv[i] = load8(mins(p + i / 2, g) + 8 * (i % 2));
            for (int m = 0; m < MR; ++m) {
                const __m256 xb = _mm256_broadcast_ss(xs + m * ng + g);
                for (int i = 0; i < 2 * NP; ++i) u.v[m][i] = _mm256_fmadd_ps(mv[i], xb, u.v[m][i]);
            }
        }
        return u;
    }
};

}  // namespace lmd::cpu::avx2::tile
