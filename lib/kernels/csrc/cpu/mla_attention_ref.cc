// Scalar reference of the latent attention (mla_attention.h): the plainest loops that define it.
#include <cmath>

#include "cpu/mla_attention.h"

namespace lmd::cpu::ref {

void latent_attention_task(const TensorView & q, const TensorView & cache, const int32_t * table,
                           int64_t len, float scale, const TensorView & out, int64_t b, int64_t h, float * scores,
                           float * acc) {
    const int64_t D = q.size(2), v_dim = out.size(2), block_size = cache.size(1);
    const int64_t q_off = b * q.stride(0) + h * q.stride(1);
    auto row = [&](int64_t t) {  // element offset of token t's cached row
        return (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * D;
    };
    float max_s = -INFINITY;
    for (int64_t t = 0; t < len; ++t) {
        float s = 0.f;
        const int64_t r = row(t);
        for (int64_t d = 0; d < D; ++d) s += load_f32(q.data, q_off + d, q.dtype) * load_f32(cache.data, r + d, cache.dtype);
        scores[t] = s * scale;
        max_s = std::fmax(max_s, scores[t]);
    }
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
        scores[t] = std::exp(scores[t] - max_s);
        sum += scores[t];
    }
    for (int64_t d = 0; d < v_dim; ++d) acc[d] = 0.f;
    for (int64_t t = 0; t < len; ++t) {  // the values: the first v_dim dims of each row
        const int64_t r = row(t);
        for (int64_t d = 0; d < v_dim; ++d) acc[d] += scores[t] * load_f32(cache.data, r + d, cache.dtype);
    }
    const int64_t o_off = b * out.stride(0) + h * out.stride(1);
    for (int64_t d = 0; d < v_dim; ++d) store_f32(out.data, o_off + d, out.dtype, acc[d] / sum);
}

}  // namespace lmd::cpu::ref
