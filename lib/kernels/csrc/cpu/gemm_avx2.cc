// AVX2/FMA/F16C kernels of the packed float matmul (gemm.h; the tile: gemm_tile_avx2.h). This
// file is compiled with those flags; gemm.cc calls into it only when the CPU has all three.
//
// Two paths, chosen by M alone: M <= 5 (decode; the weights stream from memory once, bound
// by their reading) runs whole tiles of M rows over several panels, widening 16-bit weights
// in registers; M >= 6 (prefill) runs 6 x 16 tiles over chunks of a panel, widened once into
// an L1 buffer when 16-bit.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/gemm_tile_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

using namespace tile;

// ---- where a panel's weights come from -------------------------------------------------------------

// Float weights packed [P, K, 16] in their dtype.
template <typename WT>
struct FloatPanels {
    const WT * w;
    int64_t K;

    // An M <= 5 tile over NP whole panels from p, all of K, widened in registers.
    template <int MR, int NP>
    Acc<MR, NP> tile(const float * x, int64_t ldx, int64_t p) const {
        Acc<MR, NP> acc = acc_zero<MR, NP>();
        tile_steps<MR, NP>(x, ldx, w + p * K * kW, K * kW, K, acc);
        return acc;
    }
    // Panel p, k in [k0, k0 + kc), as float32 [kc, 16]: in place, or widened into buf.
    const float * chunk(int64_t p, int64_t k0, int64_t kc, float * buf) const {
        const WT * src = w + (p * K + k0) * kW;
        if constexpr (std::is_same<WT, float>::value) {
            return src;
        } else {
            for (int64_t i = 0; i < kc * kW; i += 8) _mm256_storeu_ps(buf + i, load8(src + i));
            return buf;
        }
    }
};

// ---- the two paths ---------------------------------------------------------------------------------

// One kc-long step of a 1-panel tile of the GEMM: the partial sums of earlier steps come
// from and go back to part[MR, 16] (float32), the last step adds the bias and writes y.
template <int MR, typename BT, typename YT>
void tile_chunk(const float * x, int64_t ldx, const float * w, int64_t kc, bool first, bool last, float * part,
                const BT * bias, int64_t cols, YT * y, int64_t ldy) {
    Acc<MR, 1> acc;
    for (int m = 0; m < MR; ++m) {
        for (int j = 0; j < 2; ++j) acc.v[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + m * kW + 8 * j);
    }
    tile_steps<MR, 1>(x, ldx, w, 0, kc, acc);
    if (last) {
        tile_store<MR, 1>(acc, bias, cols, y, ldy);
    } else {
        for (int m = 0; m < MR; ++m)
            for (int j = 0; j < 2; ++j) _mm256_storeu_ps(part + m * kW + 8 * j, acc.v[m][j]);
    }
}

template <typename BT, typename YT>
void tile_chunk_m(int mr, const float * x, int64_t ldx, const float * w, int64_t kc, bool first, bool last,
                  float * part, const BT * bias, int64_t cols, YT * y, int64_t ldy) {
    switch (mr) {
        case 6: tile_chunk<6>(x, ldx, w, kc, first, last, part, bias, cols, y, ldy); break;
        case 5: tile_chunk<5>(x, ldx, w, kc, first, last, part, bias, cols, y, ldy); break;
        case 4: tile_chunk<4>(x, ldx, w, kc, first, last, part, bias, cols, y, ldy); break;
        case 3: tile_chunk<3>(x, ldx, w, kc, first, last, part, bias, cols, y, ldy); break;
        case 2: tile_chunk<2>(x, ldx, w, kc, first, last, part, bias, cols, y, ldy); break;
        default: tile_chunk<1>(x, ldx, w, kc, first, last, part, bias, cols, y, ldy); break;
    }
}

