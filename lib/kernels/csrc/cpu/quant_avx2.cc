// AVX2/FMA/F16C versions of the quantized matmuls (compiled with those flags; quant.cc
// calls them only when the CPU has all three).
#include <immintrin.h>

#include <cmath>

#include "cpu/quant.h"
#include "cpu/simd_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// sum a[i] * b[i], i < n, in one fixed order (eight lanes, then the tail).
inline float dot(const float * a, const float * b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

// ---- W4A16 -------------------------------------------------------------------------------------

template <typename XT>
void prepare_row_t(const XT * x, int64_t K, int64_t G, float * xp, float * xsum) {
    const int64_t K64 = (K + 63) / 64 * 64;
    for (int64_t c = 0; c < K64; c += 64) {
        for (int j = 0; j < 8; ++j) {
            const float f = j < 7 ? std::ldexp(1.f, -4 * j) : 1.f;
            for (int d = 0; d < 8; ++d) {
                const int64_t k = c + 8 * d + j;
                xp[c + 8 * j + d] = k < K ? to_f32(x[k]) * f : 0.f;
            }
        }
    }
    for (int64_t g = 0; g < K / G; ++g) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 8) acc = _mm256_add_ps(acc, load8(x + k));
        xsum[g] = hsum(acc);
    }
}

// The eight lanes' scales for the 64-wide chunk at k0: one group, or two for G = 32
// (lanes 0-3 are k0..k0+31, lanes 4-7 k0+32..k0+63). `half`: only lanes 0-3 hold weights.
inline __m256 chunk_scales(const float * s, int64_t k0, int64_t G, bool half) {
    const int64_t g0 = k0 / G, g1 = (k0 + 32) / G;
    if (half || g0 == g1) return _mm256_broadcast_ss(s + g0);
    const __m128 pair = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(s + g0)));  // g1 = g0 + 1
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// total[m][r] += scale * dot(q, x) over one 64-wide chunk: nibble j of each 32-bit word is
// masked in place (q * 2^(4 j), exact as float) against xp's matching lanes, pre-scaled by
// 2^(-4 j); nibble 7 is shifted down instead, as masking it would set the sign bit. Even
// and odd j sum in two chains (the FMA latency), added before the scale.
template <int MR, int NR>
inline void w4a16_chunk(const __m256i * v, const __m256 * sv, const float * xc, int64_t ldxp,
                        __m256 (&total)[MR][NR]) {
    __m256 acc[2][MR][NR];
    for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            const __m256i qj = j < 7 ? _mm256_and_si256(v[r], _mm256_set1_epi32(0xF << (4 * j)))
                                     : _mm256_srli_epi32(v[r], 28);
            const __m256 w = _mm256_cvtepi32_ps(qj);
            for (int m = 0; m < MR; ++m) {
                const __m256 xv = _mm256_loadu_ps(xc + m * ldxp + 8 * j);
                __m256 & a = acc[j & 1][m][r];
                a = j < 2 ? _mm256_mul_ps(xv, w) : _mm256_fmadd_ps(xv, w, a);
            }
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r)
            total[m][r] = _mm256_fmadd_ps(_mm256_add_ps(acc[0][m][r], acc[1][m][r]), sv[r], total[m][r]);
}

// An MR x NR tile of y: rows m of xp against rows r of the weights.
template <int MR, int NR, typename YT>
void w4a16_tile(const W4A16Activations & a, int64_t m0, const uint8_t * q, const float * s, const float * mn,
                const float * bias, YT * y, int64_t ldy) {
    const int64_t K = a.K, G = a.group_size, ng = K / G, ldq = K / 2;
    const float * xp = a.xp + m0 * a.K64;
    __m256 total[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) total[m][r] = _mm256_setzero_ps();
    __m256i v[NR];
    __m256 sv[NR];
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        for (int r = 0; r < NR; ++r) {
            v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q + r * ldq + k / 2));
            sv[r] = chunk_scales(s + r * ng, k, G, false);
        }
        w4a16_chunk<MR, NR>(v, sv, xp + k, a.K64, total);
    }
    if (k < K) {  // 32 weights left: the upper lanes see zero weights and zero activations
        for (int r = 0; r < NR; ++r) {
            v[r] = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q + r * ldq + k / 2)));
            sv[r] = chunk_scales(s + r * ng, k, G, true);
        }
        w4a16_chunk<MR, NR>(v, sv, xp + k, a.K64, total);
    }
    for (int m = 0; m < MR; ++m) {
        const float * xs = a.xsum + (m0 + m) * ng;
        for (int r = 0; r < NR; ++r) {
            float acc = hsum(total[m][r]) + dot(mn + r * ng, xs, ng);
            if (bias) acc += bias[r];
            store1(y + m * ldy + r, acc);
        }
    }
}

