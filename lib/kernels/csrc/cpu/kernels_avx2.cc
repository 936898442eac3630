// AVX2/FMA/F16C kernels. This file alone is compiled with -mavx2 -mfma -mf16c; the
// dispatch in kernels.cc calls into it only when the CPU has all three.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "cpu/kernels.h"
#include "cpu/simd_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

// ---- linear ------------------------------------------------------------------------------------

// An MR x NR tile of y = x · wᵀ in dot-product form: both operands are read along K, each
// of the MR * NR accumulators holds eight partial sums, reduced once at the end.
// With Prefetch, each of the NR weight rows asks for the line NR rows further on as it
// enters a new one: the next tile's rows, on their way from memory while this tile computes.
template <int MR, int NR, typename WT, typename YT, bool Prefetch = false>
inline void linear_tile(const float * x, int64_t ldx, const WT * w, int64_t K, const WT * bias,
                        YT * y, int64_t ldy) {
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
    constexpr int64_t kLine = 64 / sizeof(WT);  // weights a cache line
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (Prefetch && k % kLine == 0) {
            for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char *>(w + (r + NR) * K + k), _MM_HINT_T0);
        }
        __m256 wv[NR];
        for (int r = 0; r < NR; ++r) wv[r] = load8(w + r * K + k);
        for (int m = 0; m < MR; ++m) {
            const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
            for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
    for (int m = 0; m < MR; ++m) {
        for (int r = 0; r < NR; ++r) {
            float s = hsum(acc[m][r]);
            for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * to_f32(w[r * K + kk]);
            if (bias) s += to_f32(bias[r]);
            store1(y + m * ldy + r, s);
        }
    }
}

template <int NR, typename WT, typename YT>
inline void linear_tile_m(int mr, const float * x, int64_t ldx, const WT * w, int64_t K, const WT * bias,
                          YT * y, int64_t ldy) {
    switch (mr) {
        case 4: linear_tile<4, NR>(x, ldx, w, K, bias, y, ldy); break;
        case 3: linear_tile<3, NR>(x, ldx, w, K, bias, y, ldy); break;
        case 2: linear_tile<2, NR>(x, ldx, w, K, bias, y, ldy); break;
        default: linear_tile<1, NR>(x, ldx, w, K, bias, y, ldy); break;
    }
}

// mr of up to six rows against two rows of w (up to 12 accumulators: the registers still hold them).
template <bool Prefetch, typename WT, typename YT>
inline void linear_tile_m2(int mr, const float * x, int64_t ldx, const WT * w, int64_t K, const WT * bias,
                           YT * y, int64_t ldy) {
    switch (mr) {
        case 6: linear_tile<6, 2, WT, YT, Prefetch>(x, ldx, w, K, bias, y, ldy); break;
        case 5: linear_tile<5, 2, WT, YT, Prefetch>(x, ldx, w, K, bias, y, ldy); break;
        case 4: linear_tile<4, 2, WT, YT, Prefetch>(x, ldx, w, K, bias, y, ldy); break;
        case 3: linear_tile<3, 2, WT, YT, Prefetch>(x, ldx, w, K, bias, y, ldy); break;
        case 2: linear_tile<2, 2, WT, YT, Prefetch>(x, ldx, w, K, bias, y, ldy); break;
        default: linear_tile<1, 2, WT, YT, Prefetch>(x, ldx, w, K, bias, y, ldy); break;
    }
}

// Few rows (a drafted step's 1 + k, a small decode batch): as bound by reading w as the GEMV
// if the arithmetic hides under the reads. Two rows of w at a time against up to six rows of x
// in one tile (w read once from memory, the next two rows prefetched), the rest of x's rows
// (seven or eight) in a second tile that re-reads them from L1. Each element in the same order
// as any other path. On SmolLM2's float32 layers (AMD EPYC, 2 threads) five rows cost 1.3x one
// row's GEMV, against 1.6x through the GEMM tiles; two rows do better there (three streams).
constexpr int64_t kFewRowsMin = 3, kFewRowsMax = 8;

