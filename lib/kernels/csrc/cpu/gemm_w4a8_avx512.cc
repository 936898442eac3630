// AVX-512 VNNI kernel of the W4A8 matmul (gemm.h): the W4A16 panels times activations quantized to
// int8 per 32 k, the integer dots by VPDPBUSD, one instruction where the AVX2 kernel
// (gemm_w4a8_avx2.cc) takes three; the same bits as it and the reference. gemm.cc calls it only
// when the CPU has AVX512-VNNI. Compiled for it by the target pragma below, after every header
// (see gemm_avx512.cc).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/gemm.h"

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

#include "cpu/gemm_tile_avx512.h"

namespace lmd::cpu::avx512 {


namespace {

// The W4A16 panels times xq [M, K] (each 8 k in the order 0 2 4 6 1 3 5 7) and dx [M, K / 32]
// (gemm.h's W4A8). A word's low nibbles (AND 0x0F) are its columns' k = 0, 2, 4, 6 and the high
// ones (a 16-bit shift by 4, then the AND) k = 1, 3, 5, 7, so VPDPBUSD of each with one
// broadcast word of x adds a column's four products to its int32 lane: the exact I of gemm.h.
template <typename ST>
struct W4A8 : W4Panels<ST> {
    const int8_t * xq;
    const float * dx;

    template <int MR, int NP, int GC>
    void tile(int64_t m0, int64_t p, Acc<MR, NP> & out) const {
        const int64_t K = this->K, g_size = GC ? GC : this->G, nb = K / 32;
        const __m512i low = _mm512_set1_epi8(0x0F);
        const int8_t * xr = xq + m0 * K;
        const float * dr = dx + m0 * nb;
        const int32_t * wb[NP];
        for (int i = 0; i < NP; ++i) wb[i] = this->words(p + i);
        Acc<MR, NP> t = acc_zero<MR, NP>();
        for (int64_t g = 0; g < this->ng; ++g) {
            Acc<MR, NP> d = acc_zero<MR, NP>();
            for (int64_t b = g * g_size / 32; b < (g + 1) * g_size / 32; ++b) {
                __m512i acc[MR][NP];
                for (int m = 0; m < MR; ++m)
                    for (int i = 0; i < NP; ++i) acc[m][i] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int64_t c = 4 * b; c < 4 * b + 4; ++c) {
                    __m512i lo[NP], hi[NP];
                    for (int i = 0; i < NP; ++i) {
                        const __m512i v = load_words(wb[i] + c * kW4);
                        lo[i] = _mm512_and_si512(v, low);
                        hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    }
                    for (int m = 0; m < MR; ++m) {
                        int32_t xl, xh;
                        std::memcpy(&xl, xr + m * K + 8 * c, 4);
                        std::memcpy(&xh, xr + m * K + 8 * c + 4, 4);
                        const __m512i bl = _mm512_set1_epi32(xl), bh = _mm512_set1_epi32(xh);
                        for (int i = 0; i < NP; ++i) {
                            acc[m][i] = _mm512_dpbusd_epi32(acc[m][i], lo[i], bl);
                            acc[m][i] = _mm512_dpbusd_epi32(acc[m][i], hi[i], bh);
                        }
                    }
                }
                for (int m = 0; m < MR; ++m) {
                    const __m512 db = _mm512_set1_ps(dr[m * nb + b]);
                    for (int i = 0; i < NP; ++i) d.v[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][i]), db, d.v[m][i]);
                }
            }
            for (int i = 0; i < NP; ++i) {
                const __m512 sv = load16(this->scales(p + i) + g * kW4);
                for (int m = 0; m < MR; ++m) t.v[m][i] = _mm512_fmadd_ps(sv, d.v[m][i], t.v[m][i]);
            }
        }
        Acc<MR, NP> u;
        this->template mins_sum<MR, NP>(m0, p, u);  // a pass of its own, as in AVX2
        for (int m = 0; m < MR; ++m)
            for (int i = 0; i < NP; ++i) out.v[m][i] = _mm512_add_ps(t.v[m][i], u.v[m][i]);
    }
};

