// AVX-512 kernels of the packed matmuls (gemm.h): the float, W4A16 and W8A16 panels and, with
// VNNI, the W4A8 panels. Each gives the AVX2 kernel's and the reference's bits: a panel's 16
// columns are one zmm register, each lane one output's chains in gemm.h's order, so only the
// width of the tiles differs (and no tile shape changes a bit). What the wider registers buy:
// half the instructions per weight (the W4 kernels convert or multiply 16 columns at a time),
// twice the FMA width where the core has 512-bit units (Intel), and VPDPBUSD, one instruction
// for the multiply-add chain AVX2's W4A8 takes three for.
//
// This file is compiled for AVX-512 by the target pragma below, after every header: the
// standard library's templates it instantiates stay baseline code, as one translation unit's
// copy of them serves the whole library (a CPU with AVX2 only must be able to run it).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/gemm_blocks.h"

#include <immintrin.h>

namespace lmd::cpu::avx512 {

namespace {

// Scratch for the GEMMs' converted chunks, outside the pragma: baseline code.
float * scratch(int64_t n) {
    static thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    return buf.data();
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

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

// ---- float panels ----------------------------------------------------------------------------------

template <typename WT, typename BT, typename YT>
void float_panels(const float * x, int64_t ldx, int64_t M, const WT * w, int64_t K, const BT * bias, YT * y,
                  int64_t N, int64_t ldy, int64_t p0, int64_t p1) {
    if (M <= 5) {
        small_m(M, [&](auto mr) {
            constexpr int MR = decltype(mr)::value;
            panels_small<MR, small_np(MR)>(
                [&](int64_t p, auto & out) {
                    constexpr int NP = sizeof(out.v[0]) / sizeof(__m512);
                    Acc<MR, NP> acc = acc_zero<MR, NP>();
                    const WT * wp = w + p * K * kW;
#pragma GCC unroll 2
                    for (int64_t k = 0; k < K; ++k) {
                        __m512 wv[NP];
                        for (int i = 0; i < NP; ++i) wv[i] = load16(wp + i * K * kW + k * kW);
                        for (int m = 0; m < MR; ++m) {
                            const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
                            for (int i = 0; i < NP; ++i) acc.v[m][i] = _mm512_fmadd_ps(xb, wv[i], acc.v[m][i]);
                        }
                    }
                    out = acc;
                },
                N, bias, y, ldy, p0, p1);
        });
        return;
    }
    float * buf = scratch(kKC * kW);
    const float * chunk = nullptr;
    gemm_blocks<kMR>(
        M, K, kKC, p0, p1,
        [&](int64_t p, int64_t k0, int64_t kc) {  // panel p's chunk as float32 [kc, 16]: in place, or widened
            const WT * src = w + (p * K + k0) * kW;
            if constexpr (std::is_same<WT, float>::value) {
                chunk = src;
            } else {
                for (int64_t i = 0; i < kc * kW; i += kW) _mm512_storeu_ps(buf + i, load16(src + i));
                chunk = buf;
            }
        },
        [&](int64_t m, int mr, int64_t p, int64_t k0, int64_t kc, float * part) {
            tile_rows(mr, [&](auto rows) {
                constexpr int MR = decltype(rows)::value;
                Acc<MR, 1> acc;
                for (int r = 0; r < MR; ++r) acc.v[r][0] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * kW);
                tile_steps<MR>(x + m * ldx + k0, ldx, chunk, kc, acc);
                if (k0 + kc == K) {
                    tile_store<MR, 1>(acc, bias ? bias + p * kW : nullptr, std::min<int64_t>(kW, N - p * kW),
                                      y + m * ldy + p * kW, ldy);
                } else {
                    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(part + r * kW, acc.v[r][0]);
                }
            });
        });
}

template <typename WT, typename BT>
void float_panels_y(const float * x, int64_t ldx, int64_t M, const TensorView & packed, const BT * bias,
                    const TensorView & y, int64_t p0, int64_t p1) {
    const WT * w = packed.ptr<WT>();
    const int64_t K = packed.size(1), N = y.size(1), ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: float_panels(x, ldx, M, w, K, bias, y.ptr<float>(), N, ldy, p0, p1); break;
        case DType::bf16: float_panels(x, ldx, M, w, K, bias, y.ptr<bf16>(), N, ldy, p0, p1); break;
        case DType::f16: float_panels(x, ldx, M, w, K, bias, y.ptr<f16>(), N, ldy, p0, p1); break;
        default: break;
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

// qp of nibble J of each word: q 2^(4 J) by an AND in place (J < 7); nibble 7 shifted down, as
// masking it in place would set the sign bit.
template <int J>
__attribute__((always_inline)) inline __m512 nibble(__m512i v) {
    if constexpr (J < 7) return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF << (4 * J))));
    return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 28));
}

