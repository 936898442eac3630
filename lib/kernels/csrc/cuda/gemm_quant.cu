// Quantized-weight matmuls on the GPU, the twins of cpu/quant_ref.cc, one kernel for every M.
// A block owns 64 output columns (8 warps x 8), a 1024-wide slice of K and up to kM rows of x,
// which it stages in shared memory as float. Each lane owns one 32-wide chunk of the slice: one
// 16-byte load (W4) or two (W8) of a weight row per column, dequantized in registers. 32 divides
// G, so a chunk never straddles a group, and per chunk a lane adds scale * dot(q, x) (+ min *
// sum(x) for W4) in float, as the reference does per group. A warp sums its lanes by a fixed
// tree; the K slices go to a float32 workspace [splits, M, N] (cudaMallocAsync on the stream)
// that a second kernel adds in slice order, adding bias and rounding once to y's dtype (with
// one slice the first kernel writes y itself). The arithmetic of a row depends only on K: the
// multiply-adds are explicit (__fmaf_rn, __fmul_rn) so the compiler cannot contract them
// differently per instantiation, and row m of y is bitwise the same whatever M and every run.
#include "cuda/common.cuh"
#include "cuda/gemm_quant.h"

namespace lmd::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kColsPerWarp = 8, kCols = kWarps * kColsPerWarp;  // output columns of a block
constexpr int kChunk = 32;                                     // k of a lane, per column
constexpr int kSlice = 32 * kChunk;                            // k of a block: a chunk a lane
// Floats a chunk takes in shared memory: with 4 of padding, the 8 lanes of a quarter warp read
// their float4s from 8 different groups of 4 banks.
constexpr int kPitch = kChunk + 4;

// dot[m] += the 8 nibbles of word (nibble t: the t-th k) times x[m] at xl (row pitch 32 * kPitch
// floats, 16-byte aligned), for the first `rows` rows.
template <int kM>
__device__ __forceinline__ void dot_w4(uint32_t word, const float * xl, int rows, float (&dot)[kM]) {
    float q[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) q[t] = static_cast<float>((word >> (4 * t)) & 0xFu);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
        if (m >= rows) continue;
        const float4 a = *reinterpret_cast<const float4 *>(xl + m * 32 * kPitch);
        const float4 b = *reinterpret_cast<const float4 *>(xl + m * 32 * kPitch + 4);
        float d = dot[m];
        d = __fmaf_rn(q[0], a.x, d), d = __fmaf_rn(q[1], a.y, d), d = __fmaf_rn(q[2], a.z, d);
        d = __fmaf_rn(q[3], a.w, d), d = __fmaf_rn(q[4], b.x, d), d = __fmaf_rn(q[5], b.y, d);
        d = __fmaf_rn(q[6], b.z, d), d = __fmaf_rn(q[7], b.w, d);
        dot[m] = d;
    }
}

// The same for the 4 signed bytes of word (byte t: the t-th k).
template <int kM>
__device__ __forceinline__ void dot_w8(uint32_t word, const float * xl, int rows, float (&dot)[kM]) {
    float q[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) q[t] = static_cast<float>(static_cast<int8_t>((word >> (8 * t)) & 0xFFu));
#pragma unroll
    for (int m = 0; m < kM; ++m) {
        if (m >= rows) continue;
        const float4 a = *reinterpret_cast<const float4 *>(xl + m * 32 * kPitch);
        float d = dot[m];
        d = __fmaf_rn(q[0], a.x, d), d = __fmaf_rn(q[1], a.y, d), d = __fmaf_rn(q[2], a.z, d);
        d = __fmaf_rn(q[3], a.w, d);
        dot[m] = d;
    }
}

