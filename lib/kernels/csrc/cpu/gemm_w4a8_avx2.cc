// AVX2 kernels of the W4A8 matmul (gemm.h): the W4A16 panels times activations quantized to
// int8 per 32 k, multiplied in 8-bit lanes as llama.cpp multiplies Q4_1 by Q8_1.
// This file is compiled with -mavx2 -mfma -mf16c; gemm.cc calls into it only when the CPU has them.
//
// A 256-bit load of a panel row holds eight columns' words of eight nibbles (k = 8 c + j in
// nibble j). AND 0x0F gives each column's bytes for k = 0, 2, 4, 6; a 16-bit shift by 4 and
// the AND, those for k = 1, 3, 5, 7. The prepared rows store each 8 k in that order
// (0 2 4 6 1 3 5 7), so one broadcast 32-bit word of x meets each half: vpmaddubsw multiplies
// the unsigned nibbles by the signed int8 x and adds pairs into 16 bits, and a 32-k block's
// eight such sums per lane stay below 2^15 (16 products of at most 15 * 127). vpmaddwd by
// ones then gives each column's exact int32 dot over the block. The float part (D, T, U of
// gemm.h) is one chain per output, so no tile shape changes a bit of y.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/gemm.h"
#include "cpu/gemm_tile_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

using namespace tile;

inline __m256i broadcast_word(const int8_t * p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return _mm256_set1_epi32(w);
}

// The panels (W4Panels, X there being Q8_1's sums) and the prepared rows: xq [M, K] (each 8 k
// in the order 0 2 4 6 1 3 5 7), dx [M, K / 32].
template <typename ST>
struct W4A8 : W4Panels<ST> {
    const int8_t * xq;
    const float * dx;

    using W4Panels<ST>::K;
    using W4Panels<ST>::G;
    using W4Panels<ST>::ng;
    using W4Panels<ST>::words;
    using W4Panels<ST>::scales;

    // y = T + U for rows m0.. (MR) and NP panels from p (within one 64-wide panel), all of K.
    // GC: the group size when known at compile time, else 0.
    template <int MR, int NP, int GC>
    Acc<MR, NP> tile(int64_t m0, int64_t p) const {
        constexpr int NV = 2 * NP;
        const int64_t g_size = GC ? GC : G, nb = K / 32;
        const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
        const int8_t * xr = xq + m0 * K;
        const float * dr = dx + m0 * nb;
        Acc<MR, NP> t = acc_zero<MR, NP>();
        for (int64_t g = 0; g < ng; ++g) {
            Acc<MR, NP> d = acc_zero<MR, NP>();
            for (int64_t b = g * g_size / 32; b < (g + 1) * g_size / 32; ++b) {
                __m256i acc[MR][NV];
                for (int m = 0; m < MR; ++m)
                    for (int i = 0; i < NV; ++i) acc[m][i] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int64_t c = 4 * b; c < 4 * b + 4; ++c) {
                    const int32_t * wc = words(p, c);
                    __m256i lo[NV], hi[NV];
                    for (int i = 0; i < NV; ++i) {
                        const __m256i v = load_words(wc + i / 2 * kW + 8 * (i % 2));
                        lo[i] = _mm256_and_si256(v, low);
                        hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    }
                    for (int m = 0; m < MR; ++m) {
                        const __m256i xl = broadcast_word(xr + m * K + 8 * c), xh = broadcast_word(xr + m * K + 8 * c + 4);
                        for (int i = 0; i < NV; ++i) {
                            acc[m][i] = _mm256_add_epi16(acc[m][i], _mm256_maddubs_epi16(lo[i], xl));
                            acc[m][i] = _mm256_add_epi16(acc[m][i], _mm256_maddubs_epi16(hi[i], xh));
                        }
                    }
                }
                for (int m = 0; m < MR; ++m) {
                    const __m256 db = _mm256_broadcast_ss(dr + m * nb + b);
                    for (int i = 0; i < NV; ++i) {
                        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m][i], ones));
                        d.v[m][i] = _mm256_fmadd_ps(dot, db, d.v[m][i]);
                    }
                }
            }
            for (int i = 0; i < NV; ++i) {
                const __m256 sv = load8(scales(p + i / 2, g) + 8 * (i % 2));
                for (int m = 0; m < MR; ++m) t.v[m][i] = _mm256_fmadd_ps(sv, d.v[m][i], t.v[m][i]);
            }
        }
        // U, the mins' chain, in a pass of its own: beside T it would leave too few registers
        const Acc<MR, NP> u = this->template mins_sum<MR, NP>(m0, p);
        for (int m = 0; m < MR; ++m)
            for (int i = 0; i < NV; ++i) t.v[m][i] = _mm256_add_ps(t.v[m][i], u.v[m][i]);
        return t;
    }
};