// The GEMM for M >= 6 (gemm_blocks): every tile of kMR rows passes over a kKC-chunk of the
// panel (float32 in L1), the partial sums of earlier chunks waiting in part.
template <typename Src, typename BT, typename YT>
void panels_gemm(const Src & src, const float * x, int64_t ldx, int64_t M, int64_t K, int64_t N, const BT * bias,
                 YT * y, int64_t ldy, int64_t p0, int64_t p1) {
    static thread_local std::vector<float> buf;
    buf.resize(kKC * kW);
    const float * w = nullptr;
    gemm_blocks<kMR>(M, K, kKC, p0, p1, [&](int64_t p, int64_t k0, int64_t kc) { w = src.chunk(p, k0, kc, buf.data()); },
                [&](int64_t m, int mr, int64_t p, int64_t k0, int64_t kc, float * part) {
                    tile_chunk_m(mr, x + m * ldx + k0, ldx, w, kc, k0 == 0, k0 + kc == K, part,
                                 bias ? bias + p * kW : nullptr, std::min<int64_t>(kW, N - p * kW),
                                 y + m * ldy + p * kW, ldy);
                });
}

template <typename Src, typename BT, typename YT>
void panels(const Src & src, const float * x, int64_t ldx, int64_t M, int64_t K, int64_t N, const BT * bias, YT * y,
            int64_t ldy, int64_t p0, int64_t p1) {
    switch (M) {
        case 1: panels_small<1, small_np(1)>(src, x, ldx, N, bias, y, ldy, p0, p1); break;
        case 2: panels_small<2, small_np(2)>(src, x, ldx, N, bias, y, ldy, p0, p1); break;
        case 3: panels_small<3, small_np(3)>(src, x, ldx, N, bias, y, ldy, p0, p1); break;
        case 4: panels_small<4, small_np(4)>(src, x, ldx, N, bias, y, ldy, p0, p1); break;
        case 5: panels_small<5, small_np(5)>(src, x, ldx, N, bias, y, ldy, p0, p1); break;
        default: panels_gemm(src, x, ldx, M, K, N, bias, y, ldy, p0, p1); break;
    }
}

template <typename Src, typename BT>
void panels_y(const Src & src, const float * x, int64_t ldx, int64_t M, int64_t K, const BT * bias,
              const TensorView & y, int64_t p0, int64_t p1) {
    const int64_t N = y.size(1), ldy = y.stride(0);
    switch (y.dtype) {
        case DType::f32: panels(src, x, ldx, M, K, N, bias, y.ptr<float>(), ldy, p0, p1); break;
        case DType::bf16: panels(src, x, ldx, M, K, N, bias, y.ptr<bf16>(), ldy, p0, p1); break;
        case DType::f16: panels(src, x, ldx, M, K, N, bias, y.ptr<f16>(), ldy, p0, p1); break;
        default: break;
    }
}

template <typename WT>
void float_panels(const float * x, int64_t ldx, int64_t M, const TensorView & packed, const TensorView * bias,
                  const TensorView & y, int64_t p0, int64_t p1) {
    const int64_t K = packed.size(1);
    panels_y(FloatPanels<WT>{packed.ptr<WT>(), K}, x, ldx, M, K, bias ? bias->ptr<WT>() : nullptr, y, p0, p1);
}

template <typename XT>
void widen_rows_t(const XT * x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, float * out) {
    for (int64_t m = m0; m < m1; ++m) {
        const XT * src = x + m * ldx;
        float * dst = out + m * K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, load8(src + k));
        for (; k < K; ++k) dst[k] = to_f32(src[k]);
    }
}

}  // namespace

void widen_rows(const TensorView & x, int64_t m0, int64_t m1, float * out) {
    const int64_t K = x.size(1), ldx = x.stride(0);
    switch (x.dtype) {
        case DType::bf16: widen_rows_t(x.ptr<bf16>(), ldx, K, m0, m1, out); break;
        case DType::f16: widen_rows_t(x.ptr<f16>(), ldx, K, m0, m1, out); break;
        default: widen_rows_t(x.ptr<float>(), ldx, K, m0, m1, out); break;
    }
}

void linear_packed_panels(const float * x, int64_t ldx, int64_t M, const TensorView & packed,
                          const TensorView * bias, const TensorView & y, int64_t p0, int64_t p1) {
    switch (packed.dtype) {
        case DType::f32: float_panels<float>(x, ldx, M, packed, bias, y, p0, p1); break;
        case DType::bf16: float_panels<bf16>(x, ldx, M, packed, bias, y, p0, p1); break;
        case DType::f16: float_panels<f16>(x, ldx, M, packed, bias, y, p0, p1); break;
        default: break;
    }
}

}  // namespace lmd::cpu::avx2