template <typename WT, typename YT>
void linear_rows_few(const float * x, int64_t ldx, int64_t M, int64_t K, const WT * w, const WT * bias,
                     YT * y, int64_t ldy, int64_t n0, int64_t n1) {
    constexpr int NR = 2;
    const int first = static_cast<int>(M <= 6 ? M : 4);  // seven or eight rows: 4 + 3, 4 + 4
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) {
        const WT * wn = w + n * K;
        const WT * bn = bias ? bias + n : nullptr;
        // the last tile of the range prefetches nothing past it
        if (n + 2 * NR <= n1) linear_tile_m2<true>(first, x, ldx, wn, K, bn, y + n, ldy);
        else linear_tile_m2<false>(first, x, ldx, wn, K, bn, y + n, ldy);
        if (first < M) linear_tile_m2<false>(static_cast<int>(M - first), x + first * ldx, ldx, wn, K, bn,
                                             y + first * ldy + n, ldy);
    }
    for (; n < n1; ++n) {
        for (int64_t m = 0; m < M; m += 4) {
            const int mr = static_cast<int>(M - m < 4 ? M - m : 4);
            linear_tile_m<1>(mr, x + m * ldx, ldx, w + n * K, K, bias ? bias + n : nullptr, y + m * ldy + n, ldy);
        }
    }
}

template <typename WT, typename YT>
void linear_rows_t(const float * x, int64_t ldx, int64_t M, int64_t K, const WT * w, const WT * bias,
                   YT * y, int64_t ldy, int64_t n0, int64_t n1) {
    if (M == 1) {  // GEMV: bound by reading w; four rows at a time keep four streams in flight
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) linear_tile<1, 4>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy);
        for (; n < n1; ++n) linear_tile<1, 1>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy);
        return;
    }
    if (M >= kFewRowsMin && M <= kFewRowsMax) return linear_rows_few(x, ldx, M, K, w, bias, y, ldy, n0, n1);
    // x rows in blocks that stay in L2 while this thread's rows of w stream past them
    constexpr int64_t kMBlock = 64;
    constexpr int NR = 3;
    for (int64_t mb = 0; mb < M; mb += kMBlock) {
        const int64_t me = mb + kMBlock < M ? mb + kMBlock : M;
        int64_t n = n0;
        for (; n + NR <= n1; n += NR) {
            const WT * wn = w + n * K;
            const WT * bn = bias ? bias + n : nullptr;
            if (n + 2 * NR <= n1) prefetch_range(wn + NR * K, NR * K * static_cast<int64_t>(sizeof(WT)));
            for (int64_t m = mb; m < me; m += 4) {
                const int mr = static_cast<int>(me - m < 4 ? me - m : 4);
                linear_tile_m<NR>(mr, x + m * ldx, ldx, wn, K, bn, y + m * ldy + n, ldy);
            }
        }
        for (; n < n1; ++n) {
            for (int64_t m = mb; m < me; m += 4) {
                const int mr = static_cast<int>(me - m < 4 ? me - m : 4);
                linear_tile_m<1>(mr, x + m * ldx, ldx, w + n * K, K, bias ? bias + n : nullptr, y + m * ldy + n, ldy);
            }
        }
    }
}

template <typename WT>
void linear_rows_w(const float * x, int64_t ldx, int64_t M, int64_t K, const TensorView & w,
                   const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1) {
    const WT * wp = w.ptr<WT>();
    const WT * bp = bias ? bias->ptr<WT>() : nullptr;
    switch (y.dtype) {
        case DType::f32: linear_rows_t(x, ldx, M, K, wp, bp, y.ptr<float>(), y.stride(0), n0, n1); break;
        case DType::bf16: linear_rows_t(x, ldx, M, K, wp, bp, y.ptr<bf16>(), y.stride(0), n0, n1); break;
        case DType::f16: linear_rows_t(x, ldx, M, K, wp, bp, y.ptr<f16>(), y.stride(0), n0, n1); break;
        default: break;
    }
}

// ---- attention -------------------------------------------------------------------------------