template <typename T, int kM, bool kW4>
__global__ void __launch_bounds__(kThreads, 2)
quant_matmul_kernel(const T * __restrict__ x, int64_t ldx, int64_t M, int64_t row_base,
                    const uint8_t * __restrict__ qweight, const float * __restrict__ scales,
                    const float * __restrict__ mins, const float * __restrict__ bias, float * __restrict__ ws,
                    T * __restrict__ y, int64_t ldy, int64_t N, int64_t K, int64_t group_size) {
    __shared__ __align__(16) float xs[kM][32 * kPitch];
    __shared__ float xsum[kW4 ? kM : 1][32];  // the sum of each chunk of x (W4's min term)
    const int64_t row0 = row_base + int64_t(blockIdx.z) * kM;
    const int rows = static_cast<int>(min(int64_t(kM), M - row0));
    const int64_t k0 = int64_t(blockIdx.y) * kSlice;
    const int chunks = static_cast<int>(min(int64_t(32), (K - k0) / kChunk));  // 32 divides K

    for (int i = threadIdx.x; i < kM * kSlice; i += kThreads) {
        const int m = i / kSlice, kk = i % kSlice;
        float v = 0.f;
        if (m < rows && kk < chunks * kChunk) v = to_f32(x[(row0 + m) * ldx + k0 + kk]);
        xs[m][(kk / kChunk) * kPitch + kk % kChunk] = v;
    }
    __syncthreads();
    if constexpr (kW4) {
        for (int i = threadIdx.x; i < kM * 32; i += kThreads) {
            const int m = i / 32, c = i % 32;
            float s = 0.f;
            for (int j = 0; j < kChunk; ++j) s += xs[m][c * kPitch + j];
            xsum[m][c] = s;
        }
        __syncthreads();
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t num_groups = K / group_size;
    const int64_t kc = k0 + int64_t(lane) * kChunk;  // this lane's chunk
    const int64_t g = kc / group_size;
    const bool active = lane < chunks;
#pragma unroll 1
    for (int j = 0; j < kColsPerWarp; ++j) {
        const int64_t n = int64_t(blockIdx.x) * kCols + warp * kColsPerWarp + j;
        if (n >= N) break;  // the same n for the whole warp
        float acc[kM];
#pragma unroll
        for (int m = 0; m < kM; ++m) acc[m] = 0.f;
        if (active) {
            const float s = scales[n * num_groups + g];
            float dot[kM];
#pragma unroll
            for (int m = 0; m < kM; ++m) dot[m] = 0.f;
            if constexpr (kW4) {
                // Byte b of the chunk holds k = kc + 2 b (low nibble) and kc + 2 b + 1: in word i,
                // nibble t (bits 4 t..4 t + 3) is k = kc + 8 i + t.
                const uint4 w = *reinterpret_cast<const uint4 *>(qweight + n * (K / 2) + kc / 2);
                const float * xl = &xs[0][lane * kPitch];
                dot_w4<kM>(w.x, xl, rows, dot), dot_w4<kM>(w.y, xl + 8, rows, dot);
                dot_w4<kM>(w.z, xl + 16, rows, dot), dot_w4<kM>(w.w, xl + 24, rows, dot);
                const float mn = mins[n * num_groups + g];
#pragma unroll
                for (int m = 0; m < kM; ++m) acc[m] = __fmaf_rn(s, dot[m], __fmul_rn(mn, xsum[m][lane]));
            } else {
                // Byte b of the chunk is k = kc + b: in word i of the two loads, byte t is k = kc + 4 i + t.
                const uint4 * wp = reinterpret_cast<const uint4 *>(qweight + n * K + kc);
                const uint4 w0 = wp[0], w1 = wp[1];
                const float * xl = &xs[0][lane * kPitch];
                dot_w8<kM>(w0.x, xl, rows, dot), dot_w8<kM>(w0.y, xl + 4, rows, dot);
                dot_w8<kM>(w0.z, xl + 8, rows, dot), dot_w8<kM>(w0.w, xl + 12, rows, dot);
                dot_w8<kM>(w1.x, xl + 16, rows, dot), dot_w8<kM>(w1.y, xl + 20, rows, dot);
                dot_w8<kM>(w1.z, xl + 24, rows, dot), dot_w8<kM>(w1.w, xl + 28, rows, dot);
#pragma unroll
                for (int m = 0; m < kM; ++m) acc[m] = __fmul_rn(s, dot[m]);
            }
        }
#pragma unroll
        for (int m = 0; m < kM; ++m) acc[m] = warp_sum(acc[m]);  // every lane gets the same sum
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < kM; ++m) {
                if (m >= rows) continue;
                if (gridDim.y == 1) {
                    // as split_sum_kernel computes it for one slice: (0 + acc) + bias
                    y[(row0 + m) * ldy + n] = from_f32<T>(bias ? __fadd_rn(acc[m], bias[n]) : acc[m]);
                } else {
                    ws[(int64_t(blockIdx.y) * M + row0 + m) * N + n] = acc[m];
                }
            }
        }
    }
}

