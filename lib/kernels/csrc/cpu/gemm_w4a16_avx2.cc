// AVX2/FMA/F16C kernels of the W4A16 matmul over panels (gemm.h; the tile: gemm_tile_avx2.h).
// This file is compiled with those flags; gemm.cc calls into it only when the CPU has all three.
//
// Per group g, an output keeps D, the fma chain of xp · qp over the group's k, and folds it
// into T = fma(scales, D, T); after the last group, U = the fma chain of mins · X over the
// groups, and y = T + U. xp is x pre-scaled by 2^(-4 j) (j = k mod 8, j < 7) and qp is
// nibble j masked in place, q 2^(4 j), so that a word turns into eight floats with an AND and
// a convert; their products are x q. All sums live in the tile's lanes (broadcast form), so
// no tile shape changes a bit: the M <= 5 path converts the words in registers, the GEMM path
// converts a chunk of a panel once into an L1 buffer of qp.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/gemm_tile_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

using namespace tile;

// qp of nibble J of each word: q 2^(4 J), J < 7; nibble 7 is shifted down instead, as
// masking it in place would set the sign bit.
template <int J>
__attribute__((always_inline)) inline __m256 nibble(__m256i v) {
    if constexpr (J < 7) return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * J))));
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
}

// The panels (W4Panels) and the prepared rows xp [M, K].
template <typename ST>
struct W4A16 : W4Panels<ST> {
    const float * xp;

    using W4Panels<ST>::K;
    using W4Panels<ST>::G;
    using W4Panels<ST>::ng;
    using W4Panels<ST>::xsum;
    using W4Panels<ST>::words;
    using W4Panels<ST>::scales;
    using W4Panels<ST>::mins;

    // d += x · w for rows 0..MR at x (stride K) and the 2 NP column vectors w.
    template <int MR, int NP>
    __attribute__((always_inline)) void fma_step(const float * x, const __m256 * w, Acc<MR, NP> & d) const {
        for (int m = 0; m < MR; ++m) {
            const __m256 xb = _mm256_broadcast_ss(x + m * K);
            for (int i = 0; i < 2 * NP; ++i) d.v[m][i] = _mm256_fmadd_ps(xb, w[i], d.v[m][i]);
        }
    }

    // An M <= 5 tile (rows 0..MR) over NP whole panels from p, within one 64-wide panel, all
    // of K, converted in registers.
    template <int MR, int NP>
    Acc<MR, NP> tile(int64_t p) const {
        const int64_t ps = kW;  // elements between the tile's panels: one 64-wide panel holds them
        Acc<MR, NP> t = acc_zero<MR, NP>(), u = acc_zero<MR, NP>();
        for (int64_t g = 0; g < ng; ++g) {
            Acc<MR, NP> d = acc_zero<MR, NP>();
            for (int64_t c = g * G / 8; c < (g + 1) * G / 8; ++c) {
                // a loop over the nibbles: the words are loaded again for each, as kept in
                // registers they would leave too few for the accumulators. Unrolled up to 4
                // rows, the masks then constants (5-30% faster); at 5 that ran 5% slower.
                const int32_t * wc = words(p, c);
                // each of a GEMV's many short runs of panels is a new stream to the hardware
                // prefetchers, which miss its first lines (120 matmuls of a decode step: -14%)
                for (int i = 0; i < NP; ++i)
                    _mm_prefetch(reinterpret_cast<const char *>(words(p, c + 16) + i * ps), _MM_HINT_T0);
                const float * xc = xp + 8 * c;
                __m256i mask = _mm256_set1_epi32(0xF);
                __m256 w[2 * NP];
                auto nibble_j = [&](int j) __attribute__((always_inline)) {
                    for (int i = 0; i < 2 * NP; ++i) {
                        w[i] = _mm256_cvtepi32_ps(_mm256_and_si256(load_words(wc + i / 2 * ps + 8 * (i % 2)), mask));
                    }
                    fma_step(xc + j, w, d);
                    mask = _mm256_slli_epi32(mask, 4);
                };
                if constexpr (MR < 5) {
#pragma GCC unroll 7
                    for (int j = 0; j < 7; ++j) nibble_j(j);
                } else {
#pragma GCC unroll 1
                    for (int j = 0; j < 7; ++j) nibble_j(j);
                }
                for (int i = 0; i < 2 * NP; ++i) w[i] = nibble<7>(load_words(wc + i / 2 * ps + 8 * (i % 2)));
                fma_step(xc + 7, w, d);
            }
            // both chains advance a group at a time here, where the group's scales and mins
            // arrive together (a second pass over the mins would read them again from memory)
            for (int i = 0; i < 2 * NP; ++i) {
                const __m256 sv = load8(scales(p + i / 2, g) + 8 * (i % 2));
                const __m256 mv = load8(mins(p + i / 2, g) + 8 * (i % 2));
                for (int m = 0; m < MR; ++m) {
                    t.v[m][i] = _mm256_fmadd_ps(sv, d.v[m][i], t.v[m][i]);
                    u.v[m][i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(xsum + m * ng + g), u.v[m][i]);
                }
            }
        }
        for (int m = 0; m < MR; ++m)
            for (int i = 0; i < 2 * NP; ++i) t.v[m][i] = _mm256_add_ps(t.v[m][i], u.v[m][i]);
        return t;
    }

