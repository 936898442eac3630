// AVX2 kernel of W8A8 by groups (quant.h): the W8A16 layout's int8 weights times activations
// quantized to int8 per 32 k, as llama.cpp multiplies Q8_0 by Q8_0. vpmaddubsw wants one
// unsigned operand: it gets |w| and x with w's sign (vpsignb), whose products are w x; pairs
// of them (at most 2 * 128 * 127 < 2^15) sum in 16 bits, vpmaddwd by ones gives each lane's
// four k in 32 bits, exactly. Each lane then keeps one fma chain over the blocks and the lanes
// are summed at the end (quant.h), so no tile shape changes a bit of y.
// Compiled with -mavx2 -mfma -mf16c; quant.cc calls into it only when the CPU has them.
#include <immintrin.h>

#include "cpu/quant.h"
#include "cpu/simd_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

inline __m256i load32(const int8_t * p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

// An MR x NR tile: rows m of xq (stride K) against weight rows r (stride K).
template <int MR, int NR, typename YT>
void tile(const int8_t * xq, const float * dx, int64_t K, int64_t G, const int8_t * q, const float * s,
          const float * bias, YT * y, int64_t ldy) {
    const int64_t nb = K / 32, ng = K / G;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 lane[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) lane[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i xv[MR];
        for (int m = 0; m < MR; ++m) xv[m] = load32(xq + m * K + 32 * b);
        for (int r = 0; r < NR; ++r) {
            const __m256i w = load32(q + r * K + 32 * b), aw = _mm256_abs_epi8(w);
            const float sr = s[r * ng + 32 * b / G];
            for (int m = 0; m < MR; ++m) {
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[m], w)), ones);
                lane[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sr * dx[m * nb + b]), lane[m][r]);
            }
        }
    }
    for (int m = 0; m < MR; ++m) {
        for (int r = 0; r < NR; ++r) {
            float v = hsum(lane[m][r]);
            if (bias) v += bias[r];
            store1(y + m * ldy + r, v);
        }
    }
}

template <typename YT>
void rows_t(const int8_t * xq, const float * dx, int64_t M, int64_t K, int64_t G, const int8_t * q, const float * s,
            const float * bias, YT * y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t ng = K / G, nb = K / 32;
    auto at = [&](const float * p, int64_t n) { return p ? p + n : nullptr; };
    if (M == 1) {  // GEMV: the next four weight rows load while these are summed
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) {
            if (n + 8 <= n1) prefetch_range(q + (n + 4) * K, 4 * K);
            tile<1, 4>(xq, dx, K, G, q + n * K, s + n * ng, at(bias, n), y + n, ldy);
        }
        for (; n < n1; ++n) tile<1, 1>(xq, dx, K, G, q + n * K, s + n * ng, at(bias, n), y + n, ldy);
        return;
    }
    constexpr int64_t kMBlock = 64;  // rows of xq that stay in L2 while the weight rows stream past
    for (int64_t mb = 0; mb < M; mb += kMBlock) {
        const int64_t me = mb + kMBlock < M ? mb + kMBlock : M;
        int64_t n = n0;
        for (; n + 2 <= n1; n += 2) {
            int64_t m = mb;
            for (; m + 2 <= me; m += 2) {
                tile<2, 2>(xq + m * K, dx + m * nb, K, G, q + n * K, s + n * ng, at(bias, n), y + m * ldy + n, ldy);
            }
            if (m < me) tile<1, 2>(xq + m * K, dx + m * nb, K, G, q + n * K, s + n * ng, at(bias, n), y + m * ldy + n, ldy);
        }
        for (; n < n1; ++n) {
            for (int64_t m = mb; m < me; ++m) {
                tile<1, 1>(xq + m * K, dx + m * nb, K, G, q + n * K, s + n * ng, at(bias, n), y + m * ldy + n, ldy);
            }
        }
    }
}

}  // namespace

void q8_prepare_rows(const float * x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, int8_t * xq, float * dx) {
    int32_t r[32];
    for (int64_t m = m0; m < m1; ++m) {
        for (int64_t b = 0; b < K / 32; ++b) {
            dx[m * (K / 32) + b] = quantize_block32(x + m * ldx + 32 * b, r);
            for (int j = 0; j < 32; ++j) xq[m * K + 32 * b + j] = static_cast<int8_t>(r[j]);
        }
    }
}

void linear_w8a8_group_rows(const int8_t * xq, const float * dx, int64_t M, int64_t K, const TensorView & qweight,
                            const TensorView & scales, const TensorView * bias, const TensorView & y,
                            int64_t group_size, int64_t n0, int64_t n1) {
    const int8_t * q = qweight.ptr<int8_t>();
    const float * s = scales.ptr<float>();
    const float * b = bias ? bias->ptr<float>() : nullptr;
    const int64_t ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: rows_t(xq, dx, M, K, group_size, q, s, b, y.ptr<float>(), ldy, n0, n1); break;
        case DType::bf16: rows_t(xq, dx, M, K, group_size, q, s, b, y.ptr<bf16>(), ldy, n0, n1); break;
        case DType::f16: rows_t(xq, dx, M, K, group_size, q, s, b, y.ptr<f16>(), ldy, n0, n1); break;
        default: break;
    }
}

}  // namespace lmd::cpu::avx2