// Token t's slice of KV head h in a paged cache [blocks, block_size, num_kv_heads, D]: row = the
// elements of a token (num_kv_heads * D), table = the sequence's blocks.
template <typename T>
inline const T * head_slice(const T * cache, const int32_t * table, int64_t block_size, int64_t row, int64_t D,
                            int64_t h, int64_t t) {
    return cache + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row + h * D;
}

// A row's n scores in s soft-capped (Gemma 2: tanh(s / cap) * cap, when softcap > 0) and turned into
// probabilities, unnormalised; returns their sum, with the sink's term (gpt-oss: its logit joins the
// softmax as a key without a value) when sink is not null. The output divides by the sum once.
inline float softmax_unnormalised(float * s, int64_t n, float softcap, const float * sink) {
    if (softcap > 0.f) {
        for (int64_t i = 0; i < n; ++i) s[i] = softcap * std::tanh(s[i] / softcap);
    }
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    float max_s = -INFINITY;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    for (; t < n; ++t) max_s = std::fmax(max_s, s[t]);
    {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, vmax);
        for (float v : tmp) max_s = std::fmax(max_s, v);
    }
    if (sink) max_s = std::fmax(max_s, *sink);
    return exp_shifted(s, n, max_s) + (sink ? std::exp(*sink - max_s) : 0.f);
}

// One sequence, one KV head and the `group` query heads that share it; scratch holds
// group * len scores. NV = head_dim / 8 when known at compile time (the common head
// sizes: q and the output accumulators then live in registers), 0 for any other.
template <typename T, int NV>
void decode_attention_t(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                        const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                        const float * sinks, const TensorView & out, int64_t b, int64_t first, int64_t kv_head, float * scratch) {
    const int64_t num_heads = q.size(1), D = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t len = context_lens.ptr<int32_t>()[b];
    const int32_t * table = block_tables.ptr<int32_t>() + b * block_tables.stride(0);
    const T * kc = k_cache.ptr<T>();
    const T * vc = v_cache.ptr<T>();
    const int64_t nv = NV ? NV : D / 8;
    const int64_t row = num_kv_heads * D;  // elements between consecutive tokens of a block
    const __m256 vscale = _mm256_set1_ps(scale);
    constexpr int kRegs = NV ? NV : kMaxHeadDim / 8;
    const int64_t slice_bytes = D * static_cast<int64_t>(sizeof(T));
    auto slice = [&](const T * cache, int64_t t) { return head_slice(cache, table, block_size, row, D, kv_head, t); };

    for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv_head * group + g;
        const T * qh = q.ptr<T>() + b * q.stride(0) + h * q.stride(1);
        __m256 qv[kRegs];
        for (int64_t i = 0; i < nv; ++i) qv[i] = _mm256_mul_ps(load8(qh + 8 * i), vscale);
        auto dot = [&](const T * kt) {
            __m256 a = _mm256_mul_ps(qv[0], load8(kt));
            for (int64_t i = 1; i < nv; ++i) a = _mm256_fmadd_ps(qv[i], load8(kt + 8 * i), a);
            return a;
        };
        const int64_t n = len - first;
        float * s = scratch + g * n;  // s[i]: the score of token first + i
        // scores, run by run of tokens in one block (the first may start mid-block); eight tokens
        // share one reduction
        SliceStream keys([&](int64_t t) { return slice(kc, t); }, slice_bytes, first, len);
        for (int64_t t0 = first; t0 < len;) {
            const T * kb = slice(kc, t0);
            const int64_t tn = std::min(block_size - t0 % block_size, len - t0);
            int64_t t = 0;
            for (; t + 8 <= tn; t += 8) {
                if (g == 0) keys.reading(t0 + t);  // the other query heads find them in cache
                __m256 a[8];
                for (int j = 0; j < 8; ++j) a[j] = dot(kb + (t + j) * row);
                _mm256_storeu_ps(s + (t0 - first) + t, reduce8(a));
            }
            for (; t < tn; ++t) s[t0 - first + t] = hsum(dot(kb + t * row));
            t0 += tn;
        }
        const float sum = softmax_unnormalised(s, n, softcap, sinks ? sinks + h : nullptr);
        __m256 acc[kRegs];
        for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_setzero_ps();
        SliceStream values([&](int64_t t) { return slice(vc, t); }, slice_bytes, first, len);
        for (int64_t t0 = first; t0 < len;) {
            const T * vb = slice(vc, t0);
            const int64_t tn = std::min(block_size - t0 % block_size, len - t0);
            for (int64_t tt = 0; tt < tn; ++tt) {
                if (g == 0 && tt % 8 == 0) values.reading(t0 + tt);
                const __m256 p = _mm256_set1_ps(s[t0 - first + tt]);
                const T * vt = vb + tt * row;
                for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_fmadd_ps(p, load8(vt + 8 * i), acc[i]);
            }
            t0 += tn;
        }
        const __m256 inv = _mm256_set1_ps(1.f / sum);
        T * oh = out.ptr<T>() + b * out.stride(0) + h * out.stride(1);
        for (int64_t i = 0; i < nv; ++i) store8(oh + 8 * i, _mm256_mul_ps(acc[i], inv));
    }
}