    // qp of panel p, k in [k0, k0 + kc) (multiples of 8), into buf [kc, 16].
    void chunk(int64_t p, int64_t k0, int64_t kc, float * buf) const {
        for (int64_t c = k0 / 8; c < (k0 + kc) / 8; ++c) {
            float * out = buf + (c * 8 - k0) * kW;
            for (int h = 0; h < 2; ++h) {
                const __m256i v = load_words(words(p, c) + 8 * h);
                _mm256_storeu_ps(out + 0 * kW + 8 * h, nibble<0>(v));
                _mm256_storeu_ps(out + 1 * kW + 8 * h, nibble<1>(v));
                _mm256_storeu_ps(out + 2 * kW + 8 * h, nibble<2>(v));
                _mm256_storeu_ps(out + 3 * kW + 8 * h, nibble<3>(v));
                _mm256_storeu_ps(out + 4 * kW + 8 * h, nibble<4>(v));
                _mm256_storeu_ps(out + 5 * kW + 8 * h, nibble<5>(v));
                _mm256_storeu_ps(out + 6 * kW + 8 * h, nibble<6>(v));
                _mm256_storeu_ps(out + 7 * kW + 8 * h, nibble<7>(v));
            }
        }
    }
};

// (NP of its M <= 5 tiles: small_np, gemm_tile_avx2.h: MR x 2 NP chains of D, 8 to 12; at 3 rows one
// panel, as two spilled its 40 live registers (D, T and U) out of 16.)

template <int MR, typename ST, typename YT>
void panels_small(const W4A16<ST> & a, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0, int64_t p1) {
    constexpr int NP = MR == 3 ? 1 : small_np(MR);
    auto bias_at = [&](int64_t p) { return bias ? bias + p * kW : nullptr; };
    int64_t p = p0;
    for (; p < p1 && p % (kW4A16PanelWidth / kW); ++p) {  // up to the next 64-wide panel
        tile_store<MR, 1>(a.template tile<MR, 1>(p), bias_at(p), std::min<int64_t>(kW, N - p * kW), y + p * kW, ldy);
    }
    for (; p + NP <= p1 && (p + NP) * kW <= N; p += NP) {
        tile_store<MR, NP>(a.template tile<MR, NP>(p), bias_at(p), NP * kW, y + p * kW, ldy);
    }
    for (; p < p1; ++p) {
        tile_store<MR, 1>(a.template tile<MR, 1>(p), bias_at(p), std::min<int64_t>(kW, N - p * kW), y + p * kW, ldy);
    }
}

// The groups of a kc-long chunk for one 1-panel tile of the GEMM: D over each group from the
// qp buffer, in registers (as many as the float tile); T waits in part[MR, 16] (L1), folded
// in after each group. After the last group of all, U takes the registers, and
// y = T + U (+ bias). GC: the group size when known at compile time
// (the common ones), else 0.
template <int MR, int GC, typename ST, typename YT>
void tile_chunk(const W4A16<ST> & a, int64_t m0, int64_t p, int64_t k0, int64_t kc, const float * buf, float * part,
                const float * bias, int64_t cols, YT * y, int64_t ldy) {
    const int64_t G = GC ? GC : a.G;
    for (int64_t kg = k0; kg < k0 + kc; kg += G) {
        Acc<MR, 1> d = acc_zero<MR, 1>();
        tile_steps<MR, 1>(a.xp + m0 * a.K + kg, a.K, buf + (kg - k0) * kW, 0, G, d);
        const auto * s = a.scales(p, kg / G);
        for (int h = 0; h < 2; ++h) {
            const __m256 sv = load8(s + 8 * h);
            for (int m = 0; m < MR; ++m) {
                const __m256 t = kg == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + m * kW + 8 * h);
                _mm256_storeu_ps(part + m * kW + 8 * h, _mm256_fmadd_ps(sv, d.v[m][h], t));
            }
        }
    }
    if (k0 + kc == a.K) {
        Acc<MR, 1> y_acc = a.template mins_sum<MR, 1>(m0, p);
        for (int m = 0; m < MR; ++m) {
            for (int h = 0; h < 2; ++h) {
                y_acc.v[m][h] = _mm256_add_ps(_mm256_loadu_ps(part + m * kW + 8 * h), y_acc.v[m][h]);
            }
        }
        tile_store<MR, 1>(y_acc, bias, cols, y, ldy);
    }
}

