// SiLU-and-mul on the GPU: out[t, i] = silu(x[t, i]) * x[t, I + i], in float, rounded once to the
// output's dtype, as the CPU reference (cpu/kernels_ref.cc silu_and_mul_row) computes it.
#include "cuda/activation.h"
#include "cuda/common.cuh"

namespace lmd::cuda {

namespace {

template <typename T>
__global__ void silu_and_mul_kernel(const T * __restrict__ x, int64_t ldx, T * __restrict__ out, int64_t ldo,
                                    int64_t I) {
    const int64_t t = blockIdx.y;
    const T * row = x + t * ldx;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < I; i += int64_t(gridDim.x) * blockDim.x) {
        const float g = to_f32(row[i]), u = to_f32(row[I + i]);
        out[t * ldo + i] = from_f32<T>(g / (1.f + expf(-g)) * u);
    }
}

}  // namespace

void silu_and_mul(const TensorView & x, const TensorView & out, cudaStream_t stream) {
    const int64_t T = x.size(0), I = out.size(1);
    if (T == 0 || I == 0) return;
    constexpr int kThreads = 256;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ceil_div(I, kThreads), 64)), static_cast<unsigned>(T));
    dispatch_float(x.dtype, "silu_and_mul", [&]<typename E>() {
        silu_and_mul_kernel<E><<<grid, kThreads, 0, stream>>>(x.ptr<E>(), x.stride(0), out.ptr<E>(), out.stride(0), I);
    });
    LMD_CUDA_LAUNCHED("silu_and_mul");
}

}  // namespace lmd::cuda
