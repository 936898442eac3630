// Scalar reference of the quantized matmuls: the plainest loops that define their results.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/quant.h"

namespace lmd::cpu::ref {

void linear_w4a16_rows(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                       const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t group_size,
                       int64_t n0, int64_t n1) {
    const int64_t M = x.size(0), K = x.size(1), G = group_size, num_groups = K / G;
    const uint8_t * q = qweight.ptr<uint8_t>();
    const float * s = scales.ptr<float>();
    const float * mn = mins.ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
        const int64_t xo = m * x.stride(0);
        for (int64_t n = n0; n < n1; ++n) {
            float acc = 0.f;
            for (int64_t g = 0; g < num_groups; ++g) {
                float dot = 0.f, sum = 0.f;
                for (int64_t k = g * G; k < (g + 1) * G; ++k) {
                    const uint8_t byte = q[n * (K / 2) + k / 2];
                    const int qk = k % 2 == 0 ? byte & 0xF : byte >> 4;
                    const float xk = load_f32(x.data, xo + k, x.dtype);
                    dot += static_cast<float>(qk) * xk;
                    sum += xk;
                }
                acc += s[n * num_groups + g] * dot + mn[n * num_groups + g] * sum;
            }
            if (bias) acc += bias->ptr<float>()[n];
            store_f32(y.data, m * y.stride(0) + n, y.dtype, acc);
        }
    }
}

void linear_w8a16_rows(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                       const TensorView * bias, const TensorView & y, int64_t group_size, int64_t n0, int64_t n1) {
    const int64_t M = x.size(0), K = x.size(1), G = group_size, num_groups = K / G;
    const int8_t * q = qweight.ptr<int8_t>();
    const float * s = scales.ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
        const int64_t xo = m * x.stride(0);
        for (int64_t n = n0; n < n1; ++n) {
            float acc = 0.f;
            for (int64_t g = 0; g < num_groups; ++g) {
                float dot = 0.f;
                for (int64_t k = g * G; k < (g + 1) * G; ++k) {
                    dot += static_cast<float>(q[n * K + k]) * load_f32(x.data, xo + k, x.dtype);
                }
                acc += s[n * num_groups + g] * dot;
            }
            if (bias) acc += bias->ptr<float>()[n];
            store_f32(y.data, m * y.stride(0) + n, y.dtype, acc);
        }
    }
}

float quantize_row(const TensorView & x, int64_t m, int8_t * xq) {
    const int64_t K = x.size(1), xo = m * x.stride(0);
    float absmax = 0.f;
    for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::fabs(load_f32(x.data, xo + k, x.dtype)));
    const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
    for (int64_t k = 0; k < K; ++k) {
        const float v = std::nearbyint(load_f32(x.data, xo + k, x.dtype) * inv);  // to nearest, ties to even
        xq[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
    }
    return absmax / 127.f;
}

void linear_w8a8_rows(const int8_t * xq, const float * sx, int64_t M, int64_t K, const TensorView & w,
                      const TensorView & sw, const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1) {
    const int8_t * wp = w.ptr<int8_t>();
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = n0; n < n1; ++n) {
            int32_t acc = 0;
            for (int64_t k = 0; k < K; ++k) acc += static_cast<int32_t>(xq[m * K + k]) * wp[n * K + k];
            float v = static_cast<float>(acc) * sx[m] * sw.ptr<float>()[n];
            if (bias) v += bias->ptr<float>()[n];
            store_f32(y.data, m * y.stride(0) + n, y.dtype, v);
        }
    }
}

float quantize_block32(const float * x, int32_t * q) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; ++j) q[j] = std::clamp(static_cast<int32_t>(std::nearbyint(x[j] * id)), -127, 127);
    return d;
}

void linear_w8a8_group_rows(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                            const TensorView * bias, const TensorView & y, int64_t group_size, int64_t n0, int64_t n1) {
    const int64_t M = x.size(0), K = x.size(1), num_groups = K / group_size;
    const int8_t * q = qweight.ptr<int8_t>();
    const float * s = scales.ptr<float>();
    std::vector<int32_t> xq(K);
    std::vector<float> dx(K / 32);
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t b = 0; b < K / 32; ++b) {
            float xb[32];
            for (int j = 0; j < 32; ++j) xb[j] = load_f32(x.data, m * x.stride(0) + 32 * b + j, x.dtype);
            dx[b] = quantize_block32(xb, &xq[32 * b]);
        }
        for (int64_t n = n0; n < n1; ++n) {
            float lane[8] = {};
            for (int64_t b = 0; b < K / 32; ++b) {
                const float c = s[n * num_groups + 32 * b / group_size] * dx[b];
                for (int l = 0; l < 8; ++l) {
                    int32_t dot = 0;
                    for (int64_t k = 32 * b + 4 * l; k < 32 * b + 4 * l + 4; ++k) dot += q[n * K + k] * xq[k];
                    lane[l] = std::fma(static_cast<float>(dot), c, lane[l]);
                }
            }
            float v = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
            if (bias) v += bias->ptr<float>()[n];
            store_f32(y.data, m * y.stride(0) + n, y.dtype, v);
        }
    }
}

}  // namespace lmd::cpu::ref
