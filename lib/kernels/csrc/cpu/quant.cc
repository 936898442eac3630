// Dispatch and threading of the quantized matmuls: shape checks live in the bindings
// (bindings/quant.cc), the arithmetic in quant_ref.cc / quant_avx2.cc.
#include "cpu/quant.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace lmd::cpu {

namespace {

// Threads for an [M, K] x [N, K]ᵀ product: below ~64k multiply-adds a second thread costs
// more than it saves.
int matmul_threads(int64_t M, int64_t N, int64_t K) {
    return static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, M * N * K >> 16)));
}

}  // namespace

void linear_w4a16(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                  const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t group_size,
                  bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (M == 0 || N == 0) return;
    const int threads = matmul_threads(M, N, K);
    if (reference || !isa_at_least(Isa::avx2)) {
        parallel(threads, [&](int t, int nt) {
            ref::linear_w4a16_rows(x, qweight, scales, mins, bias, y, group_size, N * t / nt, N * (t + 1) / nt);
        });
        return;
    }
    const int64_t K64 = (K + 63) / 64 * 64, num_groups = K / group_size;
    std::vector<float> xp(M * K64), xsum(M * num_groups);
    for (int64_t m = 0; m < M; ++m) avx2::w4a16_prepare_row(x, m, group_size, &xp[m * K64], &xsum[m * num_groups]);
    const avx2::W4A16Activations a{xp.data(), xsum.data(), M, K, K64, group_size};
    parallel_ranges(threads, N, 4, [&](int64_t n0, int64_t n1) {  // tiles of 4 (GEMV) and 2 columns
        avx2::linear_w4a16_rows(a, qweight, scales, mins, bias, y, n0, n1);
    });
}

namespace {

// The frame of the W8A16-layout matmuls: the reference's rows split across the threads, or x as
// float32 rows (16-bit activations widened once, not once per weight row) for
// avx2(xf, ldx, threads).
template <typename Ref, typename Avx2>
void w8_rows(const TensorView & x, const TensorView & qweight, bool reference, Ref && ref_rows, Avx2 && avx2) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (M == 0 || N == 0) return;
    const int threads = matmul_threads(M, N, K);
    if (reference || !isa_at_least(Isa::avx2)) {
        parallel(threads, [&](int t, int nt) { ref_rows(N * t / nt, N * (t + 1) / nt); });
        return;
    }
    const float * xf = x.ptr<float>();
    int64_t ldx = x.stride(0);
    std::vector<float> converted;
    if (x.dtype != DType::f32) {
        converted.resize(M * K);
        for (int64_t m = 0; m < M; ++m) avx2::w8a16_prepare_row(x, m, &converted[m * K]);
        xf = converted.data();
        ldx = K;
    }
    avx2(xf, ldx, threads);
}

}  // namespace

void linear_w8a16(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                  const TensorView * bias, const TensorView & y, int64_t group_size, bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    w8_rows(
        x, qweight, reference,
        [&](int64_t n0, int64_t n1) { ref::linear_w8a16_rows(x, qweight, scales, bias, y, group_size, n0, n1); },
        [&](const float * xf, int64_t ldx, int threads) {
            parallel_ranges(threads, N, 4, [&](int64_t n0, int64_t n1) {  // tiles of 4 (GEMV) and 2 columns
                avx2::linear_w8a16_rows(xf, ldx, M, K, qweight, scales, bias, y, group_size, n0, n1);
            });
        });
}

void linear_w8a8_group(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                       const TensorView * bias, const TensorView & y, int64_t group_size, bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    w8_rows(
        x, qweight, reference,
        [&](int64_t n0, int64_t n1) { ref::linear_w8a8_group_rows(x, qweight, scales, bias, y, group_size, n0, n1); },
        [&](const float * xf, int64_t ldx, int threads) {
            std::vector<int8_t> xq(M * K);
            std::vector<float> dx(M * (K / 32));
            avx2::q8_prepare_rows(xf, ldx, K, 0, M, xq.data(), dx.data());
            parallel_ranges(threads, N, 4, [&](int64_t n0, int64_t n1) {  // tiles of 4 (GEMV) and 2 columns
                avx2::linear_w8a8_group_rows(xq.data(), dx.data(), M, K, qweight, scales, bias, y, group_size, n0,
                                             n1);
            });
        });
}

void quantize_per_token(const TensorView & x, const TensorView & xq, const TensorView & sx, bool reference) {
    const int64_t M = x.size(0), K = x.size(1);
    const bool vector = !reference && isa_at_least(Isa::avx2);
    const int threads = static_cast<int>(std::min<int64_t>({num_threads(), M, std::max<int64_t>(1, M * K >> 14)}));
    parallel(threads, [&](int t, int nt) {
        for (int64_t m = M * t / nt; m < M * (t + 1) / nt; ++m) {
            int8_t * row = xq.ptr<int8_t>() + m * xq.stride(0);
            sx.ptr<float>()[m] = vector ? avx2::quantize_row(x, m, row) : ref::quantize_row(x, m, row);
        }
    });
}

void linear_w8a8(const TensorView & x, const TensorView & w, const TensorView & sw, const TensorView * bias,
                 const TensorView & y, bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    if (M == 0 || N == 0) return;
    const bool vector = !reference && isa_at_least(Isa::avx2);
    std::vector<int8_t> xq(M * K);
    std::vector<float> sx(M);
    for (int64_t m = 0; m < M; ++m) {
        sx[m] = vector ? avx2::quantize_row(x, m, &xq[m * K]) : ref::quantize_row(x, m, &xq[m * K]);
    }
    const int threads = matmul_threads(M, N, K);
    if (!vector) {
        parallel(threads, [&](int t, int nt) {
            ref::linear_w8a8_rows(xq.data(), sx.data(), M, K, w, sw, bias, y, N * t / nt, N * (t + 1) / nt);
        });
        return;
    }
    std::vector<int16_t> xw(xq.begin(), xq.end());  // widened once, not once per weight row
    parallel_ranges(threads, N, 12, [&](int64_t n0, int64_t n1) {  // tiles of 4 (GEMV) and 3 columns
        avx2::linear_w8a8_rows(xw.data(), sx.data(), M, K, w, sw, bias, y, n0, n1);
    });
}

}  // namespace lmd::cpu