// decode_attention_t for `rows` query rows b0 .. of one sequence (they share row b0's table; no window)
// and the group query heads of one KV head together: the keys and values are taken a tile of up to
// kTile tokens at a time, the tile read once from L2 into L1 for every (row, head) pair instead of
// once per pair. Each pair's operations, and their order, are decode_attention_t's (the scores'
// groups of eight from each block's start, the softmax, the ascending sum over tokens): its result is
// that kernel's bit for bit. scratch: rows * group * (max len + D) floats.
template <typename T, int NV>
void attention_rows_t(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                      const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                      const float * sinks, const TensorView & out, int64_t b0, int64_t rows, int64_t kv_head,
                      float * scratch) {
    constexpr int64_t kTile = 32;  // a multiple of 8: a tile never splits a group of eight
    const int64_t num_heads = q.size(1), D = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    const int64_t group = num_heads / num_kv_heads, P = rows * group;
    const int32_t * lens = context_lens.ptr<int32_t>() + b0;
    const int32_t * table = block_tables.ptr<int32_t>() + b0 * block_tables.stride(0);
    int64_t max_len = 0;
    for (int64_t r = 0; r < rows; ++r) max_len = std::max<int64_t>(max_len, lens[r]);
    const int64_t nv = NV ? NV : D / 8;
    const int64_t row = num_kv_heads * D;  // elements between consecutive tokens of a block
    constexpr int kRegs = NV ? NV : kMaxHeadDim / 8;
    float * S = scratch;                // [P, max_len]: pair p's scores, then its probabilities
    float * A = scratch + P * max_len;  // [P, D]: pair p's scaled query, then its output sums between tiles
    auto len_of = [&](int64_t p) { return static_cast<int64_t>(lens[p / group]); };
    auto head_of = [&](int64_t p) { return kv_head * group + p % group; };
    // fn(t0, t1, base) for each tile [t0, t1) of [0, max_len), inside one block; token t at base + (t - t0) * row.
    // Each pass streams its head's slices into L2 ahead of the tile it reads (SliceStream).
    auto for_tiles = [&](const T * cache, auto && fn) {
        auto slice = [&](int64_t t) { return head_slice(cache, table, block_size, row, D, kv_head, t); };
        SliceStream stream(slice, D * static_cast<int64_t>(sizeof(T)), 0, max_len);
        for (int64_t t0 = 0, t1 = 0; t0 < max_len; t0 = t1) {
            t1 = std::min({t0 / block_size * block_size + block_size, max_len, t0 + kTile});
            stream.reading(t0);
            fn(t0, t1, slice(t0));
        }
    };
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t p = 0; p < P; ++p) {
        const T * qh = q.ptr<T>() + (b0 + p / group) * q.stride(0) + head_of(p) * q.stride(1);
        for (int64_t i = 0; i < nv; ++i) _mm256_storeu_ps(A + p * D + 8 * i, _mm256_mul_ps(load8(qh + 8 * i), vscale));
    }
    for_tiles(k_cache.ptr<T>(), [&](int64_t t0, int64_t t1, const T * kb) {
        const int64_t start = t0 / block_size * block_size;
        for (int64_t p = 0; p < P; ++p) {
            const int64_t len = len_of(p);
            if (t0 >= len) continue;
            const int64_t run_end = std::min(len, start + block_size), end = std::min(t1, len);
            __m256 qv[kRegs];
            for (int64_t i = 0; i < nv; ++i) qv[i] = _mm256_loadu_ps(A + p * D + 8 * i);
            auto dot = [&](const T * kt) {
                __m256 a = _mm256_mul_ps(qv[0], load8(kt));
                for (int64_t i = 1; i < nv; ++i) a = _mm256_fmadd_ps(qv[i], load8(kt + 8 * i), a);
                return a;
            };
            float * s = S + p * max_len;
            int64_t t = t0;
            for (; t + 8 <= run_end && t < end; t += 8) {  // the decode kernel's groups: t - start a multiple of 8
                __m256 a[8];
                for (int j = 0; j < 8; ++j) a[j] = dot(kb + (t - t0 + j) * row);
                _mm256_storeu_ps(s + t, reduce8(a));
            }
            for (; t < end; ++t) s[t] = hsum(dot(kb + (t - t0) * row));
        }
    });
    float sums[64];  // P <= 64 (the dispatch's tiles)
    for (int64_t p = 0; p < P; ++p) {
        sums[p] = softmax_unnormalised(S + p * max_len, len_of(p), softcap, sinks ? sinks + head_of(p) : nullptr);
        for (int64_t i = 0; i < nv; ++i) _mm256_storeu_ps(A + p * D + 8 * i, _mm256_setzero_ps());
    }
    for_tiles(v_cache.ptr<T>(), [&](int64_t t0, int64_t t1, const T * vb) {
        for (int64_t p = 0; p < P; ++p) {
            const int64_t end = std::min(t1, len_of(p));
            if (t0 >= end) continue;
            const float * s = S + p * max_len;
            __m256 acc[kRegs];
            for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_loadu_ps(A + p * D + 8 * i);
            for (int64_t t = t0; t < end; ++t) {
                const __m256 pt = _mm256_set1_ps(s[t]);
                const T * vt = vb + (t - t0) * row;
                for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_fmadd_ps(pt, load8(vt + 8 * i), acc[i]);
            }
            for (int64_t i = 0; i < nv; ++i) _mm256_storeu_ps(A + p * D + 8 * i, acc[i]);
        }
    });
    for (int64_t p = 0; p < P; ++p) {
        const __m256 inv = _mm256_set1_ps(1.f / sums[p]);
        T * oh = out.ptr<T>() + (b0 + p / group) * out.stride(0) + head_of(p) * out.stride(1);
        for (int64_t i = 0; i < nv; ++i) store8(oh + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(A + p * D + 8 * i), inv));
    }
}

