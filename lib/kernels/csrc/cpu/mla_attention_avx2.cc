// AVX2/FMA/F16C latent attention (mla_attention.h); compiled with those flags, called by the
// dispatch (mla_attention.cc) only on a CPU that has them. Scores eight tokens to one reduction;
// the output accumulates in float32 scratch, as the latent (v_dim, 512 in DeepSeek-V2) is too wide
// for registers.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "cpu/mla_attention.h"
#include "cpu/simd_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

template <typename T>
void latent_attention_t(const TensorView & q, const TensorView & cache, const int32_t * table, int64_t len,
                        float scale, const TensorView & out, int64_t b, int64_t h, float * s, float * acc) {
    // s: len scores; acc: D floats
    const int64_t D = q.size(2), v_dim = out.size(2), block_size = cache.size(1);
    const T * qh = q.ptr<T>() + b * q.stride(0) + h * q.stride(1);
    const T * kc = cache.ptr<T>();
    // the query scaled once, in float32, in acc's D floats: the scores are done before acc sums the values
    float * qs = acc;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(qs + d, _mm256_mul_ps(load8(qh + d), vscale));
    auto dot = [&](const T * kt) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qs), load8(kt));
        for (int64_t d = 8; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qs + d), load8(kt + d), a);
        return a;
    };
    // scores, run by run of tokens in one block
    for (int64_t t0 = 0; t0 < len;) {
        const T * kb = kc + (static_cast<int64_t>(table[t0 / block_size]) * block_size + t0 % block_size) * D;
        const int64_t tn = std::min(block_size - t0 % block_size, len - t0);
        int64_t t = 0;
        for (; t + 8 <= tn; t += 8) {
            __m256 a[8];
            for (int j = 0; j < 8; ++j) a[j] = dot(kb + (t + j) * D);
            _mm256_storeu_ps(s + t0 + t, reduce8(a));
        }
        for (; t < tn; ++t) s[t0 + t] = hsum(dot(kb + t * D));
        t0 += tn;
    }
    float max_s = -INFINITY;
    for (int64_t t = 0; t < len; ++t) max_s = std::fmax(max_s, s[t]);
    const float sum = exp_shifted(s, len, max_s);  // unnormalised probabilities; the sum divides once
    for (int64_t d = 0; d < v_dim; d += 8) _mm256_storeu_ps(acc + d, _mm256_setzero_ps());
    for (int64_t t0 = 0; t0 < len;) {
        const T * vb = kc + (static_cast<int64_t>(table[t0 / block_size]) * block_size + t0 % block_size) * D;
        const int64_t tn = std::min(block_size - t0 % block_size, len - t0);
        for (int64_t tt = 0; tt < tn; ++tt) {
            const __m256 p = _mm256_set1_ps(s[t0 + tt]);
            const T * vt = vb + tt * D;
            for (int64_t d = 0; d < v_dim; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p, load8(vt + d), _mm256_loadu_ps(acc + d)));
        }
        t0 += tn;
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    T * oh = out.ptr<T>() + b * out.stride(0) + h * out.stride(1);
    for (int64_t d = 0; d < v_dim; d += 8) store8(oh + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), inv));
}

}  // namespace

void latent_attention_task(const TensorView & q, const TensorView & cache, const int32_t * table, int64_t len,
                           float scale, const TensorView & out, int64_t b, int64_t h, float * scores, float * acc) {
    switch (q.dtype) {
        case DType::f32: latent_attention_t<float>(q, cache, table, len, scale, out, b, h, scores, acc); break;
        case DType::bf16: latent_attention_t<bf16>(q, cache, table, len, scale, out, b, h, scores, acc); break;
        case DType::f16: latent_attention_t<f16>(q, cache, table, len, scale, out, b, h, scores, acc); break;
        default: break;
    }
}

}  // namespace lmd::cpu::avx2
