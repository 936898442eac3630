// What every CUDA kernel file of the library shares: error checks, the element types and their
// float conversions, and launch helpers. Kernels take TensorViews (core/tensor.h) whose data is
// device memory (checked by the bindings) and the stream the caller runs on.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/tensor.h"

namespace lmd::cuda {

// Throws std::runtime_error naming the call and CUDA's message (pybind11 turns it into RuntimeError).
inline void check(cudaError_t e, const char * what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define LMD_CUDA_CHECK(call) ::lmd::cuda::check((call), #call)
// After a launch: a bad configuration shows here, a fault at the next synchronizing call.
#define LMD_CUDA_LAUNCHED(name) ::lmd::cuda::check(cudaGetLastError(), name)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The element type of a float DType and its conversions, in device code.
template <DType D> struct Elem;
template <> struct Elem<DType::f32> { using T = float; };
template <> struct Elem<DType::f16> { using T = __half; };
template <> struct Elem<DType::bf16> { using T = __nv_bfloat16; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Calls f.template operator()<T>() with T the element type of float dtype d; throws otherwise.
template <typename F>
void dispatch_float(DType d, const char * what, F && f) {
    switch (d) {
        case DType::f32: f.template operator()<float>(); break;
        case DType::f16: f.template operator()<__half>(); break;
        case DType::bf16: f.template operator()<__nv_bfloat16>(); break;
        default: throw std::invalid_argument(std::string(what) + ": expected float32, float16 or bfloat16");
    }
}

// Warp and block sums (all threads get the result); the block's size is a multiple of 32, at most 1024.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();  // part may still be read by a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < warps ? part[lane] : 0.f;
    return warp_sum(v);
}

}  // namespace lmd::cuda