// W4A16 over the prepared rows xp [M, K] (x 2^(-4 j), gemm.h).
template <typename ST>
struct W4A16 : W4Panels<ST> {
    const float * xp;

    // An M <= 5 tile over NP panels from p, all of K, the words converted in registers, into out.
    template <int MR, int NP>
    void tile(int64_t p, Acc<MR, NP> & out) const {
        const int64_t K = this->K, G = this->G;
        const int32_t * wb[NP];
        for (int i = 0; i < NP; ++i) wb[i] = this->words(p + i);
        Acc<MR, NP> t = acc_zero<MR, NP>(), u = acc_zero<MR, NP>();
        for (int64_t g = 0; g < this->ng; ++g) {
            Acc<MR, NP> d = acc_zero<MR, NP>();
            for (int64_t c = g * G / 8; c < (g + 1) * G / 8; ++c) {
                const float * xc = xp + 8 * c;
                __m512i mask = _mm512_set1_epi32(0xF);
                __m512 w[NP];
#pragma GCC unroll 1
                for (int j = 0; j < 7; ++j) {
                    for (int i = 0; i < NP; ++i) w[i] = _mm512_cvtepi32_ps(_mm512_and_si512(load_words(wb[i] + c * kW4), mask));
                    for (int m = 0; m < MR; ++m) {
                        const __m512 xb = _mm512_set1_ps(xc[m * K + j]);
                        for (int i = 0; i < NP; ++i) d.v[m][i] = _mm512_fmadd_ps(xb, w[i], d.v[m][i]);
                    }
                    mask = _mm512_slli_epi32(mask, 4);
                }
                for (int i = 0; i < NP; ++i) w[i] = nibble<7>(load_words(wb[i] + c * kW4));
                for (int m = 0; m < MR; ++m) {
                    const __m512 xb = _mm512_set1_ps(xc[m * K + 7]);
                    for (int i = 0; i < NP; ++i) d.v[m][i] = _mm512_fmadd_ps(xb, w[i], d.v[m][i]);
                }
            }
            for (int i = 0; i < NP; ++i) {
                const __m512 sv = load16(this->scales(p + i) + g * kW4), mv = load16(this->mins(p + i) + g * kW4);
                for (int m = 0; m < MR; ++m) {
                    t.v[m][i] = _mm512_fmadd_ps(sv, d.v[m][i], t.v[m][i]);
                    u.v[m][i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(this->xsum[m * this->ng + g]), u.v[m][i]);
                }
            }
        }
        for (int m = 0; m < MR; ++m)
            for (int i = 0; i < NP; ++i) out.v[m][i] = _mm512_add_ps(t.v[m][i], u.v[m][i]);
    }

    // qp of panel p, k in [k0, k0 + kc) (multiples of 8), into buf [kc, 16].
    void chunk(int64_t p, int64_t k0, int64_t kc, float * buf) const {
        const int32_t * wp = this->words(p);
        for (int64_t c = k0 / 8; c < (k0 + kc) / 8; ++c) {
            const __m512i v = load_words(wp + c * kW4);
            float * out = buf + (c * 8 - k0) * kW;
            _mm512_storeu_ps(out + 0 * kW, nibble<0>(v));
            _mm512_storeu_ps(out + 1 * kW, nibble<1>(v));
            _mm512_storeu_ps(out + 2 * kW, nibble<2>(v));
            _mm512_storeu_ps(out + 3 * kW, nibble<3>(v));
            _mm512_storeu_ps(out + 4 * kW, nibble<4>(v));
            _mm512_storeu_ps(out + 5 * kW, nibble<5>(v));
            _mm512_storeu_ps(out + 6 * kW, nibble<6>(v));
            _mm512_storeu_ps(out + 7 * kW, nibble<7>(v));
        }
    }

