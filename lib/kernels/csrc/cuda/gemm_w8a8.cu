// W8A8 on the GPU, the twin of cpu/quant_ref.cc's quantize_row and linear_w8a8_rows: x quantized
// per token to int8 (quantize_per_token), then y = float(int32 dot(xq[m], w[n])) * sx[m] * sw[n]
// (+ bias[n]). Every step is the reference's, in the same float operations (__fdiv_rn,
// __fmul_rn, rintf: to nearest even, as nearbyint), and the int32 dot is exact whatever its
// order: the results equal the reference's, bit for bit.
#include "cuda/common.cuh"
#include "cuda/gemm_quant.h"

namespace lmd::cuda {

namespace {

__device__ __forceinline__ float block_max(float v) {  // every thread gets it; blockDim.x a multiple of 32
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < warps ? part[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One block a row: xq[m, :K] and zeros in xq[m, K:Kp] (the matmul reads whole 16-byte words).
template <typename T>
__global__ void quantize_per_token_kernel(const T * __restrict__ x, int64_t ldx, int64_t K, int64_t Kp,
                                          int8_t * __restrict__ xq, int64_t ldq, float * __restrict__ sx) {
    const int64_t m = blockIdx.x;
    const T * row = x + m * ldx;
    float absmax = 0.f;
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) absmax = fmaxf(absmax, fabsf(to_f32(row[k])));
    absmax = block_max(absmax);
    const float inv = absmax > 0.f ? __fdiv_rn(127.f, absmax) : 0.f;
    for (int64_t k = threadIdx.x; k < Kp; k += blockDim.x) {
        float v = 0.f;
        if (k < K) v = fminf(127.f, fmaxf(-127.f, rintf(__fmul_rn(to_f32(row[k]), inv))));
        xq[m * ldq + k] = static_cast<int8_t>(v);
    }
    if (threadIdx.x == 0) sx[m] = __fdiv_rn(absmax, 127.f);
}

constexpr int kThreads = 256, kColsPerWarp = 8, kCols = kThreads / 32 * kColsPerWarp, kRows = 8;

// A block: 64 columns (8 a warp) x 8 rows; a warp's lanes take 16-byte chunks of K in turn.
// kVec: the weight rows are 16-byte aligned (K % 16 == 0, aligned base), else read byte by byte.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
w8a8_kernel(const int8_t * __restrict__ xq, int64_t Kp, const float * __restrict__ sx, int64_t M,
            const int8_t * __restrict__ w, const float * __restrict__ sw, const float * __restrict__ bias,
            T * __restrict__ y, int64_t ldy, int64_t N, int64_t K) {
    const int64_t m0 = int64_t(blockIdx.y) * kRows;
    const int rows = static_cast<int>(min(int64_t(kRows), M - m0));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t chunks = Kp / 16;
#pragma unroll 1
    for (int j = 0; j < kColsPerWarp; ++j) {
        const int64_t n = int64_t(blockIdx.x) * kCols + warp * kColsPerWarp + j;
        if (n >= N) break;  // the same n for the whole warp
        int acc[kRows];
#pragma unroll
        for (int m = 0; m < kRows; ++m) acc[m] = 0;
        for (int64_t c = lane; c < chunks; c += 32) {
            int wv[4];
            if constexpr (kVec) {
                const int4 v = *reinterpret_cast<const int4 *>(w + n * K + 16 * c);
                wv[0] = v.x, wv[1] = v.y, wv[2] = v.z, wv[3] = v.w;
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    uint32_t word = 0;
#pragma unroll
                    for (int t = 0; t < 4; ++t) {
                        const int64_t k = 16 * c + 4 * i + t;
                        const uint32_t byte = k < K ? static_cast<uint8_t>(w[n * K + k]) : 0u;
                        word |= byte << (8 * t);
                    }
                    wv[i] = static_cast<int>(word);
                }
            }
#pragma unroll
            for (int m = 0; m < kRows; ++m) {
                if (m >= rows) continue;
                const int4 a = *reinterpret_cast<const int4 *>(xq + (m0 + m) * Kp + 16 * c);
                acc[m] = __dp4a(a.x, wv[0], acc[m]);
                acc[m] = __dp4a(a.y, wv[1], acc[m]);
                acc[m] = __dp4a(a.z, wv[2], acc[m]);
                acc[m] = __dp4a(a.w, wv[3], acc[m]);
            }
        }
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
            for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
        }
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < kRows; ++m) {
                if (m >= rows) continue;
                float v = __fmul_rn(__fmul_rn(static_cast<float>(acc[m]), sx[m0 + m]), sw[n]);
                if (bias) v = __fadd_rn(v, bias[n]);
                y[(m0 + m) * ldy + n] = from_f32<T>(v);
            }
        }
    }
}

}  // namespace

void quantize_per_token(const TensorView & x, const TensorView & xq, const TensorView & sx, cudaStream_t stream) {
    const int64_t M = x.size(0), K = x.size(1);
    if (M == 0) return;
    if (M > 2147483647) throw std::invalid_argument("quantize_per_token: M is too large");
    dispatch_float(x.dtype, "quantize_per_token", [&]<typename T>() {
        quantize_per_token_kernel<T><<<static_cast<unsigned>(M), 256, 0, stream>>>(
            x.ptr<T>(), x.stride(0), K, K, xq.ptr<int8_t>(), xq.stride(0), sx.ptr<float>());
    });
    LMD_CUDA_LAUNCHED("quantize_per_token");
}

void linear_w8a8(const TensorView & x, const TensorView & w, const TensorView & sw, const TensorView * bias,
                 const TensorView & y, cudaStream_t stream) {
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    if (M == 0 || N == 0) return;
    if (ceil_div(M, kRows) > 65535 || M > 2147483647) throw std::invalid_argument("linear_w8a8: M is too large");
    const int64_t Kp = ceil_div(K, 16) * 16;
    // scratch: xq [M, Kp] int8 (16-byte rows), then sx [M] float32 (M * Kp is a multiple of 16)
    void * scratch = nullptr;
    LMD_CUDA_CHECK(cudaMallocAsync(&scratch, M * Kp + sizeof(float) * M, stream));
    int8_t * xq = static_cast<int8_t *>(scratch);
    float * sx = reinterpret_cast<float *>(xq + M * Kp);
    const bool vec = K % 16 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
    const float * b = bias ? bias->ptr<float>() : nullptr;
    const dim3 grid(static_cast<unsigned>(ceil_div(N, kCols)), static_cast<unsigned>(ceil_div(M, kRows)));
    dispatch_float(x.dtype, "linear_w8a8", [&]<typename T>() {
        quantize_per_token_kernel<T><<<static_cast<unsigned>(M), 256, 0, stream>>>(x.ptr<T>(), x.stride(0), K, Kp, xq,
                                                                                  Kp, sx);
        if (vec) {
            w8a8_kernel<T, true><<<grid, kThreads, 0, stream>>>(xq, Kp, sx, M, w.ptr<int8_t>(), sw.ptr<float>(), b,
                                                                y.ptr<T>(), y.stride(0), N, K);
        } else {
            w8a8_kernel<T, false><<<grid, kThreads, 0, stream>>>(xq, Kp, sx, M, w.ptr<int8_t>(), sw.ptr<float>(), b,
                                                                 y.ptr<T>(), y.stride(0), N, K);
        }
    });
    const cudaError_t launched = cudaGetLastError();
    LMD_CUDA_CHECK(cudaFreeAsync(scratch, stream));
    check(launched, "linear_w8a8");
}

}  // namespace lmd::cuda
