// Argmax per row, one block per row: each thread scans its stride of the row in increasing index
// order, then the block reduces (value, index) pairs with the same order, so the result does not
// depend on how the row was split.
#include "cuda/argmax.h"
#include "cuda/common.cuh"

namespace lmd::cuda {

namespace {

struct Best {
    float v;
    int32_t i;
};

constexpr int32_t kNone = -1;  // the index of "no element yet" (a thread or warp past the row's end)

// Whether a beats b: any element beats none; NaN above every number, then the larger value, then
// the lower index.
__device__ __forceinline__ bool beats(Best a, Best b) {
    if (a.i == kNone || b.i == kNone) return b.i == kNone && a.i != kNone;
    const bool na = isnan(a.v), nb = isnan(b.v);
    if (na != nb) return na;
    if (!na && a.v != b.v) return a.v > b.v;
    return a.i < b.i;
}

__device__ __forceinline__ Best warp_best(Best x) {
    for (int o = 16; o > 0; o >>= 1) {
        const Best y{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)};
        if (beats(y, x)) x = y;
    }
    return x;
}

template <typename T>
__global__ void argmax_kernel(const T * __restrict__ logits, int64_t ld, int32_t V, int32_t * __restrict__ out) {
    __shared__ Best part[32];
    const T * row = logits + blockIdx.x * ld;
    Best best{0.f, kNone};
    for (int32_t i = threadIdx.x; i < V; i += blockDim.x) {
        const Best c{to_f32(row[i]), i};
        if (beats(c, best)) best = c;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    best = warp_best(best);
    if (lane == 0) part[warp] = best;
    __syncthreads();
    if (warp == 0) {
        best = lane < warps ? part[lane] : Best{0.f, kNone};
        best = warp_best(best);
        if (lane == 0) out[blockIdx.x] = best.i;
    }
}

}  // namespace

void argmax(const TensorView & logits, const TensorView & out, cudaStream_t stream) {
    const int64_t B = logits.size(0), V = logits.size(1);
    if (B == 0) return;
    const int threads = V >= 8192 ? 1024 : 256;
    dispatch_float(logits.dtype, "argmax", [&]<typename T>() {
        argmax_kernel<T><<<static_cast<unsigned>(B), threads, 0, stream>>>(logits.ptr<T>(), logits.stride(0),
                                                                          static_cast<int32_t>(V), out.ptr<int32_t>());
    });
    LMD_CUDA_LAUNCHED("argmax");
}

}  // namespace lmd::cuda
