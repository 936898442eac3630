// Scalar reference kernels: the plainest loops that define each kernel's result.
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/kernels.h"

namespace lmd::cpu::ref {

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
                           float softcap, const float * sinks, const TensorView & out, const KVQuant * kv_quant,
                           int64_t b, int64_t first, int64_t kv_head, float * scores) {
    const int64_t num_heads = q.size(1), D = q.size(2);
    const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t len = context_lens.ptr<int32_t>()[b];
    const int32_t * table = block_tables.ptr<int32_t>() + b * block_tables.stride(0);
    const int64_t row_elems = k_cache.size(3);  // D, or D * bits / 8 bytes when quantized
    auto row = [&](int64_t t) {  // (token slot, kv_head) row index of the cache
        return (table[t / block_size] * block_size + t % block_size) * num_kv_heads + kv_head;
    };
    auto load = [&](const TensorView & cache, const TensorView * params, int64_t t, int64_t d) {
        const int64_t r = row(t);
        if (!params) return load_f32(cache.data, r * row_elems + d, cache.dtype);
        const float * p = params->ptr<float>() + r * 2;
        return static_cast<float>(kv_code(cache.ptr<uint8_t>() + r * row_elems, d, kv_quant->bits)) * p[0] + p[1];
    };
    const TensorView * kp = kv_quant ? &kv_quant->k_params : nullptr;
    const TensorView * vp = kv_quant ? &kv_quant->v_params : nullptr;
    for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv_head * group + g;
        const int64_t q_off = b * q.stride(0) + h * q.stride(1);
        float max_s = -INFINITY;
        for (int64_t t = first; t < len; ++t) {
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += load_f32(q.data, q_off + d, q.dtype) * load(k_cache, kp, t, d);
            scores[t - first] = softcap > 0.f ? softcap * std::tanh(s * scale / softcap) : s * scale;
            max_s = std::fmax(max_s, scores[t - first]);
        }
        // a sink (gpt-oss): one more logit in the softmax's denominator, a key without a value
        if (sinks) max_s = std::fmax(max_s, sinks[h]);
        float sum = sinks ? std::exp(sinks[h] - max_s) : 0.f;
        for (int64_t t = first; t < len; ++t) {
            scores[t - first] = std::exp(scores[t - first] - max_s);
            sum += scores[t - first];
        }
        const int64_t o_off = b * out.stride(0) + h * out.stride(1);
        for (int64_t d = 0; d < D; ++d) {
            float acc = 0.f;
            for (int64_t t = first; t < len; ++t) acc += scores[t - first] * load(v_cache, vp, t, d);
            store_f32(out.data, o_off + d, out.dtype, acc / sum);
        }
    }
}

}  // namespace lmd::cpu::ref

namespace lmd::cpu::ref {

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
                      const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, const KVQuant * kv_quant,
                      int64_t t) {
    const int64_t D = q_out.size(2), rot = cos_sin.size(1), half = rot / 2;
    const DType dt = qkv.dtype;
    const int64_t pos = positions.ptr<int64_t>()[t];
    const int64_t slot = slots.ptr<int64_t>()[t];
    const int64_t cs = pos * cos_sin.stride(0);
    const int64_t row = t * qkv.stride(0);
    // head `src` of qkv, rotated, as float32 into f[D]
    auto rotate = [&](int64_t src, float * f) {
        for (int64_t i = 0; i < half; ++i) {
            const float c = load_f32(cos_sin.data, cs + i, dt), s = load_f32(cos_sin.data, cs + half + i, dt);
            const float x1 = load_f32(qkv.data, src + i, dt), x2 = load_f32(qkv.data, src + half + i, dt);
            f[i] = x1 * c - x2 * s;
            f[half + i] = x2 * c + x1 * s;
        }
        for (int64_t i = rot; i < D; ++i) f[i] = load_f32(qkv.data, src + i, dt);
    };
    static thread_local std::vector<float> f;  // one rotated head; runs per token and layer, so no allocation
    f.resize(D);
    for (int64_t h = 0; h < num_heads; ++h) {
        rotate(row + h * D, f.data());
        const int64_t dst = t * q_out.stride(0) + h * q_out.stride(1);
        for (int64_t i = 0; i < D; ++i) store_f32(q_out.data, dst + i, dt, f[i]);
    }
    const int64_t k0 = row + num_heads * D, v0 = k0 + num_kv_heads * D;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t r = slot * num_kv_heads + h;  // the (slot, head) row of the caches
        for (int pass = 0; pass < 2; ++pass) {      // k, then v
            if (pass == 0) {
                rotate(k0 + h * D, f.data());
            } else {
                for (int64_t i = 0; i < D; ++i) f[i] = load_f32(qkv.data, v0 + h * D + i, dt);
            }
            const TensorView & cache = pass == 0 ? k_cache : v_cache;
            if (kv_quant) {
                const TensorView & params = pass == 0 ? kv_quant->k_params : kv_quant->v_params;
                kv_quantize_row(f.data(), D, kv_quant->bits, cache.ptr<uint8_t>() + r * cache.size(3),
                                params.ptr<float>() + r * 2);
            } else {
                for (int64_t i = 0; i < D; ++i) store_f32(cache.data, r * D + i, dt, f[i]);
            }
        }
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

void gelu_tanh_and_mul_row(const TensorView & x, const TensorView & out, int64_t m) {
    const int64_t I = out.size(1);
    const DType dt = x.dtype;
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    for (int64_t i = 0; i < I; ++i) {
        const float g = load_f32(x.data, m * x.stride(0) + i, dt), u = load_f32(x.data, m * x.stride(0) + I + i, dt);
        const float gelu = 0.5f * g * (1.f + std::tanh(kSqrt2OverPi * (g + 0.044715f * g * g * g)));
        store_f32(out.data, m * out.stride(0) + i, dt, gelu * u);
    }
}

}  // namespace lmd::cpu::ref

namespace lmd::cpu {

void kv_quantize_row(const float * x, int64_t D, int bits, uint8_t * q, float * params) {
    float lo = x[0], hi = x[0];
    for (int64_t d = 1; d < D; ++d) {
        lo = std::fmin(lo, x[d]);
        hi = std::fmax(hi, x[d]);
    }
    const int qmax = (1 << bits) - 1;
    const float scale = (hi - lo) / static_cast<float>(qmax);
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    if (bits == 4) std::memset(q, 0, D / 2);
    for (int64_t d = 0; d < D; ++d) {
        const float c = std::nearbyint((x[d] - lo) * inv);
        const int code = c < 0.f ? 0 : c > static_cast<float>(qmax) ? qmax : static_cast<int>(c);
        if (bits == 8) {
            q[d] = static_cast<uint8_t>(code);
        } else {
            q[d >> 1] |= static_cast<uint8_t>(code << ((d & 1) << 2));
        }
    }
    params[0] = scale;
    params[1] = lo;
}

}  // namespace lmd::cpu
