// Packing and threading of the packed matmuls: shape checks live in the bindings
// (bindings/gemm.cc), the arithmetic in gemm_ref.cc / gemm_avx2.cc / gemm_w4a16_avx2.cc.
#include "cpu/gemm.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace lmd::cpu {

namespace {

// packed[p, k, j] = w[W p + j, k] in panels W wide, zero past N; T: an element's bits
// (uint32_t or uint16_t).
template <typename T>
void pack_t(const T * w, int64_t N, int64_t K, int64_t W, T * packed) {
    for (int64_t p = 0; p < (N + W - 1) / W; ++p) {
        T * dst = packed + p * K * W;
        const int64_t rows = std::min(W, N - p * W);
        if (rows < W) std::memset(dst, 0, K * W * sizeof(T));
        for (int64_t j = 0; j < rows; ++j) {
            const T * src = w + (p * W + j) * K;
            for (int64_t k = 0; k < K; ++k) dst[k * W + j] = src[k];
        }
    }
}

template <typename T>
void packed_row_t(const T * packed, int64_t K, int64_t W, int64_t n, T * out) {
    const T * src = packed + (n / W) * K * W + n % W;
    for (int64_t k = 0; k < K; ++k) out[k] = src[k * W];
}

}  // namespace

void pack_linear(const TensorView & w, const TensorView & packed) {
    const int64_t N = w.size(0), K = w.size(1), W = packed.size(2), P = packed.size(0);
    const int threads = static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, P * W / 256)));
    parallel(threads, [&](int t, int nt) {
        const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
        const int64_t n0 = p0 * W, n1 = std::min(N, p1 * W);
        if (n0 >= n1) return;
        switch (dtype_size(w.dtype)) {
            case 4: pack_t(w.ptr<uint32_t>() + n0 * K, n1 - n0, K, W, packed.ptr<uint32_t>() + p0 * K * W); break;
            case 2: pack_t(w.ptr<uint16_t>() + n0 * K, n1 - n0, K, W, packed.ptr<uint16_t>() + p0 * K * W); break;
            default: pack_t(w.ptr<uint8_t>() + n0 * K, n1 - n0, K, W, packed.ptr<uint8_t>() + p0 * K * W); break;
        }
    });
}

void unpack_linear(const TensorView & packed, const TensorView & w) {
    const int64_t N = w.size(0), K = w.size(1);
    for (int64_t n = 0; n < N; ++n) packed_row(packed, n, static_cast<uint8_t *>(w.data) + n * K * dtype_size(w.dtype));
}

void packed_row(const TensorView & packed, int64_t n, void * out) {
    const int64_t K = packed.size(1), W = packed.size(2);
    switch (dtype_size(packed.dtype)) {
        case 4: packed_row_t(packed.ptr<uint32_t>(), K, W, n, static_cast<uint32_t *>(out)); break;
        case 2: packed_row_t(packed.ptr<uint16_t>(), K, W, n, static_cast<uint16_t *>(out)); break;
        default: packed_row_t(packed.ptr<uint8_t>(), K, W, n, static_cast<uint8_t *>(out)); break;
    }
}

namespace {

// fn(p0, p1) over runs of 16-column panels [p0, p1) (each weight is read once in all), on as
// many threads as pay for themselves (below ~64k multiply-adds a second one costs more than it
// saves).
// Below 6 rows the kernels take 8 panels (4 with AVX2) a tile to keep enough chains going: the runs are
// whole tiles, or a decode step's GEMV would run its panels one at a time, bound by one chain's latency.
template <typename Fn>
void split_panels(int64_t M, int64_t N, int64_t K, Fn && fn) {
    const int64_t P = num_panels(N);
    const int threads = static_cast<int>(std::min<int64_t>({num_threads(), P, std::max<int64_t>(1, M * N * K >> 16)}));
    parallel_ranges(threads, P, M <= 5 ? 8 : 1, fn);
}

// Threads for a pass over the rows of an [M, K] x: one below ~16k elements.
int prepare_threads(int64_t M, int64_t K) {
    return static_cast<int>(std::min<int64_t>({num_threads(), M, std::max<int64_t>(1, M * K >> 14)}));
}

// x as float32 rows for the AVX2 kernels: itself, or 16-bit activations widened once (not
// once per panel) into `converted`. Returns the rows and sets ldx.
const float * f32_rows(const TensorView & x, std::vector<float> & converted, int64_t & ldx) {
    const int64_t M = x.size(0), K = x.size(1);
    ldx = x.stride(0);
    if (x.dtype == DType::f32) return x.ptr<float>();
    converted.resize(M * K);
    parallel(prepare_threads(M, K), [&](int t, int nt) { avx2::widen_rows(x, M * t / nt, M * (t + 1) / nt, converted.data()); });
    ldx = K;
    return converted.data();
}

// x's rows for the AVX-512 kernels: interleaved into `buf` where they take them so (gemm.h), by
// tiles across the threads (once, not once per thread of the matmul); else x itself.
const float * avx512_rows(const float * x, int64_t ldx, int64_t M, int64_t K, std::vector<float> & buf,
                         int64_t min_rows = 6) {
    if (!avx512::rows_interleaved(M, K, min_rows)) return x;
    buf.resize(M * K);
    const int64_t nt = row_tiles(M);
    parallel(static_cast<int>(std::min<int64_t>(prepare_threads(M, K), nt)), [&](int t, int n) {
        interleave_rows(x, ldx, M, K, nt * t / n, nt * (t + 1) / n, buf.data());
    });
    return buf.data();
}

}  // namespace

