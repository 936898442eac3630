// AVX-512 kernels of the packed matmuls (gemm.h): the float, W4A16 and W8A16 panels (the W4A8
// panels with VNNI: gemm_w4a8_avx512.cc; their shared tile: gemm_tile_avx512.h). Each gives the AVX2 kernel's and the reference's bits: a panel's 16
// columns are one zmm register, each lane one output's chains in gemm.h's order, so only the
// width of the tiles differs (and no tile shape changes a bit). What the wider registers buy:
// half the instructions per weight (the W4 kernels convert or multiply 16 columns at a time),
// twice the FMA width where the core has 512-bit units (Intel), and VPDPBUSD, one instruction
// for the multiply-add chain AVX2's W4A8 takes three for.
//
// Three paths: M <= 5 (a decode row or a verification step) runs tiles of several panels with the
// weights converted in registers; M >= 6 (W4A16: 5; a decode batch, a prefill chunk) runs tiles of up
// to 16 rows by one panel (batch_tiles) over x interleaved once by gemm.cc, each weight converted in registers
// once for all the tile's rows (16 FMAs a weight vector hide the convert and the loads: near the
// core's FMA rate); beyond 4 MiB of x (rows_interleaved), the GEMM, its chunks of a panel converted
// into a buffer once for every tile of a block of rows kept in L2 (gemm_blocks.h).
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

}  // namespace lmd::cpu::avx512

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

#include "cpu/gemm_tile_avx512.h"