// Rows [m0, m0 + MR) by panels [p0, p1): NP-panel tiles where they fit in a 64-wide panel.
template <int MR, int NP, int GC, typename ST, typename YT>
void rows_tile(const W4A8<ST> & a, int64_t m0, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0,
               int64_t p1) {
    auto bias_at = [&](int64_t p) { return bias ? bias + p * kW : nullptr; };
    YT * yr = y + m0 * ldy;
    int64_t p = p0;
    for (; p < p1 && NP > 1 && p % NP; ++p) {
        tile_store<MR, 1>(a.template tile<MR, 1, GC>(m0, p), bias_at(p), std::min<int64_t>(kW, N - p * kW), yr + p * kW, ldy);
    }
    for (; p + NP <= p1 && (p + NP) * kW <= N; p += NP) {
        tile_store<MR, NP>(a.template tile<MR, NP, GC>(m0, p), bias_at(p), NP * kW, yr + p * kW, ldy);
    }
    for (; p < p1; ++p) {
        tile_store<MR, 1>(a.template tile<MR, 1, GC>(m0, p), bias_at(p), std::min<int64_t>(kW, N - p * kW), yr + p * kW, ldy);
    }
}

// Rows of x in tiles of 4 (the rest in one smaller tile), in blocks of 32 rows that stay in
// L1 / L2 while this thread's panels pass.
template <int GC, typename ST, typename YT>
void panels(const W4A8<ST> & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0, int64_t p1) {
    if (M == 1) return rows_tile<1, 2, GC>(a, 0, N, bias, y, ldy, p0, p1);
    constexpr int64_t kRowBlock = 32;
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
        const int64_t me = std::min(M, mb + kRowBlock);
        for (int64_t p = p0; p < p1; ++p) {
            int64_t m = mb;
            for (; m + 4 <= me; m += 4) rows_tile<4, 1, GC>(a, m, N, bias, y, ldy, p, p + 1);
            switch (me - m) {
                case 3: rows_tile<3, 1, GC>(a, m, N, bias, y, ldy, p, p + 1); break;
                case 2: rows_tile<2, 1, GC>(a, m, N, bias, y, ldy, p, p + 1); break;
                case 1: rows_tile<1, 1, GC>(a, m, N, bias, y, ldy, p, p + 1); break;
                default: break;
            }
        }
    }
}

template <typename ST, typename YT>
void panels_g(const W4A8<ST> & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0, int64_t p1) {
    switch (a.G) {
        case 32: panels<32>(a, M, N, bias, y, ldy, p0, p1); break;
        case 128: panels<128>(a, M, N, bias, y, ldy, p0, p1); break;
        default: panels<0>(a, M, N, bias, y, ldy, p0, p1); break;
    }
}

template <typename ST>
void panels_typed(const int8_t * xq, const float * dx, const float * xsum, int64_t M, const TensorView & qpanels,
                  const TensorView & spanels, const TensorView & mpanels, const float * bias, const TensorView & y,
                  int64_t p0, int64_t p1) {
    const int64_t K = qpanels.size(1) * 8, ng = spanels.size(1);
    const W4A8<ST> a{{qpanels.ptr<int32_t>(), spanels.ptr<ST>(), mpanels.ptr<ST>(), K, K / ng, ng, xsum}, xq, dx};
    const int64_t N = y.size(1), ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: panels_g(a, M, N, bias, y.ptr<float>(), ldy, p0, p1); break;
        case DType::bf16: panels_g(a, M, N, bias, y.ptr<bf16>(), ldy, p0, p1); break;
        case DType::f16: panels_g(a, M, N, bias, y.ptr<f16>(), ldy, p0, p1); break;
        default: break;
    }
}

}  // namespace

void w4a8_prepare_rows(const float * x, int64_t ldx, int64_t K, int64_t G, int64_t m0, int64_t m1, int8_t * xq,
                       float * dx, float * xsum) {
    int32_t r[32];
    for (int64_t m = m0; m < m1; ++m) {
        const float * row = x + m * ldx;
        for (int64_t b = 0; b < K / 32; ++b) {
            const float d = quantize_block32(row + 32 * b, r);
            dx[m * (K / 32) + b] = d;
            int8_t * out = xq + m * K + 32 * b;
            int32_t sum = 0;
            for (int c = 0; c < 4; ++c) {
                for (int j = 0; j < 4; ++j) {
                    out[8 * c + j] = static_cast<int8_t>(r[8 * c + 2 * j]);
                    out[8 * c + 4 + j] = static_cast<int8_t>(r[8 * c + 2 * j + 1]);
                    sum += r[8 * c + 2 * j] + r[8 * c + 2 * j + 1];
                }
            }
            float & xs = xsum[m * (K / G) + 32 * b / G];
            xs = std::fma(static_cast<float>(sum), d, 32 * b % G ? xs : 0.f);
        }
    }
}

void linear_w4a8_packed_panels(const int8_t * xq, const float * dx, const float * xsum, int64_t M,
                               const TensorView & qpanels, const TensorView & spanels, const TensorView & mpanels,
                               const TensorView * bias, const TensorView & y, int64_t p0, int64_t p1) {
    const float * b = bias ? bias->ptr<float>() : nullptr;
    if (spanels.dtype == DType::f16) {
        panels_typed<f16>(xq, dx, xsum, M, qpanels, spanels, mpanels, b, y, p0, p1);
    } else {
        panels_typed<float>(xq, dx, xsum, M, qpanels, spanels, mpanels, b, y, p0, p1);
    }
}

}  // namespace lmd::cpu::avx2
