// Scalar reference of the GGUF block matmuls (gguf.h): each block decoded as llama.cpp's
// dequantize_row_* reads it, then the plainest loops that define the two products.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/gguf.h"
#include "cpu/quant.h"

namespace lmd::cpu {

GgufTypeInfo gguf_type_info(int type) {
    switch (static_cast<GgufType>(type)) {
        case GgufType::Q4_0: return {32, 18};
        case GgufType::Q4_1: return {32, 20};
        case GgufType::Q5_0: return {32, 22};
        case GgufType::Q5_1: return {32, 24};
        case GgufType::Q8_0: return {32, 34};
        case GgufType::Q4_K: return {256, 144};
        case GgufType::Q5_K: return {256, 176};
        case GgufType::Q6_K: return {256, 210};
        case GgufType::IQ4_NL: return {32, 18};
    }
    return {0, 0};
}

namespace ref {

namespace {

float half(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return f16_to_f32(h);
}

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K block's 12 scale bytes.
void scale_min_k4(int j, const uint8_t * sc, int & scale, int & min) {
    if (j < 4) {
        scale = sc[j] & 63;
        min = sc[j + 4] & 63;
    } else {
        scale = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// The 32 values of a Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL block from its 16 nibble bytes and
// (for the 5-bit types) its 32 high bits.
void nibbles(const uint8_t * qs, uint32_t qh, int32_t * q) {
    for (int j = 0; j < 16; ++j) {
        q[j] = (qs[j] & 0xF) | static_cast<int32_t>(((qh >> j) & 1) << 4);
        q[j + 16] = (qs[j] >> 4) | static_cast<int32_t>(((qh >> (j + 16)) & 1) << 4);
    }
}

}  // namespace

int gguf_block(int type, const uint8_t * b, int32_t * q, float * s, float * m) {
    auto legacy = [&](float scale, float min) { s[0] = s[1] = scale, m[0] = m[1] = min; };
    uint32_t qh = 0;
    switch (static_cast<GgufType>(type)) {
        case GgufType::Q4_0:
            nibbles(b + 2, 0, q);
            legacy(half(b), -8.f * half(b));
            return 8;
        case GgufType::Q4_1:
            nibbles(b + 4, 0, q);
            legacy(half(b), half(b + 2));
            return -1;
        case GgufType::Q5_0:
            std::memcpy(&qh, b + 2, 4);
            nibbles(b + 6, qh, q);
            legacy(half(b), -16.f * half(b));
            return 16;
        case GgufType::Q5_1:
            std::memcpy(&qh, b + 4, 4);
            nibbles(b + 8, qh, q);
            legacy(half(b), half(b + 2));
            return -1;
        case GgufType::Q8_0:
            for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(b[2 + j]);
            legacy(half(b), 0.f);
            return 0;
        case GgufType::IQ4_NL:
            nibbles(b + 2, 0, q);
            for (int j = 0; j < 32; ++j) q[j] = kIQ4NLValues[q[j]];
            legacy(half(b), 0.f);
            return 0;
        case GgufType::Q4_K:
        case GgufType::Q5_K: {
            const bool five = static_cast<GgufType>(type) == GgufType::Q5_K;
            const float d = half(b), dmin = half(b + 2);
            const uint8_t * sc = b + 4, * hi = b + 16, * qs = five ? b + 48 : b + 16;
            for (int j = 0; j < 8; ++j) {  // sub-block j: the low (j even) or high nibbles of qs[32 (j / 2) ..]
                int scale, min;
                scale_min_k4(j, sc, scale, min);
                s[2 * j] = s[2 * j + 1] = d * static_cast<float>(scale);
                m[2 * j] = m[2 * j + 1] = -(dmin * static_cast<float>(min));
                for (int l = 0; l < 32; ++l) {
                    const int nib = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
                    q[32 * j + l] = nib | (five ? ((hi[l] >> j) & 1) << 4 : 0);
                }
            }
            return -1;
        }
        case GgufType::Q6_K: {
            const uint8_t * ql = b, * qh6 = b + 128;
            const auto * sc = reinterpret_cast<const int8_t *>(b + 192);
            const float d = half(b + 208);
            for (int h = 0; h < 2; ++h) {  // halves of 128: four runs of 32 from 64 ql and 32 qh bytes
                for (int l = 0; l < 32; ++l) {
                    const uint8_t * L = ql + 64 * h, * H = qh6 + 32 * h;
                    int32_t * out = q + 128 * h;
                    out[l] = (L[l] & 0xF) | ((H[l] >> 0) & 3) << 4;
                    out[l + 32] = (L[l + 32] & 0xF) | ((H[l] >> 2) & 3) << 4;
                    out[l + 64] = (L[l] >> 4) | ((H[l] >> 4) & 3) << 4;
                    out[l + 96] = (L[l + 32] >> 4) | ((H[l] >> 6) & 3) << 4;
                }
            }
            for (int j = 0; j < 16; ++j) {
                s[j] = d * static_cast<float>(sc[j]);
                m[j] = -32.f * s[j];
            }
            return 32;
        }
    }
    return 0;
}

void gguf_dequantize_rows(const TensorView & raw, int type, const TensorView & out, int64_t n0, int64_t n1) {
    const GgufTypeInfo t = gguf_type_info(type);
    const int64_t K = out.size(1), row_bytes = raw.size(1);
    std::vector<int32_t> q(t.block_values);
    float s[16], m[16];
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t b = 0; b < K / t.block_values; ++b) {
            const int o = gguf_block(type, raw.ptr<uint8_t>() + n * row_bytes + b * t.block_bytes, q.data(), s, m);
            float * w = out.ptr<float>() + n * K + b * t.block_values;
            for (int k = 0; k < t.block_values; ++k) {
                w[k] = o < 0 ? std::fma(s[k / 16], static_cast<float>(q[k]), m[k / 16])
                             : s[k / 16] * static_cast<float>(q[k] - o);
            }
        }
    }
}

void linear_gguf_rows(const TensorView & x, const TensorView & raw, int type, const TensorView * bias,
                      const TensorView & y, bool int8_activations, int64_t n0, int64_t n1) {
    const GgufTypeInfo t = gguf_type_info(type);
    const int64_t M = x.size(0), K = x.size(1), QK = t.block_values, row_bytes = raw.size(1);
    std::vector<float> xf(K), dx(K / 32);
    std::vector<int32_t> xq(K), q(K);
    std::vector<float> s(K / 16), mn(K / 16), w(K);
    std::vector<int> offsets(K / QK);
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t b = 0; b < K / QK; ++b) {
            const int o = offsets[b] = gguf_block(type, raw.ptr<uint8_t>() + n * row_bytes + b * t.block_bytes, &q[b * QK],
                                     &s[b * QK / 16], &mn[b * QK / 16]);
            for (int64_t k = b * QK; k < (b + 1) * QK; ++k) {
                w[k] = o < 0 ? std::fma(s[k / 16], static_cast<float>(q[k]), mn[k / 16])
                             : s[k / 16] * static_cast<float>(q[k] - o);
            }
        }
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t k = 0; k < K; ++k) xf[k] = load_f32(x.data, m * x.stride(0) + k, x.dtype);
            float L[8] = {}, U = 0.f;
            if (!int8_activations) {
                for (int64_t k = 0; k < K; ++k) L[k % 8] = std::fma(xf[k], w[k], L[k % 8]);
            } else {
                for (int64_t b = 0; b < K / 32; ++b) dx[b] = quantize_block32(&xf[32 * b], &xq[32 * b]);
                for (int64_t b = 0; b < K / 32; ++b) {
                    const int o = offsets[b * 32 / QK];
                    int32_t block_sum = 0;
                    for (int l = 0; l < 8; ++l) {
                        const int64_t k0 = 32 * b + 4 * l;
                        int32_t dot = 0;
                        for (int64_t k = k0; k < k0 + 4; ++k) dot += (q[k] - std::max(o, 0)) * xq[k], block_sum += xq[k];
                        L[l] = std::fma(static_cast<float>(dot), s[k0 / 16] * dx[b], L[l]);
                    }
                    if (o < 0) U = std::fma(mn[2 * b], static_cast<float>(block_sum) * dx[b], U);
                }
            }
            float acc = (((L[0] + L[4]) + (L[2] + L[6])) + ((L[1] + L[5]) + (L[3] + L[7]))) + U;
            if (bias) acc += bias->ptr<float>()[n];
            store_f32(y.data, m * y.stride(0) + n, y.dtype, acc);
        }
    }
}

}  // namespace ref

}  // namespace lmd::cpu