template <int GC, typename ST, typename YT>
void tile_chunk_m(int mr, const W4A16<ST> & a, int64_t m0, int64_t p, int64_t k0, int64_t kc, const float * buf,
                  float * part, const float * bias, int64_t cols, YT * y, int64_t ldy) {
    switch (mr) {
        case 6: tile_chunk<6, GC>(a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
        case 5: tile_chunk<5, GC>(a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
        case 4: tile_chunk<4, GC>(a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
        case 3: tile_chunk<3, GC>(a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
        case 2: tile_chunk<2, GC>(a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
        default: tile_chunk<1, GC>(a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
    }
}

template <typename ST, typename YT>
void tile_chunk_g(int mr, const W4A16<ST> & a, int64_t m0, int64_t p, int64_t k0, int64_t kc, const float * buf,
                  float * part, const float * bias, int64_t cols, YT * y, int64_t ldy) {
    switch (a.G) {
        case 32: tile_chunk_m<32>(mr, a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
        case 64: tile_chunk_m<64>(mr, a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
        case 128: tile_chunk_m<128>(mr, a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
        default: tile_chunk_m<0>(mr, a, m0, p, k0, kc, buf, part, bias, cols, y, ldy); break;
    }
}

// The GEMM for M >= 6, blocked as the float one (gemm_blocks); chunks of k are whole groups.
template <typename ST, typename YT>
void panels_gemm(const W4A16<ST> & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0,
                 int64_t p1) {
    static thread_local std::vector<float> buf;
    const int64_t kcs = std::max<int64_t>(1, kKC / a.G) * a.G;
    buf.resize(kcs * kW);
    gemm_blocks<kMR>(M, a.K, kcs, p0, p1, [&](int64_t p, int64_t k0, int64_t kc) { a.chunk(p, k0, kc, buf.data()); },
                [&](int64_t m, int mr, int64_t p, int64_t k0, int64_t kc, float * part) {
                    tile_chunk_g(mr, a, m, p, k0, kc, buf.data(), part, bias ? bias + p * kW : nullptr,
                                 std::min<int64_t>(kW, N - p * kW), y + m * ldy + p * kW, ldy);
                });
}

template <typename ST, typename YT>
void panels(const W4A16<ST> & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0, int64_t p1) {
    switch (M) {
        case 1: panels_small<1>(a, N, bias, y, ldy, p0, p1); break;
        case 2: panels_small<2>(a, N, bias, y, ldy, p0, p1); break;
        case 3: panels_small<3>(a, N, bias, y, ldy, p0, p1); break;
        case 4: panels_small<4>(a, N, bias, y, ldy, p0, p1); break;
        case 5: panels_small<5>(a, N, bias, y, ldy, p0, p1); break;
        default: panels_gemm(a, M, N, bias, y, ldy, p0, p1); break;
    }
}

}  // namespace

void w4a16_prepare_rows(const float * x, int64_t ldx, int64_t K, int64_t G, int64_t m0, int64_t m1, float * xp,
                        float * xsum) {
    alignas(32) float f[8];
    for (int j = 0; j < 8; ++j) f[j] = j < 7 ? std::ldexp(1.f, -4 * j) : 1.f;
    const __m256 scale = _mm256_load_ps(f);
    for (int64_t m = m0; m < m1; ++m) {
        const float * row = x + m * ldx;
        for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(xp + m * K + k, _mm256_mul_ps(_mm256_loadu_ps(row + k), scale));
        for (int64_t g = 0; g < K / G; ++g) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(row + k));
            xsum[m * (K / G) + g] = hsum(acc);
        }
    }
}

namespace {

template <typename ST>
void panels_typed(const float * xp, const float * xsum, int64_t M, const TensorView & qpanels,
                  const TensorView & spanels, const TensorView & mpanels, const float * bias, const TensorView & y,
                  int64_t p0, int64_t p1) {
    const int64_t K = qpanels.size(1) * 8, ng = spanels.size(1);
    const W4A16<ST> a{{qpanels.ptr<int32_t>(), spanels.ptr<ST>(), mpanels.ptr<ST>(), K, K / ng, ng, xsum}, xp};
    const int64_t N = y.size(1), ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: panels(a, M, N, bias, y.ptr<float>(), ldy, p0, p1); break;
        case DType::bf16: panels(a, M, N, bias, y.ptr<bf16>(), ldy, p0, p1); break;
        case DType::f16: panels(a, M, N, bias, y.ptr<f16>(), ldy, p0, p1); break;
        default: break;
    }
}

}  // namespace

void linear_w4a16_packed_panels(const float * xp, const float * xsum, int64_t M, const TensorView & qpanels,
                                const TensorView & spanels, const TensorView & mpanels, const TensorView * bias,
                                const TensorView & y, int64_t p0, int64_t p1) {
    const float * b = bias ? bias->ptr<float>() : nullptr;
    if (spanels.dtype == DType::f16) {
        panels_typed<f16>(xp, xsum, M, qpanels, spanels, mpanels, b, y, p0, p1);
    } else {
        panels_typed<float>(xp, xsum, M, qpanels, spanels, mpanels, b, y, p0, p1);
    }
}

}  // namespace lmd::cpu::avx2