template <typename T>
void decode_attention_d(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                        const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                        const float * sinks, const TensorView & out, int64_t b, int64_t first, int64_t kv_head, float * scratch) {
    switch (q.size(2)) {
        case 64: decode_attention_t<T, 8>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b, first, kv_head, scratch); break;
        case 128: decode_attention_t<T, 16>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b, first, kv_head, scratch); break;
        default: decode_attention_t<T, 0>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b, first, kv_head, scratch); break;
    }
}

// ---- elementwise -----------------------------------------------------------------------------

template <typename T>
inline __m256 round_to(__m256 v) { return v; }  // float32: nothing to round
template <>
inline __m256 round_to<bf16>(__m256 v) {  // round to nearest even at bfloat16's 8 mantissa bits
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
template <>
inline __m256 round_to<f16>(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }

template <typename T>
void rms_norm_row_t(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
                    const TensorView * residual, int64_t m) {
    const int64_t H = x.size(1);
    if (H % 8 != 0) return ref::rms_norm_row(x, w, eps, out, residual, m);
    const T * src = x.ptr<T>() + m * x.stride(0);
    if (residual) {
        T * r = residual->ptr<T>() + m * residual->stride(0);
        for (int64_t i = 0; i < H; i += 8) store8(r + i, _mm256_add_ps(load8(r + i), load8(src + i)));
        src = r;
    }
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < H; i += 8) {
        const __m256 v = load8(src + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(hsum(ss) / static_cast<float>(H) + eps));
    const T * wp = w.ptr<T>();
    T * o = out.ptr<T>() + m * out.stride(0);
    for (int64_t i = 0; i < H; i += 8) {
        store8(o + i, _mm256_mul_ps(load8(wp + i), round_to<T>(_mm256_mul_ps(load8(src + i), inv))));
    }
}

template <typename T>
void silu_and_mul_row_t(const TensorView & x, const TensorView & out, int64_t m) {
    const int64_t I = out.size(1);
    const T * g = x.ptr<T>() + m * x.stride(0);
    const T * u = g + I;
    T * o = out.ptr<T>() + m * out.stride(0);
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = load8(g + i);
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        store8(o + i, _mm256_mul_ps(silu, load8(u + i)));
    }
    for (; i < I; ++i) {
        const float gv = to_f32(g[i]);
        store1(o + i, gv / (1.f + std::exp(-gv)) * to_f32(u[i]));
    }
}

