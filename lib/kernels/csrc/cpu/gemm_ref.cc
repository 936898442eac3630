// Scalar references of the packed matmuls: the plainest loops that define their results
// (one std::fma a k, in increasing k; see gemm.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/quant.h"

namespace lmd::cpu::ref {

void linear_packed_rows(const TensorView & x, const TensorView & packed, const TensorView * bias,
                        const TensorView & y, int64_t n0, int64_t n1) {
    const int64_t M = x.size(0), K = x.size(1);
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = n0; n < n1; ++n) {
            const int64_t base = n / kPanelWidth * K * kPanelWidth + n % kPanelWidth;
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) {
                acc = std::fma(load_f32(x.data, m * x.stride(0) + k, x.dtype),
                               load_f32(packed.data, base + k * kPanelWidth, packed.dtype), acc);
            }
            if (bias) acc += load_f32(bias->data, n, bias->dtype);
            store_f32(y.data, m * y.stride(0) + n, y.dtype, acc);
        }
    }
}

void linear_w4a16_packed_rows(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                              const TensorView & mpanels, const TensorView * bias, const TensorView & y, int64_t n0,
                              int64_t n1) {
    const int64_t M = x.size(0), K = x.size(1), num_groups = spanels.size(1), G = K / num_groups;
    const uint32_t * q = qpanels.ptr<uint32_t>();
    std::vector<float> xp(K), xsum(num_groups);
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < K; ++k) {
            const int j = static_cast<int>(k % 8);
            xp[k] = load_f32(x.data, m * x.stride(0) + k, x.dtype) * (j < 7 ? std::ldexp(1.f, -4 * j) : 1.f);
        }
        for (int64_t g = 0; g < num_groups; ++g) {
            float lane[8] = {};
            for (int64_t k = g * G; k < (g + 1) * G; ++k) lane[k % 8] += load_f32(x.data, m * x.stride(0) + k, x.dtype);
            xsum[g] = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
        }
        for (int64_t n = n0; n < n1; ++n) {
            const int64_t p = n / kW4A16PanelWidth, col = n % kW4A16PanelWidth;
            float t = 0.f, u = 0.f;
            for (int64_t g = 0; g < num_groups; ++g) {
                float d = 0.f;
                for (int64_t k = g * G; k < (g + 1) * G; ++k) {
                    const uint32_t word = q[(p * (K / 8) + k / 8) * kW4A16PanelWidth + col];
                    const int j = static_cast<int>(k % 8);
                    const uint32_t qp = j < 7 ? word & (0xFu << (4 * j)) : word >> 28;
                    d = std::fma(xp[k], static_cast<float>(qp), d);
                }
                const int64_t at = (p * num_groups + g) * kW4A16PanelWidth + col;
                t = std::fma(load_f32(spanels.data, at, spanels.dtype), d, t);
                u = std::fma(load_f32(mpanels.data, at, mpanels.dtype), xsum[g], u);
            }
            float v = t + u;
            if (bias) v += bias->ptr<float>()[n];
            store_f32(y.data, m * y.stride(0) + n, y.dtype, v);
        }
    }
}

void linear_w4a8_packed_rows(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                             const TensorView & mpanels, const TensorView * bias, const TensorView & y, int64_t n0,
                             int64_t n1) {
    const int64_t M = x.size(0), K = x.size(1), num_groups = spanels.size(1), G = K / num_groups;
    const uint32_t * q = qpanels.ptr<uint32_t>();
    std::vector<int32_t> xq(K);
    std::vector<float> dx(K / 32), xsum(num_groups);
    for (int64_t m = 0; m < M; ++m) {
        auto xk = [&](int64_t k) { return load_f32(x.data, m * x.stride(0) + k, x.dtype); };
        for (int64_t b = 0; b < K / 32; ++b) {
            float xb[32];
            for (int j = 0; j < 32; ++j) xb[j] = xk(32 * b + j);
            dx[b] = quantize_block32(xb, &xq[32 * b]);
            int32_t sum = 0;
            for (int64_t k = 32 * b; k < 32 * b + 32; ++k) sum += xq[k];
            const int64_t g = 32 * b / G;
            xsum[g] = std::fma(static_cast<float>(sum), dx[b], 32 * b % G ? xsum[g] : 0.f);
        }
        for (int64_t n = n0; n < n1; ++n) {
            const int64_t p = n / kW4A16PanelWidth, col = n % kW4A16PanelWidth;
            float t = 0.f, u = 0.f;
            for (int64_t g = 0; g < num_groups; ++g) {
                float d = 0.f;
                for (int64_t b = g * G / 32; b < (g + 1) * G / 32; ++b) {
                    int32_t dot = 0;
                    for (int64_t k = 32 * b; k < 32 * b + 32; ++k) {
                        const uint32_t word = q[(p * (K / 8) + k / 8) * kW4A16PanelWidth + col];
                        dot += static_cast<int32_t>((word >> (4 * (k % 8))) & 0xF) * xq[k];
                    }
                    d = std::fma(static_cast<float>(dot), dx[b], d);
                }
                const int64_t at = (p * num_groups + g) * kW4A16PanelWidth + col;
                t = std::fma(load_f32(spanels.data, at, spanels.dtype), d, t);
                u = std::fma(load_f32(mpanels.data, at, mpanels.dtype), xsum[g], u);
            }
            float v = t + u;
            if (bias) v += bias->ptr<float>()[n];
            store_f32(y.data, m * y.stride(0) + n, y.dtype, v);
        }
    }
}

void linear_w8a16_packed_rows(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                              const TensorView * bias, const TensorView & y, int64_t n0, int64_t n1) {
    const int64_t M = x.size(0), K = x.size(1), num_groups = spanels.size(1), G = K / num_groups;
    const int8_t * q = qpanels.ptr<int8_t>();
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = n0; n < n1; ++n) {
            const int64_t p = n / kPanelWidth, col = n % kPanelWidth;
            float t = 0.f;
            for (int64_t g = 0; g < num_groups; ++g) {
                float d = 0.f;
                for (int64_t k = g * G; k < (g + 1) * G; ++k) {
                    d = std::fma(load_f32(x.data, m * x.stride(0) + k, x.dtype),
                                 static_cast<float>(q[(p * K + k) * kPanelWidth + col]), d);
                }
                t = std::fma(load_f32(spanels.data, (p * num_groups + g) * kPanelWidth + col, spanels.dtype), d, t);
            }
            if (bias) t += bias->ptr<float>()[n];
            store_f32(y.data, m * y.stride(0) + n, y.dtype, t);
        }
    }
}

}  // namespace lmd::cpu::ref