// Rows [m0, m0 + MR) by panels [p0, p1): NP-panel tiles, the rest one at a time.
template <int MR, int NP, int GC, typename ST, typename YT>
void w4a8_rows(const W4A8<ST> & a, int64_t m0, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0,
               int64_t p1) {
    panels_small<MR, NP>(
        [&](int64_t p, auto & out) { a.template tile<MR, sizeof(out.v[0]) / sizeof(__m512), GC>(m0, p, out); }, N, bias,
        y + m0 * ldy, ldy, p0, p1);
}

// One row: four panels a tile. More: tiles of 4 rows by 2 panels (the rest in one smaller tile),
// in blocks of 32 rows that stay in L1 / L2 while this thread's panels pass.
template <int GC, typename ST, typename YT>
void w4a8_panels(const W4A8<ST> & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0,
                 int64_t p1) {
    if (M == 1) return w4a8_rows<1, 4, GC>(a, 0, N, bias, y, ldy, p0, p1);
    constexpr int64_t kRowBlock = 32;
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
        const int64_t me = std::min(M, mb + kRowBlock);
        for (int64_t p = p0; p < p1; p += 2) {
            const int64_t pe = std::min(p1, p + 2);
            int64_t m = mb;
            for (; m + 4 <= me; m += 4) w4a8_rows<4, 2, GC>(a, m, N, bias, y, ldy, p, pe);
            switch (me - m) {
                case 3: w4a8_rows<3, 2, GC>(a, m, N, bias, y, ldy, p, pe); break;
                case 2: w4a8_rows<2, 2, GC>(a, m, N, bias, y, ldy, p, pe); break;
                case 1: w4a8_rows<1, 2, GC>(a, m, N, bias, y, ldy, p, pe); break;
                default: break;
            }
        }
    }
}

template <typename ST, typename YT>
void w4a8_panels_g(const W4A8<ST> & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0,
                   int64_t p1) {
    switch (a.G) {
        case 32: w4a8_panels<32>(a, M, N, bias, y, ldy, p0, p1); break;
        case 128: w4a8_panels<128>(a, M, N, bias, y, ldy, p0, p1); break;
        default: w4a8_panels<0>(a, M, N, bias, y, ldy, p0, p1); break;
    }
}

template <typename ST>
void w4a8_typed(const int8_t * xq, const float * dx, const float * xsum, int64_t M, const TensorView & qpanels,
                const TensorView & spanels, const TensorView & mpanels, const float * bias, const TensorView & y,
                int64_t p0, int64_t p1) {
    const int64_t K = qpanels.size(1) * 8, ng = spanels.size(1);
    const W4A8<ST> a{{qpanels.ptr<int32_t>(), spanels.ptr<ST>(), mpanels.ptr<ST>(), K, K / ng, ng, xsum}, xq, dx};
    const int64_t N = y.size(1), ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: w4a8_panels_g(a, M, N, bias, y.ptr<float>(), ldy, p0, p1); break;
        case DType::bf16: w4a8_panels_g(a, M, N, bias, y.ptr<bf16>(), ldy, p0, p1); break;
        case DType::f16: w4a8_panels_g(a, M, N, bias, y.ptr<f16>(), ldy, p0, p1); break;
        default: break;
    }
}

}  // namespace

void linear_w4a8_packed_panels(const int8_t * xq, const float * dx, const float * xsum, int64_t M,
                               const TensorView & qpanels, const TensorView & spanels, const TensorView & mpanels,
                               const TensorView * bias, const TensorView & y, int64_t p0, int64_t p1) {
    const float * b = bias ? bias->ptr<float>() : nullptr;
    if (spanels.dtype == DType::f16) {
        w4a8_typed<f16>(xq, dx, xsum, M, qpanels, spanels, mpanels, b, y, p0, p1);
    } else {
        w4a8_typed<float>(xq, dx, xsum, M, qpanels, spanels, mpanels, b, y, p0, p1);
    }
}


#undef LMD_AVX512_INLINE

}  // namespace lmd::cpu::avx512

#pragma GCC pop_options
