// Scalar reference kernels: the plainest loops that define each kernel's result.
#include <cmath>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace turbomind::cpu::ref {

void linear_rows(const TensorView & x, const TensorView & w, const TensorView * bias, const TensorView & y,
                 int64_t n0, int64_t n1) {
    const int64_t M = x.size(0), K = x.size(1);
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = n0; n < n1; ++n) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) {
                acc += load_f32(x.data, m * x.stride(0) + k, x.dtype) * load_f32(w.data, n * K + k, w.dtype);
            }
            if (bias) acc += load_f32(bias->data, n, bias->dtype);
            store_f32(y.data, m * y.stride(0) + n, y.dtype, acc);
        }
    }
}

void decode_attention_task(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                           const TensorView & block_tables, const TensorView & context_lens, float scale,
                           const TensorView & out, int64_t b, int64_t kv_head, float * scores) {
    const int64_t num_heads = q.size(1), D = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t len = context_lens.ptr<int32_t>()[b];
    const int32_t * table = block_tables.ptr<int32_t>() + b * block_tables.stride(0);
    const DType dt = k_cache.dtype;
    auto cache_index = [&](int64_t t, int64_t d) {
        return ((table[t / block_size] * block_size + t % block_size) * num_kv_heads + kv_head) * D + d;
    };
    for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv_head * group + g;
        const int64_t q_off = b * q.stride(0) + h * q.stride(1);
        float max_s = -INFINITY;
        for (int64_t t = 0; t < len; ++t) {
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) {
                s += load_f32(q.data, q_off + d, q.dtype) * load_f32(k_cache.data, cache_index(t, d), dt);
            }
            scores[t] = s * scale;
            max_s = std::fmax(max_s, scores[t]);
        }
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
            scores[t] = std::exp(scores[t] - max_s);
            sum += scores[t];
        }
        const int64_t o_off = b * out.stride(0) + h * out.stride(1);
        for (int64_t d = 0; d < D; ++d) {
            float acc = 0.f;
            for (int64_t t = 0; t < len; ++t) acc += scores[t] * load_f32(v_cache.data, cache_index(t, d), dt);
            store_f32(out.data, o_off + d, out.dtype, acc / sum);
        }
    }
}

}  // namespace turbomind::cpu::ref

namespace turbomind::cpu::ref {

void rms_norm_row(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
                  const TensorView * residual, int64_t m) {
    const int64_t H = x.size(1);
    const DType dt = x.dtype;
    const void * src = x.data;
    int64_t src_off = m * x.stride(0);
    if (residual) {  // the sum is rounded to the model dtype, as `residual + x` would be
        const int64_t r_off = m * residual->stride(0);
        for (int64_t i = 0; i < H; ++i) {
            store_f32(residual->data, r_off + i, dt, load_f32(residual->data, r_off + i, dt) + load_f32(x.data, src_off + i, dt));
        }
        src = residual->data;
        src_off = r_off;
    }
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) {
        const float v = load_f32(src, src_off + i, dt);
        ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) {
        // normalise in float32, round to the dtype, then scale (HF LlamaRMSNorm)
        const float n = load_f32(src, src_off + i, dt) * inv;
        float rounded = n;
        if (dt != DType::f32) {
            uint16_t tmp;
            store_f32(&tmp, 0, dt, n);
            rounded = load_f32(&tmp, 0, dt);
        }
        store_f32(out.data, m * out.stride(0) + i, dt, load_f32(w.data, i, dt) * rounded);
    }
}

void rope_fill_kv_row(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                      const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                      const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, int64_t t) {
    const int64_t D = q_out.size(2), rot = cos_sin.size(1), half = rot / 2;
    const DType dt = qkv.dtype;
    const int64_t pos = positions.ptr<int64_t>()[t];
    const int64_t slot = slots.ptr<int64_t>()[t];
    const int64_t cs = pos * cos_sin.stride(0);
    const int64_t row = t * qkv.stride(0);
    auto rotate = [&](int64_t src, void * dst, int64_t dst_off) {
        for (int64_t i = 0; i < half; ++i) {
            const float c = load_f32(cos_sin.data, cs + i, dt), s = load_f32(cos_sin.data, cs + half + i, dt);
            const float x1 = load_f32(qkv.data, src + i, dt), x2 = load_f32(qkv.data, src + half + i, dt);
            store_f32(dst, dst_off + i, dt, x1 * c - x2 * s);
            store_f32(dst, dst_off + half + i, dt, x2 * c + x1 * s);
        }
        for (int64_t i = rot; i < D; ++i) store_f32(dst, dst_off + i, dt, load_f32(qkv.data, src + i, dt));
    };
    for (int64_t h = 0; h < num_heads; ++h) rotate(row + h * D, q_out.data, t * q_out.stride(0) + h * q_out.stride(1));
    const int64_t k0 = row + num_heads * D, v0 = k0 + num_kv_heads * D;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = (slot * num_kv_heads + h) * D;
        rotate(k0 + h * D, k_cache.data, dst);
        for (int64_t i = 0; i < D; ++i) store_f32(v_cache.data, dst + i, dt, load_f32(qkv.data, v0 + h * D + i, dt));
    }
}

void silu_and_mul_row(const TensorView & x, const TensorView & out, int64_t m) {
    const int64_t I = out.size(1);
    const DType dt = x.dtype;
    for (int64_t i = 0; i < I; ++i) {
        const float g = load_f32(x.data, m * x.stride(0) + i, dt), u = load_f32(x.data, m * x.stride(0) + I + i, dt);
        store_f32(out.data, m * out.stride(0) + i, dt, g / (1.f + std::exp(-g)) * u);
    }
}

}  // namespace turbomind::cpu::ref