template <int NR, typename YT>
inline void w4a16_tile_m(int mr, const W4A16Activations & a, int64_t m0, const uint8_t * q, const float * s,
                         const float * mn, const float * bias, YT * y, int64_t ldy) {
    switch (mr) {
        case 2: w4a16_tile<2, NR>(a, m0, q, s, mn, bias, y, ldy); break;
        default: w4a16_tile<1, NR>(a, m0, q, s, mn, bias, y, ldy); break;
    }
}

template <typename YT>
void w4a16_rows_t(const W4A16Activations & a, const uint8_t * q, const float * s, const float * mn,
                  const float * bias, YT * y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t ldq = a.K / 2, ng = a.K / a.group_size;
    auto at = [&](const float * p, int64_t n) { return p ? p + n : nullptr; };
    if (a.M == 1) {  // GEMV: bound by reading the weights; four rows keep four streams in flight
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) {
            if (n + 8 <= n1) {
                prefetch_range(q + (n + 4) * ldq, 4 * ldq);
                prefetch_range(s + (n + 4) * ng, 4 * ng * 4);
                prefetch_range(mn + (n + 4) * ng, 4 * ng * 4);
            }
            w4a16_tile<1, 4>(a, 0, q + n * ldq, s + n * ng, mn + n * ng, at(bias, n), y + n, ldy);
        }
        for (; n < n1; ++n) w4a16_tile<1, 1>(a, 0, q + n * ldq, s + n * ng, mn + n * ng, at(bias, n), y + n, ldy);
        return;
    }
    // x rows in blocks that stay in L2 while this thread's weight rows stream past them
    constexpr int64_t kMBlock = 64;
    constexpr int NR = 2, MR = 2;
    for (int64_t mb = 0; mb < a.M; mb += kMBlock) {
        const int64_t me = mb + kMBlock < a.M ? mb + kMBlock : a.M;
        int64_t n = n0;
        for (; n + NR <= n1; n += NR) {
            if (n + 2 * NR <= n1) prefetch_range(q + (n + NR) * ldq, NR * ldq);
            for (int64_t m = mb; m < me; m += MR) {
                const int mr = static_cast<int>(me - m < MR ? me - m : MR);
                w4a16_tile_m<NR>(mr, a, m, q + n * ldq, s + n * ng, mn + n * ng, at(bias, n), y + m * ldy + n, ldy);
            }
        }
        for (; n < n1; ++n) {
            for (int64_t m = mb; m < me; m += MR) {
                const int mr = static_cast<int>(me - m < MR ? me - m : MR);
                w4a16_tile_m<1>(mr, a, m, q + n * ldq, s + n * ng, mn + n * ng, at(bias, n), y + m * ldy + n, ldy);
            }
        }
    }
}

// ---- W8A16 ---------------------------------------------------------------------------------------

// q[0..7] as floats (exact: int8 -> int32 -> float)
inline __m256 load8_q(const int8_t * q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(q))));
}