    // The groups of a chunk for one MR-row tile of the GEMM: D over each group in registers,
    // T in part [MR, 16] folded in after each; after the last group of all, y = T + U (+ bias).
    template <int MR, typename YT>
    void tile_chunk(int64_t m0, int64_t p, int64_t k0, int64_t kc, const float * buf, float * part, const float * bias,
                    int64_t cols, YT * y, int64_t ldy) const {
        const int64_t K = this->K, G = this->G;
        for (int64_t kg = k0; kg < k0 + kc; kg += G) {
            Acc<MR, 1> d = acc_zero<MR, 1>();
            tile_steps<MR>(xp + m0 * K + kg, K, buf + (kg - k0) * kW, G, d);
            const __m512 sv = load16(this->scales(p) + kg / G * kW4);
            for (int m = 0; m < MR; ++m) {
                const __m512 t = kg == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + m * kW);
                _mm512_storeu_ps(part + m * kW, _mm512_fmadd_ps(sv, d.v[m][0], t));
            }
        }
        if (k0 + kc == K) {
            Acc<MR, 1> y_acc;
            this->template mins_sum<MR, 1>(m0, p, y_acc);
            for (int m = 0; m < MR; ++m) y_acc.v[m][0] = _mm512_add_ps(_mm512_loadu_ps(part + m * kW), y_acc.v[m][0]);
            tile_store<MR, 1>(y_acc, bias, cols, y, ldy);
        }
    }
};

// The GEMM of a quantized panel layout A (M >= 6, gemm_blocks): a.chunk(p, k0, kc, buf) converts a
// chunk of panel p (whole groups) into buf, a.tile_chunk<MR>(m, p, k0, kc, buf, part, ...) runs rows
// m.. over it.
template <typename A, typename YT>
void quant_gemm(const A & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0, int64_t p1) {
    const int64_t kcs = std::max<int64_t>(1, kKC / a.G) * a.G;
    float * buf = scratch(kcs * kW);
    gemm_blocks<kMR>(M, a.K, kcs, p0, p1, [&](int64_t p, int64_t k0, int64_t kc) { a.chunk(p, k0, kc, buf); },
                     [&](int64_t m, int mr, int64_t p, int64_t k0, int64_t kc, float * part) {
                         tile_rows(mr, [&](auto rows) {
                             a.template tile_chunk<decltype(rows)::value>(
                                 m, p, k0, kc, buf, part, bias ? bias + p * kW : nullptr,
                                 std::min<int64_t>(kW, N - p * kW), y + m * ldy + p * kW, ldy);
                         });
                     });
}

template <typename ST, typename YT>
void w4a16_panels(const W4A16<ST> & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0,
                  int64_t p1) {
    if (M <= 5) {
        small_m(M, [&](auto mr) {
            constexpr int MR = decltype(mr)::value;
            panels_small<MR, small_np(MR)>(
                [&](int64_t p, auto & out) { a.template tile<MR, sizeof(out.v[0]) / sizeof(__m512)>(p, out); }, N, bias,
                y, ldy, p0, p1);
        });
        return;
    }
    quant_gemm(a, M, N, bias, y, ldy, p0, p1);
}

template <typename ST>
void w4a16_typed(const float * xp, const float * xsum, int64_t M, const TensorView & qpanels, const TensorView & spanels,
                 const TensorView & mpanels, const float * bias, const TensorView & y, int64_t p0, int64_t p1) {
    const int64_t K = qpanels.size(1) * 8, ng = spanels.size(1);
    const W4A16<ST> a{{qpanels.ptr<int32_t>(), spanels.ptr<ST>(), mpanels.ptr<ST>(), K, K / ng, ng, xsum}, xp};
    const int64_t N = y.size(1), ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: w4a16_panels(a, M, N, bias, y.ptr<float>(), ldy, p0, p1); break;
        case DType::bf16: w4a16_panels(a, M, N, bias, y.ptr<bf16>(), ldy, p0, p1); break;
        case DType::f16: w4a16_panels(a, M, N, bias, y.ptr<f16>(), ldy, p0, p1); break;
        default: break;
    }
}

