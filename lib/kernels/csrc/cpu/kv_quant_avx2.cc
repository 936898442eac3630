// Paged attention over a quantized KV cache (quant_policy 8 / 4; layout in kernels.h,
// KVQuant). The codes are never dequantized element by element: with x = c * scale + zero,
//   q · k   = scale_k * (q · c_k) + zero_k * sum(q)
//   Σ p v   = Σ (p scale_v) c_v + Σ p zero_v
// so each token costs one integer-to-float convert per element and two scalars.
// Compiled with -mavx2 -mfma -mf16c; called only where the CPU has them.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "cpu/kernels.h"
#include "cpu/simd_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

// Eight codes, elements 8i..8i+7 of a row, as float32.
template <int BITS>
inline __m256 load_codes(const uint8_t * row, int64_t i);

template <>
inline __m256 load_codes<8>(const uint8_t * row, int64_t i) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(row + 8 * i));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

template <>
inline __m256 load_codes<4>(const uint8_t * row, int64_t i) {
    int32_t word;
    std::memcpy(&word, row + 4 * i, 4);  // four bytes, eight nibbles, low nibble first
    const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi32_si128(word),
                                         _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
    __m256i w = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xF)));
}

// As decode_attention_t in kernels_avx2.cc: one sequence, one KV head and its query heads.
template <typename T, int BITS, int NV>
void attention_t(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                 const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                 const float * sinks, const TensorView & out, const KVQuant & kvq, int64_t b, int64_t first, int64_t kv_head, float * scratch) {
    const int64_t num_heads = q.size(1), D = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t len = context_lens.ptr<int32_t>()[b];
    const int32_t * table = block_tables.ptr<int32_t>() + b * block_tables.stride(0);
    const int64_t row_bytes = D * BITS / 8;
    const int64_t nv = NV ? NV : D / 8;
    constexpr int kRegs = NV ? NV : kMaxHeadDim / 8;
    // (token t, kv_head): its codes and its (scale, zero)
    auto row_of = [&](int64_t t) {
        return (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * num_kv_heads + kv_head;
    };
    const uint8_t * kc = k_cache.ptr<uint8_t>();
    const uint8_t * vc = v_cache.ptr<uint8_t>();
    const float * kp = kvq.k_params.ptr<float>();
    const float * vp = kvq.v_params.ptr<float>();
    const __m256 vscale = _mm256_set1_ps(scale);

    for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv_head * group + g;
        const T * qh = q.ptr<T>() + b * q.stride(0) + h * q.stride(1);
        __m256 qv[kRegs];
        __m256 qs = _mm256_setzero_ps();
        for (int64_t i = 0; i < nv; ++i) {
            qv[i] = _mm256_mul_ps(load8(qh + 8 * i), vscale);
            qs = _mm256_add_ps(qs, qv[i]);
        }
        const float qsum = hsum(qs);
        auto dot = [&](const uint8_t * codes) {
            __m256 a = _mm256_mul_ps(qv[0], load_codes<BITS>(codes, 0));
            for (int64_t i = 1; i < nv; ++i) a = _mm256_fmadd_ps(qv[i], load_codes<BITS>(codes, i), a);
            return a;
        };
        float * s = scratch + g * (len - first);  // s[i]: the score of token first + i
        int64_t t = first;
        for (; t + 8 <= len; t += 8) {  // eight tokens share one reduction
            __m256 a[8];
            for (int j = 0; j < 8; ++j) a[j] = dot(kc + row_of(t + j) * row_bytes);
            _mm256_storeu_ps(s + (t - first), reduce8(a));
        }
        for (; t < len; ++t) s[t - first] = hsum(dot(kc + row_of(t) * row_bytes));
        float max_s = -INFINITY;
        for (t = first; t < len; ++t) {
            const float * p = kp + row_of(t) * 2;
            s[t - first] = s[t - first] * p[0] + p[1] * qsum;
            if (softcap > 0.f) s[t - first] = softcap * std::tanh(s[t - first] / softcap);  // Gemma 2
            max_s = std::fmax(max_s, s[t - first]);
        }
        if (sinks) max_s = std::fmax(max_s, sinks[h]);  // the sink's logit joins the softmax (gpt-oss)
        const float sum = exp_shifted(s, len - first, max_s) + (sinks ? std::exp(sinks[h] - max_s) : 0.f);
        __m256 acc[kRegs];
        for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_setzero_ps();
        float zero_acc = 0.f;
        for (t = first; t < len; ++t) {
            const int64_t r = row_of(t);
            const float * p = vp + r * 2;
            const __m256 w = _mm256_set1_ps(s[t - first] * p[0]);
            zero_acc += s[t - first] * p[1];
            const uint8_t * codes = vc + r * row_bytes;
            for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_fmadd_ps(w, load_codes<BITS>(codes, i), acc[i]);
        }
        const __m256 inv = _mm256_set1_ps(1.f / sum);
        const __m256 z = _mm256_set1_ps(zero_acc);
        T * oh = out.ptr<T>() + b * out.stride(0) + h * out.stride(1);
        for (int64_t i = 0; i < nv; ++i) store8(oh + 8 * i, _mm256_mul_ps(_mm256_add_ps(acc[i], z), inv));
    }
}

template <typename T, int BITS>
void attention_d(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                 const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                 const float * sinks, const TensorView & out, const KVQuant & kvq, int64_t b, int64_t first, int64_t kv_head, float * scratch) {
    switch (q.size(2)) {
        case 64: attention_t<T, BITS, 8>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, kvq, b, first, kv_head, scratch); break;
        case 128: attention_t<T, BITS, 16>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, kvq, b, first, kv_head, scratch); break;
        default: attention_t<T, BITS, 0>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, kvq, b, first, kv_head, scratch); break;
    }
}

template <typename T>
void attention_bits(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                    const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                    const float * sinks, const TensorView & out, const KVQuant & kvq, int64_t b, int64_t first, int64_t kv_head, float * scratch) {
    if (kvq.bits == 8) {
        attention_d<T, 8>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, kvq, b, first, kv_head, scratch);
    } else {
        attention_d<T, 4>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, kvq, b, first, kv_head, scratch);
    }
}

}  // namespace

void decode_attention_quant_task(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                                 const TensorView & block_tables, const TensorView & context_lens, float scale, float softcap,
                                 const float * sinks, const TensorView & out, const KVQuant & kvq, int64_t b, int64_t first,
                                 int64_t kv_head, float * scratch) {
    switch (q.dtype) {
        case DType::f32: attention_bits<float>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, kvq, b, first, kv_head, scratch); break;
        case DType::bf16: attention_bits<bf16>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, kvq, b, first, kv_head, scratch); break;
        case DType::f16: attention_bits<f16>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, sinks, out, kvq, b, first, kv_head, scratch); break;
        default: break;
    }
}

}  // namespace lmd::cpu::avx2
