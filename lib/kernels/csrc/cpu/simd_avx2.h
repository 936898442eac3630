// Element helpers of the AVX2 kernels: 16-bit float types, eight-wide loads and stores as
// float32, scalar conversions for tails, horizontal sums. Include only from translation
// units compiled with -mavx2 -mfma -mf16c (kernels_avx2.cc, quant_avx2.cc).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "core/tensor.h"

namespace lmd::cpu::avx2 {

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

// Eight consecutive elements as float32.
inline __m256 load8(const float * p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16 * p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const f16 * p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) { return bf16_to_f32(v.bits); }
inline float to_f32(f16 v) { return _cvtsh_ss(v.bits); }

inline void store1(float * p, float v) { *p = v; }
inline void store1(bf16 * p, float v) { p->bits = f32_to_bf16(v); }
inline void store1(f16 * p, float v) { p->bits = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }

inline void store8(float * p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16 * p, __m256 v) {  // f32_to_bf16 in eight lanes: nearest even, NaN kept quiet
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // every lane < 2^16, so the saturating pack is exact
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline void store8(f16 * p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// x[0..32) quantized as llama.cpp's Q8_0 / Q8_1 blocks: d = max |x| / 127, r = round-to-nearest-
// even(x / d) as x * (1 / d), clamped to -127..127 (all 0 when d is 0). Returns d. The scalar
// twin is ref::quantize_block32 (quant.h); both give the same d and r.
inline float quantize_block32(const float * x, int32_t * r) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), _mm256_set1_ps(id)));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(r + 8 * j), _mm256_min_epi32(_mm256_max_epi32(v, lo), hi));
    }
    return d;
}

// Ask for [p, p + bytes) in L1 ahead of use, a line at a time: the hardware prefetcher alone
// lets the next weight rows of a GEMV arrive late when each row takes ~1 us of arithmetic.
inline void prefetch_range(const void * p, int64_t bytes) {
    const char * c = static_cast<const char *>(p);
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

constexpr int kMaxHeadDim = 256;  // the attention kernels keep a head in registers up to this

// One KV head's slices of a paged cache asked for (prefetched) into L2 token by token, a fixed number
// of bytes ahead of the token the attention reads: a head's slice is every num_kv_heads-th run of a
// token's row, in blocks that need not be adjacent, which the hardware prefetchers do not follow, and
// in a decode step (every layer's weights read in between) each line is a trip to memory. Into L2,
// not L1, whose few outstanding misses held the stream to about half the read bandwidth: a decode row
// over 1024 tokens of SmolLM2's float cache went from 105 to 62 us a layer on two threads
// (`python benchmark/attention_cpu.py --rows 1 --ctx 1024 --layers 30`).
// slice(t): the address of token t's slice, `bytes` long; tokens [begin, end) are read, in order.
template <typename Slice>
class SliceStream {
public:
    static constexpr int64_t kAheadBytes = 16 << 10;

    SliceStream(Slice slice, int64_t bytes, int64_t begin, int64_t end)
        : slice_(slice), bytes_(bytes), end_(end), ahead_(std::max<int64_t>(8, kAheadBytes / std::max<int64_t>(bytes, 1))),
          asked_(begin) {}

    // reading token t: tokens up to t + ahead asked for
    void reading(int64_t t) {
        for (const int64_t until = std::min(t + ahead_, end_); asked_ < until; ++asked_) {
            const char * p = reinterpret_cast<const char *>(slice_(asked_));
            for (int64_t b = 0; b < bytes_; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
        }
    }

private:
    Slice slice_;
    int64_t bytes_, end_, ahead_, asked_;
};

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// e^x on [-87, 88] (inputs clamped to it): range reduction to r in [-ln2/2, ln2/2], a
// degree-6 Taylor polynomial (relative error < 2e-7), and 2^n built in the exponent field.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// s[t] = e^(s[t] - max_s) for t < len, the unnormalised probabilities of a softmax; returns their sum.
inline float exp_shifted(float * s, int64_t len, float max_s) {
    const __m256 mv = _mm256_set1_ps(max_s);
    __m256 vsum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    float sum = hsum(vsum);
    for (; t < len; ++t) {
        s[t] = std::exp(s[t] - max_s);
        sum += s[t];
    }
    return sum;
}

// [sum(v[0]), ..., sum(v[7])]: eight horizontal sums in seven shuffling adds.
inline __m256 reduce8(const __m256 * v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit lane
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

}  // namespace lmd::cpu::avx2