// ---- W8A16 panels ----------------------------------------------------------------------------------

// The 16 weights of a panel's k-row as floats (exact).
LMD_AVX512_INLINE __m512 widen_q(const int8_t * p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
}

// qpanels int8 [P, K, 16], spanels ST [P, K / G, 16] (gemm.h's W8A16 panels).
template <typename ST>
struct W8Panels {
    const int8_t * q;
    const ST * s;
    int64_t K, G, ng;

    const int8_t * panel(int64_t p) const { return q + p * K * kW; }  // + k kW
    const ST * scales(int64_t p) const { return s + p * ng * kW; }     // + g kW

    template <int MR, int NP>
    void tile(const float * x, int64_t ldx, int64_t p, Acc<MR, NP> & out) const {
        Acc<MR, NP> t = acc_zero<MR, NP>();
        for (int64_t g = 0; g < ng; ++g) {
            Acc<MR, NP> d = acc_zero<MR, NP>();
            for (int64_t k = g * G; k < (g + 1) * G; ++k) {
                __m512 w[NP];
                for (int i = 0; i < NP; ++i) w[i] = widen_q(panel(p + i) + k * kW);
                for (int m = 0; m < MR; ++m) {
                    const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
                    for (int i = 0; i < NP; ++i) d.v[m][i] = _mm512_fmadd_ps(xb, w[i], d.v[m][i]);
                }
            }
            for (int i = 0; i < NP; ++i) {
                const __m512 sv = load16(scales(p + i) + g * kW);
                for (int m = 0; m < MR; ++m) t.v[m][i] = _mm512_fmadd_ps(sv, d.v[m][i], t.v[m][i]);
            }
        }
        out = t;
    }

    void chunk(int64_t p, int64_t k0, int64_t kc, float * buf) const {
        for (int64_t k = k0; k < k0 + kc; ++k) _mm512_storeu_ps(buf + (k - k0) * kW, widen_q(panel(p) + k * kW));
    }

};

// W8A16 over the rows x (stride ldx): the GEMM's tiles.
template <typename ST>
struct W8A16 : W8Panels<ST> {
    const float * x;
    int64_t ldx;

    // One MR-row tile from row m0 over a chunk: D per group from the buffer, T in part; y = T (+ bias).
    template <int MR, typename YT>
    void tile_chunk(int64_t m0, int64_t p, int64_t k0, int64_t kc, const float * buf, float * part,
                    const float * bias, int64_t cols, YT * y, int64_t ldy) const {
        const int64_t G = this->G;
        for (int64_t kg = k0; kg < k0 + kc; kg += G) {
            Acc<MR, 1> d = acc_zero<MR, 1>();
            tile_steps<MR>(x + m0 * ldx + kg, ldx, buf + (kg - k0) * kW, G, d);
            const __m512 sv = load16(this->scales(p) + kg / G * kW);
            for (int m = 0; m < MR; ++m) {
                const __m512 t = kg == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + m * kW);
                _mm512_storeu_ps(part + m * kW, _mm512_fmadd_ps(sv, d.v[m][0], t));
            }
        }
        if (k0 + kc == this->K) {
            Acc<MR, 1> acc;
            for (int m = 0; m < MR; ++m) acc.v[m][0] = _mm512_loadu_ps(part + m * kW);
            tile_store<MR, 1>(acc, bias, cols, y, ldy);
        }
    }
};

// NP of the W8A16 tiles of M <= 5 rows: one panel (a zmm) a row but for the GEMV, whose eight
// panels keep eight chains going.
constexpr int w8_np(int mr) { return mr == 1 ? 8 : 1; }