// ---- RoPE + KV fill ------------------------------------------------------------------------------

// The reference's float operations one by one, eight lanes at a time: no multiply-add may fuse
// them (the reference, built without FMA, rounds each product), so the bits are its bits.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// f[0..D) = head src rotated (NeoX halves over the first `rot` values; the rest passed through).
template <typename T>
void rotate_head(const T * src, const T * cs, int64_t D, int64_t rot, float * f) {
    const int64_t half = rot / 2;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 c = load8(cs + i), s = load8(cs + half + i);
        const __m256 x1 = load8(src + i), x2 = load8(src + half + i);
        _mm256_storeu_ps(f + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
        _mm256_storeu_ps(f + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
    }
    for (; i < half; ++i) {
        const float c = to_f32(cs[i]), s = to_f32(cs[half + i]);
        const float x1 = to_f32(src[i]), x2 = to_f32(src[half + i]);
        f[i] = x1 * c - x2 * s;
        f[half + i] = x2 * c + x1 * s;
    }
    for (int64_t j = rot; j < D; ++j) f[j] = to_f32(src[j]);
}

#pragma GCC pop_options

template <typename T>
void store_row(const float * f, int64_t D, T * dst) {
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) store8(dst + i, _mm256_loadu_ps(f + i));
    for (; i < D; ++i) store1(dst + i, f[i]);
}

template <typename T>
void rope_fill_kv_row_t(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                        const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                        const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, const KVQuant * kv_quant,
                        int64_t t) {
    const int64_t D = q_out.size(2), rot = cos_sin.size(1);
    const int64_t slot = slots.ptr<int64_t>()[t];
    const T * cs = cos_sin.ptr<T>() + positions.ptr<int64_t>()[t] * cos_sin.stride(0);
    const T * x = qkv.ptr<T>() + t * qkv.stride(0);
    float f[kMaxHeadDim];
    for (int64_t h = 0; h < num_heads; ++h) {
        rotate_head(x + h * D, cs, D, rot, f);
        store_row(f, D, q_out.ptr<T>() + t * q_out.stride(0) + h * q_out.stride(1));
    }
    const T * k = x + num_heads * D;
    const T * v = k + num_kv_heads * D;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t r = slot * num_kv_heads + h;  // the (slot, head) row of the caches
        rotate_head(k + h * D, cs, D, rot, f);
        if (!kv_quant) {
            store_row(f, D, k_cache.ptr<T>() + r * D);
            std::copy(v + h * D, v + (h + 1) * D, v_cache.ptr<T>() + r * D);  // 16 bits to float and back: the same
            continue;
        }
        const int bits = kv_quant->bits;
        kv_quantize_row(f, D, bits, k_cache.ptr<uint8_t>() + r * k_cache.size(3), kv_quant->k_params.ptr<float>() + r * 2);
        for (int64_t i = 0; i < D; ++i) f[i] = to_f32(v[h * D + i]);
        kv_quantize_row(f, D, bits, v_cache.ptr<uint8_t>() + r * v_cache.size(3), kv_quant->v_params.ptr<float>() + r * 2);
    }
}

}  // namespace

