// Dispatch and threading of the GGUF block matmuls: shape checks live in the bindings
// (bindings/gguf.cc), the arithmetic in gguf_ref.cc / gguf_avx2.cc.
#include "cpu/gguf.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"
#include "cpu/quant.h"

namespace lmd::cpu {

namespace {

// Below ~64k multiply-adds a second thread costs more than it saves.
int matmul_threads(int64_t M, int64_t N, int64_t K) {
    return static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, M * N * K >> 16)));
}

}  // namespace

void gguf_dequantize(const TensorView & raw, int type, const TensorView & out, bool reference) {
    const int64_t N = out.size(0), K = out.size(1);
    const int threads = static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, N * K >> 16)));
    parallel_ranges(threads, N, 1, [&](int64_t n0, int64_t n1) {
        if (reference || !isa_at_least(Isa::avx2)) {
            ref::gguf_dequantize_rows(raw, type, out, n0, n1);
        } else {
            avx2::gguf_dequantize_rows(raw.ptr<uint8_t>(), type, K, out.ptr<float>(), n0, n1);
        }
    });
}

int gguf_w8a16_group(int type) {
    switch (static_cast<GgufType>(type)) {
        case GgufType::Q4_0:
        case GgufType::Q5_0:
        case GgufType::Q8_0:
        case GgufType::IQ4_NL: return 32;
        case GgufType::Q6_K: return 16;
        default: return 0;
    }
}

void gguf_to_w8a16(const TensorView & raw, int type, const TensorView & qweight, const TensorView & scales) {
    const GgufTypeInfo t = gguf_type_info(type);
    const int64_t N = qweight.size(0), K = qweight.size(1), row_bytes = raw.size(1);
    const int G = gguf_w8a16_group(type), QK = t.block_values;
    parallel_ranges(static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, N * K >> 16))), N, 1,
                    [&](int64_t n0, int64_t n1) {
        std::vector<int32_t> q(QK);
        float s[16], m[16];
        for (int64_t n = n0; n < n1; ++n) {
            int8_t * qn = qweight.ptr<int8_t>() + n * K;
            float * sn = scales.ptr<float>() + n * (K / G);
            for (int64_t b = 0; b < K / QK; ++b) {
                const int o = ref::gguf_block(type, raw.ptr<uint8_t>() + n * row_bytes + b * t.block_bytes, q.data(), s, m);
                for (int k = 0; k < QK; ++k) qn[b * QK + k] = static_cast<int8_t>(q[k] - o);
                for (int g = 0; g < QK / G; ++g) sn[b * (QK / G) + g] = s[g * G / 16];
            }
        }
    });
}

void linear_gguf(const TensorView & x, const TensorView & raw, int type, const TensorView * bias,
                 const TensorView & y, bool int8_activations, bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = raw.size(0);
    if (M == 0 || N == 0) return;
    const int threads = matmul_threads(M, N, K);
    if (reference || !isa_at_least(Isa::avx2)) {
        parallel(threads, [&](int t, int nt) {
            ref::linear_gguf_rows(x, raw, type, bias, y, int8_activations, N * t / nt, N * (t + 1) / nt);
        });
        return;
    }
    std::vector<float> xf(M * K);  // x widened once, not once per weight row
    avx2::widen_rows(x, 0, M, xf.data());
    const uint8_t * w = raw.ptr<uint8_t>();
    const float * b = bias ? bias->ptr<float>() : nullptr;
    if (!int8_activations) {
        parallel_ranges(threads, N, 4, [&](int64_t n0, int64_t n1) {
            avx2::linear_gguf_a16_rows(xf.data(), K, M, K, w, type, b, y, n0, n1);
        });
        return;
    }
    std::vector<int8_t> xq(M * K);
    std::vector<float> dx(M * (K / 32)), sb(M * (K / 32));
    std::vector<int32_t> sl(M * (K / 32) * 8);
    avx2::q8_prepare_rows(xf.data(), K, K, 0, M, xq.data(), dx.data());
    avx2::gguf_a8_prepare(xq.data(), dx.data(), M, K, sl.data(), sb.data());
    parallel_ranges(threads, N, 4, [&](int64_t n0, int64_t n1) {
        avx2::linear_gguf_a8_rows(xq.data(), dx.data(), sl.data(), sb.data(), M, K, w, type, b, y, n0, n1);
    });
}

}  // namespace lmd::cpu
