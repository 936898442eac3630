// lora_apply: runs of one adapter, each a shrink and an expand through cpu::linear (see lora.h).
#include "cpu/lora.h"

#include <vector>

#include "cpu/kernels.h"

namespace lmd::cpu {

namespace {

// Scratch reused step after step: the engine thread and a scoring thread each have their own.
struct LoraScratch {
    std::vector<float> x, xa, d;  // [M, K] widened x (16-bit only), [M, R], [M, N]
};

// y[t0 + m] += d[m] over one run of M rows of one adapter.
void apply_run(const TensorView & x, const TensorView & y, int64_t t0, int64_t M, const LoraWeights & w,
               LoraScratch & s, bool reference) {
    const int64_t K = x.size(1), N = y.size(1), R = w.a.size(0);
    if (R == 0) return;
    TensorView xr = x;  // rows [t0, t0 + M), x's row stride
    xr.data = static_cast<uint8_t *>(x.data) + t0 * x.stride(0) * dtype_size(x.dtype);
    xr.shape[0] = M;
    if (x.dtype != DType::f32) {  // widened once here (exact), so both matmuls run float32 in and out
        s.x.resize(static_cast<size_t>(M * K));
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t k = 0; k < K; ++k) s.x[m * K + k] = load_f32(xr.data, m * xr.stride(0) + k, x.dtype);
        }
        xr.data = s.x.data();
        xr.dtype = DType::f32;
        xr.strides[0] = K;
    }
    s.xa.resize(static_cast<size_t>(M * R));
    s.d.resize(static_cast<size_t>(M * N));
    TensorView xa = xr, d = xr;
    xa.data = s.xa.data();
    xa.shape[1] = R;
    xa.strides[0] = R;
    d.data = s.d.data();
    d.shape[1] = N;
    d.strides[0] = N;
    linear(xr, w.a, nullptr, xa, reference);  // shrink: [M, R]
    linear(xa, w.b, nullptr, d, reference);   // expand: [M, N]
    const int64_t ldy = y.stride(0);
    for (int64_t m = 0; m < M; ++m) {
        const int64_t row = (t0 + m) * ldy;
        const float * dm = s.d.data() + m * N;
        if (y.dtype == DType::f32) {
            float * ym = y.ptr<float>() + row;
            for (int64_t n = 0; n < N; ++n) ym[n] += dm[n];
        } else {
            for (int64_t n = 0; n < N; ++n) store_f32(y.data, row + n, y.dtype, load_f32(y.data, row + n, y.dtype) + dm[n]);
        }
    }
}

}  // namespace

void lora_apply(const TensorView & x, const TensorView & y, const int32_t * row_slots, const LoraWeights * slots,
                int64_t num_slots, bool reference) {
    static thread_local LoraScratch scratch;
    const int64_t T = x.size(0);
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        const int32_t s = row_slots[t0];
        t1 = t0 + 1;
        while (t1 < T && row_slots[t1] == s) ++t1;
        if (s < 0 || s >= num_slots || slots[s].a.data == nullptr) continue;
        apply_run(x, y, t0, t1 - t0, slots[s], scratch, reference);
    }
}

}  // namespace lmd::cpu