void rope_fill_kv_row(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                      const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                      const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, const KVQuant * kv_quant,
                      int64_t t) {
    switch (qkv.dtype) {
        case DType::f32: rope_fill_kv_row_t<float>(qkv, positions, cos_sin, k_cache, v_cache, slots, q_out, num_heads, num_kv_heads, kv_quant, t); break;
        case DType::bf16: rope_fill_kv_row_t<bf16>(qkv, positions, cos_sin, k_cache, v_cache, slots, q_out, num_heads, num_kv_heads, kv_quant, t); break;
        case DType::f16: rope_fill_kv_row_t<f16>(qkv, positions, cos_sin, k_cache, v_cache, slots, q_out, num_heads, num_kv_heads, kv_quant, t); break;
        default: break;
    }
}

void rms_norm_row(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
                  const TensorView * residual, int64_t m) {
    switch (x.dtype) {
        case DType::f32: rms_norm_row_t<float>(x, w, eps, out, residual, m); break;
        case DType::bf16: rms_norm_row_t<bf16>(x, w, eps, out, residual, m); break;
        case DType::f16: rms_norm_row_t<f16>(x, w, eps, out, residual, m); break;
        default: break;
    }
}

void silu_and_mul_row(const TensorView & x, const TensorView & out, int64_t m) {
    switch (x.dtype) {
        case DType::f32: silu_and_mul_row_t<float>(x, out, m); break;
        case DType::bf16: silu_and_mul_row_t<bf16>(x, out, m); break;
        case DType::f16: silu_and_mul_row_t<f16>(x, out, m); break;
        default: break;
    }
}

void linear_rows(const float * x, int64_t ldx, int64_t M, int64_t K, const TensorView & w, const TensorView * bias,
                 const TensorView & y, int64_t n0, int64_t n1) {
    switch (w.dtype) {
        case DType::f32: linear_rows_w<float>(x, ldx, M, K, w, bias, y, n0, n1); break;
        case DType::bf16: linear_rows_w<bf16>(x, ldx, M, K, w, bias, y, n0, n1); break;
        case DType::f16: linear_rows_w<f16>(x, ldx, M, K, w, bias, y, n0, n1); break;
        default: break;
    }
}

void attention_rows_task(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                         const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                         const float * sinks, const TensorView & out, int64_t b0, int64_t rows, int64_t kv_head,
                         float * scratch) {
    auto run = [&](auto tag) {
        using T = decltype(tag);
        switch (q.size(2)) {
            case 64: attention_rows_t<T, 8>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b0, rows, kv_head, scratch); break;
            case 128: attention_rows_t<T, 16>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b0, rows, kv_head, scratch); break;
            default: attention_rows_t<T, 0>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b0, rows, kv_head, scratch); break;
        }
    };
    switch (q.dtype) {
        case DType::f32: run(float()); break;
        case DType::bf16: run(bf16()); break;
        case DType::f16: run(f16()); break;
        default: break;
    }
}

void decode_attention_task(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                           const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                           const float * sinks, const TensorView & out, int64_t b, int64_t first, int64_t kv_head, float * scratch) {
    switch (q.dtype) {
        case DType::f32: decode_attention_d<float>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b, first, kv_head, scratch); break;
        case DType::bf16: decode_attention_d<bf16>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b, first, kv_head, scratch); break;
        case DType::f16: decode_attention_d<f16>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, b, first, kv_head, scratch); break;
        default: break;
    }
}

}  // namespace lmd::cpu::avx2