// An MR x NR tile of y: rows m of x (f32, row stride ldx) against weight rows r (stride K).
// Every element of y goes through the same operations whatever MR and NR: per group, the
// 8-wide products of its 16-wide steps summed in two chains (the first and second 8), the
// chains added and times the scale into total; then total's lanes summed, plus bias.
template <int MR, int NR, typename YT>
void w8a16_tile(const float * x, int64_t ldx, int64_t K, int64_t G, const int8_t * q, const float * s,
                const float * bias, YT * y, int64_t ldy) {
    const int64_t ng = K / G;
    __m256 total[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) total[m][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        __m256 acc[2][MR][NR];
        for (int h = 0; h < 2; ++h)
            for (int m = 0; m < MR; ++m)
                for (int r = 0; r < NR; ++r) acc[h][m][r] = _mm256_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
            for (int h = 0; h < 2; ++h) {
                for (int r = 0; r < NR; ++r) {
                    const __m256 w = load8_q(q + r * K + k + 8 * h);
                    for (int m = 0; m < MR; ++m) {
                        acc[h][m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8 * h), w, acc[h][m][r]);
                    }
                }
            }
        }
        for (int r = 0; r < NR; ++r) {
            const __m256 sv = _mm256_broadcast_ss(s + r * ng + g);
            for (int m = 0; m < MR; ++m)
                total[m][r] = _mm256_fmadd_ps(_mm256_add_ps(acc[0][m][r], acc[1][m][r]), sv, total[m][r]);
        }
    }
    for (int m = 0; m < MR; ++m) {
        for (int r = 0; r < NR; ++r) {
            float v = hsum(total[m][r]);
            if (bias) v += bias[r];
            store1(y + m * ldy + r, v);
        }
    }
}

template <int NR, typename YT>
inline void w8a16_tile_m(int mr, const float * x, int64_t ldx, int64_t K, int64_t G, const int8_t * q,
                         const float * s, const float * bias, YT * y, int64_t ldy) {
    switch (mr) {
        case 2: w8a16_tile<2, NR>(x, ldx, K, G, q, s, bias, y, ldy); break;
        default: w8a16_tile<1, NR>(x, ldx, K, G, q, s, bias, y, ldy); break;
    }
}

template <typename YT>
void w8a16_rows_t(const float * x, int64_t ldx, int64_t M, int64_t K, int64_t G, const int8_t * q, const float * s,
                  const float * bias, YT * y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t ng = K / G;
    auto at = [&](const float * p, int64_t n) { return p ? p + n : nullptr; };
    if (M == 1) {  // GEMV: bound by reading the weights; the next four rows load while these are summed
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) {
            if (n + 8 <= n1) {  // without it the rows arrive late: ~7 GB/s a thread instead of ~16
                prefetch_range(q + (n + 4) * K, 4 * K);
                prefetch_range(s + (n + 4) * ng, 4 * ng * 4);
            }
            w8a16_tile<1, 4>(x, ldx, K, G, q + n * K, s + n * ng, at(bias, n), y + n, ldy);
        }
        for (; n < n1; ++n) w8a16_tile<1, 1>(x, ldx, K, G, q + n * K, s + n * ng, at(bias, n), y + n, ldy);
        return;
    }
    // x rows in blocks that stay in L2 while this thread's weight rows stream past them
    constexpr int64_t kMBlock = 64;
    constexpr int NR = 2, MR = 2;
    for (int64_t mb = 0; mb < M; mb += kMBlock) {
        const int64_t me = mb + kMBlock < M ? mb + kMBlock : M;
        int64_t n = n0;
        for (; n + NR <= n1; n += NR) {
            if (n + 2 * NR <= n1) prefetch_range(q + (n + NR) * K, NR * K);
            for (int64_t m = mb; m < me; m += MR) {
                const int mr = static_cast<int>(me - m < MR ? me - m : MR);
                w8a16_tile_m<NR>(mr, x + m * ldx, ldx, K, G, q + n * K, s + n * ng, at(bias, n), y + m * ldy + n, ldy);
            }
        }
        for (; n < n1; ++n) {
            for (int64_t m = mb; m < me; m += MR) {
                const int mr = static_cast<int>(me - m < MR ? me - m : MR);
                w8a16_tile_m<1>(mr, x + m * ldx, ldx, K, G, q + n * K, s + n * ng, at(bias, n), y + m * ldy + n, ldy);
            }
        }
    }
}

// ---- W8A8 ----------------------------------------------------------------------------------------

