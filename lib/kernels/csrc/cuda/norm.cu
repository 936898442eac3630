// RMS norm on the GPU, one block per row, with the CPU reference's rounding points
// (cpu/kernels_ref.cc rms_norm_row): the residual sum is rounded to the dtype and stored before it
// is squared; the sum of squares is in float32 (here a tree, there a loop: float32 rounding apart);
// x * inv is rounded to the dtype before the weight multiplies it (HF LlamaRMSNorm), then rounded again.
#include "cuda/common.cuh"
#include "cuda/norm.h"
#include "cuda/vec.cuh"

namespace lmd::cuda {

namespace {

// Rows of H = n_vec * N elements; x / residual / out rows at their strides (in elements). No
// __restrict__ on x, out and res: out may be x (in place), as each thread reads an element before
// it writes it and touches only its own elements.
template <typename T, int N, bool kResidual>
__global__ void rms_norm_kernel(const T * x, int64_t ldx, const T * __restrict__ w, float eps, T * out, int64_t ldo,
                                T * res, int64_t ldr, int64_t n_vec) {
    using V = Vec<T, N>;
    const int64_t m = blockIdx.x;
    const V * xr = reinterpret_cast<const V *>(x + m * ldx);
    V * rr = kResidual ? reinterpret_cast<V *>(res + m * ldr) : nullptr;
    const V * src = kResidual ? rr : xr;
    float ss = 0.f;
    for (int64_t j = threadIdx.x; j < n_vec; j += blockDim.x) {
        V a = xr[j];
        if constexpr (kResidual) {
            V r = rr[j];
            for (int k = 0; k < N; ++k) r.v[k] = from_f32<T>(to_f32(r.v[k]) + to_f32(a.v[k]));
            rr[j] = r;  // read back below by this same thread
            a = r;
        }
        for (int k = 0; k < N; ++k) {
            const float v = to_f32(a.v[k]);
            ss += v * v;
        }
    }
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / static_cast<float>(n_vec * N) + eps);
    const V * wv = reinterpret_cast<const V *>(w);
    V * orow = reinterpret_cast<V *>(out + m * ldo);
    for (int64_t j = threadIdx.x; j < n_vec; j += blockDim.x) {
        const V a = src[j], g = wv[j];
        V o;
        for (int k = 0; k < N; ++k) {
            const float n = to_f32(from_f32<T>(to_f32(a.v[k]) * inv));  // exact for float32
            o.v[k] = from_f32<T>(to_f32(g.v[k]) * n);
        }
        orow[j] = o;
    }
}

template <typename T, int N>
void launch(const TensorView & x, const TensorView & w, float eps, const TensorView & out, const TensorView * res,
            cudaStream_t stream) {
    const int64_t M = x.size(0), n_vec = x.size(1) / N;
    const int threads = row_threads(n_vec);
    if (res) {
        rms_norm_kernel<T, N, true><<<static_cast<unsigned>(M), threads, 0, stream>>>(
            x.ptr<T>(), x.stride(0), w.ptr<T>(), eps, out.ptr<T>(), out.stride(0), res->ptr<T>(), res->stride(0), n_vec);
    } else {
        rms_norm_kernel<T, N, false><<<static_cast<unsigned>(M), threads, 0, stream>>>(
            x.ptr<T>(), x.stride(0), w.ptr<T>(), eps, out.ptr<T>(), out.stride(0), nullptr, 0, n_vec);
    }
}

}  // namespace

void rms_norm(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
              const TensorView * residual, cudaStream_t stream) {
    const int64_t M = x.size(0), H = x.size(1);
    if (M == 0 || H == 0) return;
    dispatch_float(x.dtype, "rms_norm", [&]<typename T>() {
        const bool vec = aligned16({x.data, w.data, out.data, residual ? residual->data : nullptr},
                                   {x.stride(0), out.stride(0), residual ? residual->stride(0) : 0}, H, sizeof(T));
        if (vec) {
            launch<T, 16 / sizeof(T)>(x, w, eps, out, residual, stream);
        } else {
            launch<T, 1>(x, w, eps, out, residual, stream);
        }
    });
    LMD_CUDA_LAUNCHED("rms_norm");
}

}  // namespace lmd::cuda
