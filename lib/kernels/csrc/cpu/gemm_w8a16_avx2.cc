// AVX2/FMA/F16C kernels of the W8A16 matmul over panels (gemm.h; the tile: gemm_tile_avx2.h).
// This file is compiled with those flags; gemm.cc calls into it only when the CPU has all three.
//
// A panel's k-row is 16 int8 weights: two sign-extensions and two converts make its two float
// vectors, which then meet a broadcast x[m, k] as the float panels' do. Per group, D is one fma
// chain per output; T folds D in times the group's scale. M <= 5 converts in registers; the
// GEMM converts a chunk of a panel once into an L1 buffer and runs the float tiles over it.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/gemm_tile_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

using namespace tile;

// The 16 weights of a panel's k-row as two eight-float vectors (exact).
__attribute__((always_inline)) inline void widen_q(const int8_t * p, __m256 & lo, __m256 & hi) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p + 8))));
}

// The panels: qpanels int8 [P, K, 16], spanels ST [P, K / G, 16].
template <typename ST>
struct W8Panels {
    const int8_t * q;
    const ST * s;
    int64_t K, G, ng;

    const int8_t * panel(int64_t p) const { return q + p * K * kW; }  // + k kW
    const ST * scales(int64_t p) const { return s + p * ng * kW; }     // + g kW

    // An M <= 5 tile of rows x (stride ldx) over NP panels from p, all of K, widened in registers.
    template <int MR, int NP>
    Acc<MR, NP> tile(const float * x, int64_t ldx, int64_t p) const {
        Acc<MR, NP> t = acc_zero<MR, NP>();
        for (int64_t g = 0; g < ng; ++g) {
            Acc<MR, NP> d = acc_zero<MR, NP>();
            for (int64_t k = g * G; k < (g + 1) * G; ++k) {
                if (k % 4 == 0) {  // a line holds four k: ask for the one 32 k ahead
                    for (int i = 0; i < NP; ++i) _mm_prefetch(reinterpret_cast<const char *>(panel(p + i) + (k + 32) * kW), _MM_HINT_T0);
                }
                if constexpr (MR == 1) {  // each panel's vectors used as soon as made: fewer live registers
                    const __m256 xb = _mm256_broadcast_ss(x + k);
                    for (int i = 0; i < NP; ++i) {
                        __m256 lo, hi;
                        widen_q(panel(p + i) + k * kW, lo, hi);
                        d.v[0][2 * i] = _mm256_fmadd_ps(xb, lo, d.v[0][2 * i]);
                        d.v[0][2 * i + 1] = _mm256_fmadd_ps(xb, hi, d.v[0][2 * i + 1]);
                    }
                } else {  // each panel's vectors meet every row
                    __m256 w[2 * NP];
                    for (int i = 0; i < NP; ++i) widen_q(panel(p + i) + k * kW, w[2 * i], w[2 * i + 1]);
                    for (int m = 0; m < MR; ++m) {
                        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
                        for (int j = 0; j < 2 * NP; ++j) d.v[m][j] = _mm256_fmadd_ps(xb, w[j], d.v[m][j]);
                    }
                }
            }
            for (int j = 0; j < 2 * NP; ++j) {
                const __m256 sv = load8(scales(p + j / 2) + g * kW + 8 * (j % 2));
                for (int m = 0; m < MR; ++m) t.v[m][j] = _mm256_fmadd_ps(sv, d.v[m][j], t.v[m][j]);
            }
        }
        return t;
    }

    // Panel p, k in [k0, k0 + kc), as float32 [kc, 16] into buf.
    void chunk(int64_t p, int64_t k0, int64_t kc, float * buf) const {
        for (int64_t k = k0; k < k0 + kc; ++k) {
            __m256 lo, hi;
            widen_q(panel(p) + k * kW, lo, hi);
            _mm256_storeu_ps(buf + (k - k0) * kW, lo);
            _mm256_storeu_ps(buf + (k - k0) * kW + 8, hi);
        }
    }

    // The groups of a chunk for one MR-row tile of the GEMM: D over each group in registers from
    // the buffer, T in part [MR, 16] folded in after each; after the last group, y = T (+ bias).
    template <int MR, typename YT>
    void tile_chunk(const float * x, int64_t ldx, int64_t p, int64_t k0, int64_t kc, const float * buf, float * part,
                    const float * bias, int64_t cols, YT * y, int64_t ldy) const {
        for (int64_t kg = k0; kg < k0 + kc; kg += G) {
            Acc<MR, 1> d = acc_zero<MR, 1>();
            tile_steps<MR, 1>(x + kg, ldx, buf + (kg - k0) * kW, 0, G, d);
            for (int h = 0; h < 2; ++h) {
                const __m256 sv = load8(scales(p) + kg / G * kW + 8 * h);
                for (int m = 0; m < MR; ++m) {
                    const __m256 t = kg == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + m * kW + 8 * h);
                    _mm256_storeu_ps(part + m * kW + 8 * h, _mm256_fmadd_ps(sv, d.v[m][h], t));
                }
            }
        }
        if (k0 + kc == K) {
            Acc<MR, 1> acc;
            for (int m = 0; m < MR; ++m)
                for (int h = 0; h < 2; ++h) acc.v[m][h] = _mm256_loadu_ps(part + m * kW + 8 * h);
            tile_store<MR, 1>(acc, bias, cols, y, ldy);
        }
    }
};