void interleave_rows(const float * x, int64_t ldx, int64_t M, int64_t K, int64_t t0, int64_t t1, float * xt) {
    for (int64_t i = t0; i < t1; ++i) {
        const int64_t m = tile_row(M, i), mr = tile_row(M, i + 1) - m;
        float * out = xt + m * K;
        for (int64_t r = 0; r < mr; ++r) {
            const float * row = x + (m + r) * ldx;
            for (int64_t k = 0; k < K; ++k) out[k * mr + r] = row[k];
        }
    }
}

void linear_packed(const TensorView & x, const TensorView & packed, const TensorView * bias, const TensorView & y,
                   bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
    if (M == 0 || N == 0) return;
    if (reference || !isa_at_least(Isa::avx2)) {
        split_panels(M, N, K, [&](int64_t p0, int64_t p1) {
            ref::linear_packed_rows(x, packed, bias, y, p0 * kPanelWidth, std::min(N, p1 * kPanelWidth));
        });
        return;
    }
    std::vector<float> converted;
    int64_t ldx = 0;
    const float * xf = f32_rows(x, converted, ldx);
    const bool wide = isa_at_least(Isa::avx512);
    std::vector<float> interleaved;
    if (wide) xf = avx512_rows(xf, ldx, M, K, interleaved);
    split_panels(M, N, K, [&](int64_t p0, int64_t p1) {
        (wide ? avx512::linear_packed_panels : avx2::linear_packed_panels)(xf, ldx, M, packed, bias, y, p0, p1);
    });
}

void pack_w8a16(const TensorView & qweight, const TensorView & scales, const TensorView & qpanels,
                const TensorView & spanels) {
    pack_linear(qweight, qpanels);
    pack_linear(scales, spanels);
}

void unpack_w8a16(const TensorView & qpanels, const TensorView & spanels, const TensorView & qweight,
                  const TensorView & scales) {
    unpack_linear(qpanels, qweight);
    unpack_linear(spanels, scales);
}

void linear_w8a16_packed(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                         const TensorView * bias, const TensorView & y, bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
    if (M == 0 || N == 0) return;
    if (reference || !isa_at_least(Isa::avx2)) {
        split_panels(M, N, K, [&](int64_t p0, int64_t p1) {
            ref::linear_w8a16_packed_rows(x, qpanels, spanels, bias, y, p0 * kPanelWidth, std::min(N, p1 * kPanelWidth));
        });
        return;
    }
    std::vector<float> converted;
    int64_t ldx = 0;
    const float * xf = f32_rows(x, converted, ldx);
    std::vector<float> interleaved;
    if (isa_at_least(Isa::avx512)) xf = avx512_rows(xf, ldx, M, K, interleaved);
    const auto panels = isa_at_least(Isa::avx512) ? avx512::linear_w8a16_packed_panels
                                                  : avx2::linear_w8a16_packed_panels;
    split_panels(M, N, K, [&](int64_t p0, int64_t p1) { panels(xf, ldx, M, qpanels, spanels, bias, y, p0, p1); });
}