// Sixteen products at a time: sign-extended to int16, _mm256_madd_epi16 sums adjacent pairs
// into int32 (|2 * 127 * 127| is far from int16's or int32's limits: exact).
template <int MR, int NR, typename YT>
inline void w8a8_tile(const int16_t * xw, const float * sx, int64_t K, const int8_t * w, const float * sw,
                      const float * bias, YT * y, int64_t ldy) {
    __m256i acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256i wv[NR];
        for (int r = 0; r < NR; ++r) {
            wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w + r * K + k)));
        }
        for (int m = 0; m < MR; ++m) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xw + m * K + k));
            for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(xv, wv[r]));
        }
    }
    for (int m = 0; m < MR; ++m) {
        for (int r = 0; r < NR; ++r) {
            int32_t s = hsum_epi32(acc[m][r]);
            for (int64_t kk = k; kk < K; ++kk) s += static_cast<int32_t>(xw[m * K + kk]) * w[r * K + kk];
            float v = static_cast<float>(s) * sx[m] * sw[r];
            if (bias) v += bias[r];
            store1(y + m * ldy + r, v);
        }
    }
}

template <int NR, typename YT>
inline void w8a8_tile_m(int mr, const int16_t * xw, const float * sx, int64_t K, const int8_t * w, const float * sw,
                        const float * bias, YT * y, int64_t ldy) {
    switch (mr) {
        case 4: w8a8_tile<4, NR>(xw, sx, K, w, sw, bias, y, ldy); break;
        case 3: w8a8_tile<3, NR>(xw, sx, K, w, sw, bias, y, ldy); break;
        case 2: w8a8_tile<2, NR>(xw, sx, K, w, sw, bias, y, ldy); break;
        default: w8a8_tile<1, NR>(xw, sx, K, w, sw, bias, y, ldy); break;
    }
}

template <typename YT>
void w8a8_rows_t(const int16_t * xw, const float * sx, int64_t M, int64_t K, const int8_t * w, const float * sw,
                 const float * bias, YT * y, int64_t ldy, int64_t n0, int64_t n1) {
    auto at = [&](const float * p, int64_t n) { return p ? p + n : nullptr; };
    if (M == 1) {
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) w8a8_tile<1, 4>(xw, sx, K, w + n * K, sw + n, at(bias, n), y + n, ldy);
        for (; n < n1; ++n) w8a8_tile<1, 1>(xw, sx, K, w + n * K, sw + n, at(bias, n), y + n, ldy);
        return;
    }
    constexpr int64_t kMBlock = 64;
    constexpr int NR = 3, MR = 4;
    for (int64_t mb = 0; mb < M; mb += kMBlock) {
        const int64_t me = mb + kMBlock < M ? mb + kMBlock : M;
        int64_t n = n0;
        for (; n + NR <= n1; n += NR) {
            if (n + 2 * NR <= n1) prefetch_range(w + (n + NR) * K, NR * K);
            for (int64_t m = mb; m < me; m += MR) {
                const int mr = static_cast<int>(me - m < MR ? me - m : MR);
                w8a8_tile_m<NR>(mr, xw + m * K, sx + m, K, w + n * K, sw + n, at(bias, n), y + m * ldy + n, ldy);
            }
        }
        for (; n < n1; ++n) {
            for (int64_t m = mb; m < me; m += MR) {
                const int mr = static_cast<int>(me - m < MR ? me - m : MR);
                w8a8_tile_m<1>(mr, xw + m * K, sx + m, K, w + n * K, sw + n, at(bias, n), y + m * ldy + n, ldy);
            }
        }
    }
}

template <typename XT>
float quantize_row_t(const XT * x, int64_t K, int8_t * xq) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(load8(x + k), abs_mask));
    float absmax = 0.f;
    {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, vmax);
        for (float v : tmp) absmax = std::fmax(absmax, v);
    }
    for (; k < K; ++k) absmax = std::fmax(absmax, std::fabs(to_f32(x[k])));
    const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    // |x * inv| <= 127 after rounding, so the saturating packs never clip
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + k + 8 * i), vinv));
        const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(xq + k), _mm256_permutevar8x32_epi32(p16, order));
    }
    for (; k < K; ++k) {
        const float v = std::nearbyint(to_f32(x[k]) * inv);
        xq[k] = static_cast<int8_t>(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
    }
    return absmax / 127.f;
}

}  // namespace