template <typename ST, typename YT>
void panels_gemm(const W8Panels<ST> & a, const float * x, int64_t ldx, int64_t M, int64_t N, const float * bias, YT * y,
                 int64_t ldy, int64_t p0, int64_t p1) {
    static thread_local std::vector<float> buf;
    const int64_t kcs = std::max<int64_t>(1, kKC / a.G) * a.G;
    buf.resize(kcs * kW);
    gemm_blocks<kMR>(M, a.K, kcs, p0, p1, [&](int64_t p, int64_t k0, int64_t kc) { a.chunk(p, k0, kc, buf.data()); },
                     [&](int64_t m, int mr, int64_t p, int64_t k0, int64_t kc, float * part) {
                         const float * b = bias ? bias + p * kW : nullptr;
                         const int64_t cols = std::min<int64_t>(kW, N - p * kW);
                         YT * yt = y + m * ldy + p * kW;
                         const float * xt = x + m * ldx;
                         switch (mr) {
                             case 6: a.template tile_chunk<6>(xt, ldx, p, k0, kc, buf.data(), part, b, cols, yt, ldy); break;
                             case 5: a.template tile_chunk<5>(xt, ldx, p, k0, kc, buf.data(), part, b, cols, yt, ldy); break;
                             case 4: a.template tile_chunk<4>(xt, ldx, p, k0, kc, buf.data(), part, b, cols, yt, ldy); break;
                             case 3: a.template tile_chunk<3>(xt, ldx, p, k0, kc, buf.data(), part, b, cols, yt, ldy); break;
                             case 2: a.template tile_chunk<2>(xt, ldx, p, k0, kc, buf.data(), part, b, cols, yt, ldy); break;
                             default: a.template tile_chunk<1>(xt, ldx, p, k0, kc, buf.data(), part, b, cols, yt, ldy); break;
                         }
                     });
}

// A few rows more than a tile (a decode step's batch): per panel, its rows in tiles of five
// converted in registers; the panel's 16 k-rows a line stay in L1 from one tile to the next.
template <typename ST, typename YT>
void panels_rows(const W8Panels<ST> & a, const float * x, int64_t ldx, int64_t M, int64_t N, const float * bias,
                 YT * y, int64_t ldy, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
        const float * b = bias ? bias + p * kW : nullptr;
        const int64_t cols = std::min<int64_t>(kW, N - p * kW);
        for (int64_t m = 0; m < M; m += 5) {
            const float * xm = x + m * ldx;
            YT * ym = y + m * ldy + p * kW;
            switch (std::min<int64_t>(5, M - m)) {
                case 5: tile_store<5, 1>(a.template tile<5, 1>(xm, ldx, p), b, cols, ym, ldy); break;
                case 4: tile_store<4, 1>(a.template tile<4, 1>(xm, ldx, p), b, cols, ym, ldy); break;
                case 3: tile_store<3, 1>(a.template tile<3, 1>(xm, ldx, p), b, cols, ym, ldy); break;
                case 2: tile_store<2, 1>(a.template tile<2, 1>(xm, ldx, p), b, cols, ym, ldy); break;
                default: tile_store<1, 1>(a.template tile<1, 1>(xm, ldx, p), b, cols, ym, ldy); break;
            }
        }
    }
}

// Rows up to this many take panels_rows; more, the GEMM.
constexpr int64_t kRowTilesMax = 40;

template <typename ST, typename YT>
void panels(const W8Panels<ST> & a, const float * x, int64_t ldx, int64_t M, int64_t N, const float * bias, YT * y,
            int64_t ldy, int64_t p0, int64_t p1) {
    if (M > 5 && M <= kRowTilesMax) return panels_rows(a, x, ldx, M, N, bias, y, ldy, p0, p1);
    switch (M) {
        case 1: panels_small<1, small_np(1)>(a, x, ldx, N, bias, y, ldy, p0, p1); break;
        case 2: panels_small<2, small_np(2)>(a, x, ldx, N, bias, y, ldy, p0, p1); break;
        case 3: panels_small<3, small_np(3)>(a, x, ldx, N, bias, y, ldy, p0, p1); break;
        case 4: panels_small<4, small_np(4)>(a, x, ldx, N, bias, y, ldy, p0, p1); break;
        case 5: panels_small<5, small_np(5)>(a, x, ldx, N, bias, y, ldy, p0, p1); break;
        default: panels_gemm(a, x, ldx, M, N, bias, y, ldy, p0, p1); break;
    }
}

template <typename ST>
void panels_typed(const float * x, int64_t ldx, int64_t M, const TensorView & qpanels, const TensorView & spanels,
                  const float * bias, const TensorView & y, int64_t p0, int64_t p1) {
    const int64_t K = qpanels.size(1), ng = spanels.size(1);
    const W8Panels<ST> a{qpanels.ptr<int8_t>(), spanels.ptr<ST>(), K, K / ng, ng};
    const int64_t N = y.size(1), ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: panels(a, x, ldx, M, N, bias, y.ptr<float>(), ldy, p0, p1); break;
        case DType::bf16: panels(a, x, ldx, M, N, bias, y.ptr<bf16>(), ldy, p0, p1); break;
        case DType::f16: panels(a, x, ldx, M, N, bias, y.ptr<f16>(), ldy, p0, p1); break;
        default: break;
    }
}

}  // namespace

void linear_w8a16_packed_panels(const float * x, int64_t ldx, int64_t M, const TensorView & qpanels,
                                const TensorView & spanels, const TensorView * bias, const TensorView & y, int64_t p0,
                                int64_t p1) {
    const float * b = bias ? bias->ptr<float>() : nullptr;
    if (spanels.dtype == DType::f16) {
        panels_typed<f16>(x, ldx, M, qpanels, spanels, b, y, p0, p1);
    } else {
        panels_typed<float>(x, ldx, M, qpanels, spanels, b, y, p0, p1);
    }
}

}  // namespace lmd::cpu::avx2
