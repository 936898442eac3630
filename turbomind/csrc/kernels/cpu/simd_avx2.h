// Element helpers of the AVX2 kernels: 16-bit float types, eight-wide loads and stores as
// float32, scalar conversions for tails, horizontal sums. Include only from translation
// units compiled with -mavx2 -mfma -mf16c (kernels_avx2.cc, quant_avx2.cc).
#pragma once

#include <immintrin.h>

#include "core/tensor.h"

namespace turbomind::cpu::avx2 {

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
inline void store8(bf16 * p, __m256 v) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    for (int i = 0; i < 8; ++i) p[i].bits = f32_to_bf16(tmp[i]);
}
inline void store8(f16 * p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

}  // namespace turbomind::cpu::avx2