template <typename ST, typename YT>
void w8a16_panels(const W8Panels<ST> & a, const float * x, int64_t ldx, int64_t M, int64_t N, const float * bias, YT * y,
                  int64_t ldy, int64_t p0, int64_t p1) {
    if (M > 5 && M <= 40) {  // a decode step's batch: per panel, its rows in tiles of five (as the AVX2 kernel)
        for (int64_t p = p0; p < p1; ++p) {
            const float * b = bias ? bias + p * kW : nullptr;
            const int64_t cols = std::min<int64_t>(kW, N - p * kW);
            for (int64_t m = 0; m < M; m += 5) {
                small_m(std::min<int64_t>(5, M - m), [&](auto mr) {
                    constexpr int MR = decltype(mr)::value;
                    Acc<MR, 1> acc;
                    a.template tile<MR, 1>(x + m * ldx, ldx, p, acc);
                    tile_store<MR, 1>(acc, b, cols, y + m * ldy + p * kW, ldy);
                });
            }
        }
        return;
    }
    if (M <= 5) {
        small_m(M, [&](auto mr) {
            constexpr int MR = decltype(mr)::value;
            panels_small<MR, w8_np(MR)>(
                [&](int64_t p, auto & out) { a.template tile<MR, sizeof(out.v[0]) / sizeof(__m512)>(x, ldx, p, out); },
                N, bias, y, ldy, p0, p1);
        });
        return;
    }
    quant_gemm(W8A16<ST>{a, x, ldx}, M, N, bias, y, ldy, p0, p1);
}

template <typename ST>
void w8a16_typed(const float * x, int64_t ldx, int64_t M, const TensorView & qpanels, const TensorView & spanels,
                 const float * bias, const TensorView & y, int64_t p0, int64_t p1) {
    const int64_t K = qpanels.size(1), ng = spanels.size(1);
    const W8Panels<ST> a{qpanels.ptr<int8_t>(), spanels.ptr<ST>(), K, K / ng, ng};
    const int64_t N = y.size(1), ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: w8a16_panels(a, x, ldx, M, N, bias, y.ptr<float>(), ldy, p0, p1); break;
        case DType::bf16: w8a16_panels(a, x, ldx, M, N, bias, y.ptr<bf16>(), ldy, p0, p1); break;
        case DType::f16: w8a16_panels(a, x, ldx, M, N, bias, y.ptr<f16>(), ldy, p0, p1); break;
        default: break;
    }
}

}  // namespace

void linear_packed_panels(const float * x, int64_t ldx, int64_t M, const TensorView & packed,
                          const TensorView * bias, const TensorView & y, int64_t p0, int64_t p1) {
    switch (packed.dtype) {
        case DType::f32: float_panels_y<float>(x, ldx, M, packed, bias ? bias->ptr<float>() : nullptr, y, p0, p1); break;
        case DType::bf16: float_panels_y<bf16>(x, ldx, M, packed, bias ? bias->ptr<bf16>() : nullptr, y, p0, p1); break;
        case DType::f16: float_panels_y<f16>(x, ldx, M, packed, bias ? bias->ptr<f16>() : nullptr, y, p0, p1); break;
        default: break;
    }
}

void linear_w4a16_packed_panels(const float * xp, const float * xsum, int64_t M, const TensorView & qpanels,
                                const TensorView & spanels, const TensorView & mpanels, const TensorView * bias,
                                const TensorView & y, int64_t p0, int64_t p1) {
    const float * b = bias ? bias->ptr<float>() : nullptr;
    if (spanels.dtype == DType::f16) {
        w4a16_typed<f16>(xp, xsum, M, qpanels, spanels, mpanels, b, y, p0, p1);
    } else {
        w4a16_typed<float>(xp, xsum, M, qpanels, spanels, mpanels, b, y, p0, p1);
    }
}

void linear_w8a16_packed_panels(const float * x, int64_t ldx, int64_t M, const TensorView & qpanels,
                                const TensorView & spanels, const TensorView * bias, const TensorView & y, int64_t p0,
                                int64_t p1) {
    const float * b = bias ? bias->ptr<float>() : nullptr;
    if (spanels.dtype == DType::f16) {
        w8a16_typed<f16>(x, ldx, M, qpanels, spanels, b, y, p0, p1);
    } else {
        w8a16_typed<float>(x, ldx, M, qpanels, spanels, b, y, p0, p1);
    }
}

// ---- W4A8 with VNNI --------------------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512vnni")

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

#pragma GCC pop_options  // avx512vnni

#undef LMD_AVX512_INLINE

#pragma GCC pop_options  // avx512

}  // namespace lmd::cpu::avx512