// y[m, n] = the K slices' partial sums in slice order (+ bias[n]), rounded once to T.
template <typename T>
__global__ void split_sum_kernel(const float * __restrict__ ws, int64_t splits, int64_t M, int64_t N,
                                 const float * __restrict__ bias, T * __restrict__ y, int64_t ldy) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < M * N; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t m = i / N, n = i % N;
        float v = ws[i];
        for (int64_t s = 1; s < splits; ++s) v = __fadd_rn(v, ws[s * M * N + i]);
        if (bias) v = __fadd_rn(v, bias[n]);
        y[m * ldy + n] = from_f32<T>(v);
    }
}

template <bool kW4>
void quant_matmul(const TensorView & x, const uint8_t * qweight, const float * scales, const float * mins,
                  const TensorView * bias, const TensorView & y, int64_t N, int64_t group_size, cudaStream_t stream,
                  const char * name) {
    const int64_t M = x.size(0), K = x.size(1);
    if (M == 0 || N == 0) return;
    const int64_t splits = std::max<int64_t>(1, ceil_div(K, kSlice));
    if (splits > 65535) throw std::invalid_argument(std::string(name) + ": K is too large (at most 65535 * 1024)");
    const float * b = bias ? bias->ptr<float>() : nullptr;
    float * ws = nullptr;
    if (splits > 1) LMD_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void **>(&ws), sizeof(float) * splits * M * N, stream));
    dispatch_float(x.dtype, name, [&]<typename T>() {
        auto launch = [&]<int kM>() {
            const int64_t row_blocks = ceil_div(M, kM);
            for (int64_t b0 = 0; b0 < row_blocks; b0 += 65535) {  // gridDim.z is at most 65535
                const dim3 grid(static_cast<unsigned>(ceil_div(N, kCols)), static_cast<unsigned>(splits),
                                static_cast<unsigned>(std::min<int64_t>(65535, row_blocks - b0)));
                quant_matmul_kernel<T, kM, kW4><<<grid, kThreads, 0, stream>>>(
                    x.ptr<T>(), x.stride(0), M, b0 * kM, qweight, scales, mins, b, ws, y.ptr<T>(), y.stride(0), N, K,
                    group_size);
            }
        };
        if (M == 1) launch.template operator()<1>();
        else if (M == 2) launch.template operator()<2>();
        else if (M <= 4) launch.template operator()<4>();
        else launch.template operator()<8>();
        if (splits > 1) {
            const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(M * N, 256), 4096));
            split_sum_kernel<T><<<blocks, 256, 0, stream>>>(ws, splits, M, N, b, y.ptr<T>(), y.stride(0));
        }
    });
    const cudaError_t launched = cudaGetLastError();  // a bad launch shows here: free the workspace first
    if (ws) LMD_CUDA_CHECK(cudaFreeAsync(ws, stream));
    check(launched, name);
}

}  // namespace

void linear_w4a16(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                  const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t group_size,
                  cudaStream_t stream) {
    quant_matmul<true>(x, qweight.ptr<uint8_t>(), scales.ptr<float>(), mins.ptr<float>(), bias, y, qweight.size(0),
                       group_size, stream, "linear_w4a16");
}

void linear_w8a16(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                  const TensorView * bias, const TensorView & y, int64_t group_size, cudaStream_t stream) {
    quant_matmul<false>(x, static_cast<const uint8_t *>(qweight.data), scales.ptr<float>(), nullptr, bias, y,
                        qweight.size(0), group_size, stream, "linear_w8a16");
}

}  // namespace lmd::cuda