namespace lmd::cpu::avx512 {

// M x K floats of x at most that are interleaved for batch_tiles (4 MiB, well inside L3, which they are
// read from once per block of panels): the rest of larger matmuls take the GEMM, whose blocks of rows stay
// in L2. At SmolLM2's shapes the tiles beat the GEMM at every M (2 threads, M = 512: float16 184-191 ->
// 206-208 GFLOP/s over a layer, W4A16 168-169 -> 176-181; M = 16: 103-115 -> 112-165, 124-132 -> 166-182).
bool rows_interleaved(int64_t M, int64_t K, int64_t min_rows) { return M >= min_rows && M * K <= (int64_t{1} << 20); }

namespace {

// ---- float panels ----------------------------------------------------------------------------------

// A matmul of M >= 6 rows over the panels [p0, p1) in row_tiles(M) tiles (interleave_rows): tile(xt, m,
// p, rows) runs the tile of `rows` rows from m over panel p, xt its rows interleaved. Each weight is
// read once per tile and turned into floats in registers once for all its rows; the panels go in
// blocks of about kPanelBlockBytes of weights (panel_bytes each), every tile passing over a block
// while it stays in L2.
constexpr int64_t kPanelBlockBytes = 384 << 10;

template <typename Tile>
void batch_tiles(const float * xt, int64_t M, int64_t K, int64_t panel_bytes, int64_t p0, int64_t p1, Tile && tile) {
    const int64_t nt = row_tiles(M);
    const int64_t pb = std::max<int64_t>(1, kPanelBlockBytes / panel_bytes);
    for (int64_t b0 = p0; b0 < p1; b0 += pb) {
        const int64_t b1 = std::min(p1, b0 + pb);
        for (int64_t i = 0; i < nt; ++i) {
            const int64_t m = tile_row(M, i), mr = tile_row(M, i + 1) - m;
            auto run = [&](auto rows) {
                for (int64_t p = b0; p < b1; ++p) tile(xt + m * K, m, p, rows);
            };
            switch (mr) {
                case 5: run(std::integral_constant<int, 5>()); break;
                case 6: run(std::integral_constant<int, 6>()); break;
                case 7: run(std::integral_constant<int, 7>()); break;
                case 8: run(std::integral_constant<int, 8>()); break;
                case 9: run(std::integral_constant<int, 9>()); break;
                case 10: run(std::integral_constant<int, 10>()); break;
                case 11: run(std::integral_constant<int, 11>()); break;
                case 12: run(std::integral_constant<int, 12>()); break;
                case 13: run(std::integral_constant<int, 13>()); break;
                case 14: run(std::integral_constant<int, 14>()); break;
                case 15: run(std::integral_constant<int, 15>()); break;
                default: run(std::integral_constant<int, 16>()); break;
            }
        }
    }
}

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
    if (rows_interleaved(M, K)) {
        const int64_t panel_bytes = K * kW * sizeof(WT);
        batch_tiles(x, M, K, panel_bytes, p0, p1, [&](const float * xt, int64_t m, int64_t p, auto rows) {
            constexpr int MR = decltype(rows)::value;
            Acc<MR, 1> acc = acc_zero<MR, 1>();
            const WT * wp = w + p * K * kW;
#pragma GCC unroll 4
            for (int64_t k = 0; k < K; ++k) {
                const __m512 wv = load16(wp + k * kW);
                for (int m = 0; m < MR; ++m) acc.v[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(xt[k * MR + m]), wv, acc.v[m][0]);
            }
            tile_store<MR, 1>(acc, bias ? bias + p * kW : nullptr, std::min<int64_t>(kW, N - p * kW), y + m * ldy + p * kW,
                              ldy);
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

    // Words ahead that tile and tile_batch ask for (a prefetch past the panel's end is harmless).
    static constexpr int64_t kPrefetchWords = 16;

    // An M <= 5 tile over NP panels from p, all of K, the words converted in registers, into out.
    template <int MR, int NP>
    void tile(int64_t p, Acc<MR, NP> & out) const {
        const int64_t K = this->K, G = this->G;
        const int32_t * wb[NP];
        for (int i = 0; i < NP; ++i) wb[i] = this->words(p + i);
        // U (the mins' chain) in the group loop for one row, after it for more: there its MR x NP
        // registers would crowd out D's and T's (at 3 rows by 4 panels, 40 zmm of 32); same chain, same bits
        constexpr bool kMinsInLoop = MR == 1;
        Acc<MR, NP> t = acc_zero<MR, NP>(), u = acc_zero<MR, NP>();
        for (int64_t g = 0; g < this->ng; ++g) {
            Acc<MR, NP> d = acc_zero<MR, NP>();
            // the scales (and the mins, where this loop reads them) two groups ahead: the tile's
            // panels take one line of each, or two
            _mm_prefetch(reinterpret_cast<const char *>(this->scales(p) + (g + 2) * kW4), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char *>(this->scales(p + NP - 1) + (g + 2) * kW4), _MM_HINT_T0);
            if constexpr (kMinsInLoop) {
                _mm_prefetch(reinterpret_cast<const char *>(this->mins(p) + (g + 2) * kW4), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char *>(this->mins(p + NP - 1) + (g + 2) * kW4), _MM_HINT_T0);
            }
            for (int64_t c = g * G / 8; c < (g + 1) * G / 8; ++c) {
                // each of a GEMV's many short runs of panels is a new stream to the hardware
                // prefetchers, which miss its first lines (120 matmuls of a decode step: -14%)
                for (int i = 0; i < NP; ++i)
                    _mm_prefetch(reinterpret_cast<const char *>(wb[i] + (c + kPrefetchWords) * kW4), _MM_HINT_T0);
                const float * xc = xp + 8 * c;
                __m512i mask = _mm512_set1_epi32(0xF);
                __m512 w[NP];
#pragma GCC unroll 7  // unrolled: float32 scale panels ran 1.4x slower at 1 row in a loop
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
                const __m512 sv = load16(this->scales(p + i) + g * kW4);
                for (int m = 0; m < MR; ++m) {
                    t.v[m][i] = _mm512_fmadd_ps(sv, d.v[m][i], t.v[m][i]);
                    if constexpr (kMinsInLoop) {
                        const __m512 mv = load16(this->mins(p + i) + g * kW4);
                        u.v[m][i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(this->xsum[m * this->ng + g]), u.v[m][i]);
                    }
                }
            }
        }
        if constexpr (!kMinsInLoop) this->template mins_sum<MR, NP>(0, p, u);
        for (int m = 0; m < MR; ++m)
            for (int i = 0; i < NP; ++i) out.v[m][i] = _mm512_add_ps(t.v[m][i], u.v[m][i]);
    }

    // A decode batch's tile (batch_tiles): MR rows over panel p, all of K, each word converted in
    // registers once for all MR rows (the GEMM's chunk would store and reload every weight for
    // them); xt: the rows' xp interleaved [K, MR]; D in registers, T per group in part [MR, 16].
    template <int MR, typename YT>
    void tile_batch(const float * xt, int64_t m0, int64_t p, const float * bias, int64_t cols, YT * y,
                    int64_t ldy) const {
        const int64_t G = this->G;
        const int32_t * wb = this->words(p);
        alignas(64) float part[MR * kW];
        for (int64_t g = 0; g < this->ng; ++g) {
            Acc<MR, 1> d = acc_zero<MR, 1>();
            for (int64_t c = g * G / 8; c < (g + 1) * G / 8; ++c) {
                // a panel's words are one line in four of its 64-wide panel's stream, a stride the
                // hardware prefetchers do not follow: without this, each line costs a trip to memory
                _mm_prefetch(reinterpret_cast<const char *>(wb + (c + kPrefetchWords) * kW4), _MM_HINT_T0);
                const __m512i v = load_words(wb + c * kW4);
                const float * xc = xt + 8 * c * MR;
                __m512i mask = _mm512_set1_epi32(0xF);
#pragma GCC unroll 7
                for (int j = 0; j < 7; ++j) {
                    const __m512 w = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
                    for (int m = 0; m < MR; ++m) d.v[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(xc[j * MR + m]), w, d.v[m][0]);
                    mask = _mm512_slli_epi32(mask, 4);
                }
                const __m512 w = nibble<7>(v);
                for (int m = 0; m < MR; ++m) d.v[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(xc[7 * MR + m]), w, d.v[m][0]);
            }
            const __m512 sv = load16(this->scales(p) + g * kW4);
            for (int m = 0; m < MR; ++m) {
                const __m512 t = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(part + m * kW);
                _mm512_store_ps(part + m * kW, _mm512_fmadd_ps(sv, d.v[m][0], t));
            }
        }
        Acc<MR, 1> u;
        this->template mins_sum<MR, 1>(m0, p, u);
        for (int m = 0; m < MR; ++m) u.v[m][0] = _mm512_add_ps(_mm512_load_ps(part + m * kW), u.v[m][0]);
        tile_store<MR, 1>(u, bias, cols, y, ldy);
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

// NP of the W4A16 tiles of M <= 5 rows: small_np, but 4 at M = 1 with float16 scales, whose converts
// would take registers the 8-panel GEMV (24 accumulators and 8 weight vectors) does not have.
template <typename ST>
constexpr int w4_np(int mr) { return std::is_same_v<ST, f16> && mr == 1 ? 4 : small_np(mr); }

template <typename ST, typename YT>
void w4a16_panels(const W4A16<ST> & a, int64_t M, int64_t N, const float * bias, YT * y, int64_t ldy, int64_t p0,
                  int64_t p1) {
    if (M < kW4a16BatchRows) {
        small_m(M, [&](auto mr) {
            constexpr int MR = decltype(mr)::value;
            panels_small<MR, w4_np<ST>(MR)>(
                [&](int64_t p, auto & out) { a.template tile<MR, sizeof(out.v[0]) / sizeof(__m512)>(p, out); }, N, bias,
                y, ldy, p0, p1);
        });
        return;
    }
    if (rows_interleaved(M, a.K, kW4a16BatchRows)) {
        const int64_t panel_bytes = a.K / 2 * kW + 2 * a.ng * kW * sizeof(ST);  // words, scales and mins
        batch_tiles(a.xp, M, a.K, panel_bytes, p0, p1, [&](const float * xt, int64_t m, int64_t p, auto rows) {
            a.template tile_batch<decltype(rows)::value>(xt, m, p, bias ? bias + p * kW : nullptr,
                                                         std::min<int64_t>(kW, N - p * kW), y + m * ldy + p * kW, ldy);
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

    // A decode batch's tile (batch_tiles) over xt [K, MR], as W4A16::tile_batch.
    template <int MR, typename YT>
    void tile_batch(const float * xt, int64_t p, const float * bias, int64_t cols, YT * y, int64_t ldy) const {
        const int8_t * wp = panel(p);
        alignas(64) float part[MR * kW];
        for (int64_t g = 0; g < ng; ++g) {
            Acc<MR, 1> d = acc_zero<MR, 1>();
#pragma GCC unroll 4
            for (int64_t k = g * G; k < (g + 1) * G; ++k) {
                const __m512 w = widen_q(wp + k * kW);
                for (int m = 0; m < MR; ++m) d.v[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(xt[k * MR + m]), w, d.v[m][0]);
            }
            const __m512 sv = load16(scales(p) + g * kW);
            for (int m = 0; m < MR; ++m) {
                const __m512 t = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(part + m * kW);
                _mm512_store_ps(part + m * kW, _mm512_fmadd_ps(sv, d.v[m][0], t));
            }
        }
        Acc<MR, 1> acc;
        for (int m = 0; m < MR; ++m) acc.v[m][0] = _mm512_load_ps(part + m * kW);
        tile_store<MR, 1>(acc, bias, cols, y, ldy);
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
    if (rows_interleaved(M, a.K)) {
        const int64_t panel_bytes = a.K * kW + a.ng * kW * sizeof(ST);
        batch_tiles(x, M, a.K, panel_bytes, p0, p1, [&](const float * xt, int64_t m, int64_t p, auto rows) {
            a.template tile_batch<decltype(rows)::value>(xt, p, bias ? bias + p * kW : nullptr,
                                                         std::min<int64_t>(kW, N - p * kW), y + m * ldy + p * kW, ldy);
        });
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

#undef LMD_AVX512_INLINE

}  // namespace lmd::cpu::avx512

#pragma GCC pop_options