void w4a16_prepare_row(const TensorView & x, int64_t m, int64_t group_size, float * xp, float * xsum) {
    const int64_t K = x.size(1), off = m * x.stride(0);
    switch (x.dtype) {
        case DType::f32: prepare_row_t(x.ptr<float>() + off, K, group_size, xp, xsum); break;
        case DType::bf16: prepare_row_t(x.ptr<bf16>() + off, K, group_size, xp, xsum); break;
        case DType::f16: prepare_row_t(x.ptr<f16>() + off, K, group_size, xp, xsum); break;
        default: break;
    }
}

void linear_w4a16_rows(const W4A16Activations & a, const TensorView & qweight, const TensorView & scales,
                       const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1) {
    const uint8_t * q = qweight.ptr<uint8_t>();
    const float * s = scales.ptr<float>();
    const float * mn = mins.ptr<float>();
    const float * b = bias ? bias->ptr<float>() : nullptr;
    switch (y.dtype) {
        case DType::f32: w4a16_rows_t(a, q, s, mn, b, y.ptr<float>(), y.stride(0), n0, n1); break;
        case DType::bf16: w4a16_rows_t(a, q, s, mn, b, y.ptr<bf16>(), y.stride(0), n0, n1); break;
        case DType::f16: w4a16_rows_t(a, q, s, mn, b, y.ptr<f16>(), y.stride(0), n0, n1); break;
        default: break;
    }
}

void w8a16_prepare_row(const TensorView & x, int64_t m, float * xf) {
    const int64_t K = x.size(1), off = m * x.stride(0);
    for (int64_t k = 0; k < K; ++k) xf[k] = load_f32(x.data, off + k, x.dtype);
}

void linear_w8a16_rows(const float * xf, int64_t ldx, int64_t M, int64_t K, const TensorView & qweight,
                       const TensorView & scales, const TensorView * bias, const TensorView & y, int64_t group_size,
                       int64_t n0, int64_t n1) {
    const int8_t * q = qweight.ptr<int8_t>();
    const float * s = scales.ptr<float>();
    const float * b = bias ? bias->ptr<float>() : nullptr;
    const int64_t G = group_size, ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: w8a16_rows_t(xf, ldx, M, K, G, q, s, b, y.ptr<float>(), ldy, n0, n1); break;
        case DType::bf16: w8a16_rows_t(xf, ldx, M, K, G, q, s, b, y.ptr<bf16>(), ldy, n0, n1); break;
        case DType::f16: w8a16_rows_t(xf, ldx, M, K, G, q, s, b, y.ptr<f16>(), ldy, n0, n1); break;
        default: break;
    }
}

float quantize_row(const TensorView & x, int64_t m, int8_t * xq) {
    const int64_t K = x.size(1), off = m * x.stride(0);
    switch (x.dtype) {
        case DType::f32: return quantize_row_t(x.ptr<float>() + off, K, xq);
        case DType::bf16: return quantize_row_t(x.ptr<bf16>() + off, K, xq);
        case DType::f16: return quantize_row_t(x.ptr<f16>() + off, K, xq);
        default: return 0.f;
    }
}

void linear_w8a8_rows(const int16_t * xw, const float * sx, int64_t M, int64_t K, const TensorView & w,
                      const TensorView & sw, const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1) {
    const int8_t * wp = w.ptr<int8_t>();
    const float * s = sw.ptr<float>();
    const float * b = bias ? bias->ptr<float>() : nullptr;
    switch (y.dtype) {
        case DType::f32: w8a8_rows_t(xw, sx, M, K, wp, s, b, y.ptr<float>(), y.stride(0), n0, n1); break;
        case DType::bf16: w8a8_rows_t(xw, sx, M, K, wp, s, b, y.ptr<bf16>(), y.stride(0), n0, n1); break;
        case DType::f16: w8a8_rows_t(xw, sx, M, K, wp, s, b, y.ptr<f16>(), y.stride(0), n0, n1); break;
        default: break;
    }
}

}  // namespace lmd::cpu::avx2