namespace {

// W4A16 qweight [N, K / 2] bytes seen as K / 8 little-endian words a row: nibble i of word c is
// k = 8 c + i, so the words pack into panels like any [N, K / 8] matrix of 32-bit elements
TensorView nibble_words(const TensorView & qweight) {
    TensorView words = qweight;
    words.dtype = DType::i32;
    words.shape[1] = qweight.size(1) / 4;
    return words;
}

}  // namespace

void pack_w4a16(const TensorView & qweight, const TensorView & scales, const TensorView & mins,
                const TensorView & qpanels, const TensorView & spanels, const TensorView & mpanels) {
    pack_linear(nibble_words(qweight), qpanels);
    pack_linear(scales, spanels);
    pack_linear(mins, mpanels);
}

void unpack_w4a16(const TensorView & qpanels, const TensorView & spanels, const TensorView & mpanels,
                  const TensorView & qweight, const TensorView & scales, const TensorView & mins) {
    unpack_linear(qpanels, nibble_words(qweight));
    unpack_linear(spanels, scales);
    unpack_linear(mpanels, mins);
}

namespace {

// The frame of the W4 panel matmuls: the reference's rows on this thread's panels, or x as
// float32 rows for avx2(xf, ldx, G), which prepares them and runs the panels.
template <typename Ref, typename Avx2>
void w4_panels(const TensorView & x, const TensorView & spanels, const TensorView & y, bool reference, Ref && ref_rows,
               Avx2 && avx2) {
    const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
    if (M == 0 || N == 0) return;
    if (reference || !isa_at_least(Isa::avx2)) {
        split_panels(M, N, K, [&](int64_t p0, int64_t p1) { ref_rows(p0 * kPanelWidth, std::min(N, p1 * kPanelWidth)); });
        return;
    }
    std::vector<float> converted;
    int64_t ldx = 0;
    const float * xf = f32_rows(x, converted, ldx);
    avx2(xf, ldx, K / spanels.size(1));
}

}  // namespace

void linear_w4a16_packed(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                         const TensorView & mpanels, const TensorView * bias, const TensorView & y, bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
    w4_panels(
        x, spanels, y, reference,
        [&](int64_t n0, int64_t n1) { ref::linear_w4a16_packed_rows(x, qpanels, spanels, mpanels, bias, y, n0, n1); },
        [&](const float * xf, int64_t ldx, int64_t G) {
            std::vector<float> xp(M * K), xsum(M * (K / G));
            parallel(prepare_threads(M, K), [&](int t, int nt) {
                avx2::w4a16_prepare_rows(xf, ldx, K, G, M * t / nt, M * (t + 1) / nt, xp.data(), xsum.data());
            });
            std::vector<float> interleaved;
            const float * rows = isa_at_least(Isa::avx512)
                                     ? avx512_rows(xp.data(), K, M, K, interleaved, avx512::kW4a16BatchRows)
                                     : xp.data();
            const auto panels = isa_at_least(Isa::avx512) ? avx512::linear_w4a16_packed_panels
                                                          : avx2::linear_w4a16_packed_panels;
            split_panels(M, N, K, [&](int64_t p0, int64_t p1) {
                panels(rows, xsum.data(), M, qpanels, spanels, mpanels, bias, y, p0, p1);
            });
        });
}

void linear_w4a8_packed(const TensorView & x, const TensorView & qpanels, const TensorView & spanels,
                        const TensorView & mpanels, const TensorView * bias, const TensorView & y, bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
    w4_panels(
        x, spanels, y, reference,
        [&](int64_t n0, int64_t n1) { ref::linear_w4a8_packed_rows(x, qpanels, spanels, mpanels, bias, y, n0, n1); },
        [&](const float * xf, int64_t ldx, int64_t G) {
            std::vector<int8_t> xq(M * K);
            std::vector<float> dx(M * (K / 32)), xsum(M * (K / G));
            parallel(prepare_threads(M, K), [&](int t, int nt) {
                avx2::w4a8_prepare_rows(xf, ldx, K, G, M * t / nt, M * (t + 1) / nt, xq.data(), dx.data(),
                                        xsum.data());
            });
            const auto panels = use_avx512_vnni() ? avx512::linear_w4a8_packed_panels
                                                  : avx2::linear_w4a8_packed_panels;
            split_panels(M, N, K, [&](int64_t p0, int64_t p1) {
                panels(xq.data(), dx.data(), xsum.data(), M, qpanels, spanels, mpanels, bias, y, p0, p1);
            });
        });
}

}  // namespace lmd::cpu
