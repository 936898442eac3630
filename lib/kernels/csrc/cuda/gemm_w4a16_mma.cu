// W4A16 on tensor cores for float16 / bfloat16 activations (linear_w4a16_mma), the prefill
// (M > 8) twin of gemm_quant.cu's kernel. A block of 4 warps owns a 64 x 64 tile of y and walks K
// in 32-wide tiles; 32 divides G, so a tile lies in one group. Per tile it stages x (as is) and
// the 4-bit q (converted to x's type: 0..15 is exact in fp16 and bf16) in shared memory, and the
// warps compute C = x · qᵀ with mma.sync m16n8k16 (float accumulation), then add scale * C +
// min * sum(x) to float accumulators, the reference's per-group formula per 32-wide chunk: the
// products q x are exact, only the order of the float additions differs from the reference.
#include "cuda/common.cuh"
#include "cuda/gemm_quant.h"

namespace lmd::cuda {

namespace {

constexpr int kThreads = 128;          // 4 warps, 2 x 2 over the tile, 32 x 32 each
constexpr int kBM = 64, kBN = 64, kBK = 32;
constexpr int kPitch = kBK + 8;        // elements a row of a shared tile takes: fragment loads conflict-free

template <typename T> struct Mma;
template <> struct Mma<__half> {
    __device__ static void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct Mma<__nv_bfloat16> {
    __device__ static void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

// Two consecutive 16-bit elements of a shared tile as the 32-bit register mma takes.
template <typename T>
__device__ __forceinline__ uint32_t pair(const T * p) { return *reinterpret_cast<const uint32_t *>(p); }

template <typename T>
__global__ void __launch_bounds__(kThreads)
w4a16_mma_kernel(const T * __restrict__ x, int64_t ldx, int64_t M, const uint8_t * __restrict__ qweight,
                 const float * __restrict__ scales, const float * __restrict__ mins, const float * __restrict__ bias,
                 T * __restrict__ y, int64_t ldy, int64_t N, int64_t K, int64_t group_size) {
    __shared__ __align__(16) T xs[kBM][kPitch];
    __shared__ __align__(16) T qs[kBN][kPitch];
    __shared__ float xsum[kBM], sc[kBN], mn[kBN];
    const int64_t m0 = int64_t(blockIdx.y) * kBM, n0 = int64_t(blockIdx.x) * kBN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;  // the warp's 32 x 32 within the tile
    const int gid = lane / 4, tig = lane % 4;              // mma's groupID, threadID_in_group
    const int64_t num_groups = K / group_size;

    float acc[2][4][4];  // [m16 tile][n8 tile][fragment]: rows wm + 16 i + gid (+ 8), cols wn + 8 j + 2 tig (+ 1)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    for (int64_t k0 = 0; k0 < K; k0 += kBK) {
        // x tile, zero rows past M
        for (int i = threadIdx.x; i < kBM * kBK; i += kThreads) {
            const int r = i / kBK, c = i % kBK;
            xs[r][c] = m0 + r < M ? x[(m0 + r) * ldx + k0 + c] : from_f32<T>(0.f);
        }
        // q tile: thread t < 64 converts row n0 + t's 16 bytes (element k0 + 2 b + h in nibble h of byte b)
        if (threadIdx.x < kBN) {
            const int r = threadIdx.x;
            const int64_t n = n0 + r;
            uint4 w = make_uint4(0, 0, 0, 0);
            float s = 0.f, mi = 0.f;
            if (n < N) {
                w = *reinterpret_cast<const uint4 *>(qweight + n * (K / 2) + k0 / 2);
                s = scales[n * num_groups + k0 / group_size];
                mi = mins[n * num_groups + k0 / group_size];
            }
            const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int t = 0; t < 8; ++t) qs[r][8 * i + t] = from_f32<T>(static_cast<float>((words[i] >> (4 * t)) & 0xFu));
            sc[r] = s, mn[r] = mi;
        }
        __syncthreads();
        if (threadIdx.x < kBM) {  // the chunk sums of x, in the order gemm_quant.cu adds them
            float s = 0.f;
            for (int c = 0; c < kBK; ++c) s += to_f32(xs[threadIdx.x][c]);
            xsum[threadIdx.x] = s;
        }
        float c[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) c[i][j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kBK; kk += 16) {
            uint32_t a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = wm + 16 * i + gid;
                a[i][0] = pair(&xs[r][kk + 2 * tig]);
                a[i][1] = pair(&xs[r + 8][kk + 2 * tig]);
                a[i][2] = pair(&xs[r][kk + 8 + 2 * tig]);
                a[i][3] = pair(&xs[r + 8][kk + 8 + 2 * tig]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int n = wn + 8 * j + gid;
                b[j][0] = pair(&qs[n][kk + 2 * tig]);
                b[j][1] = pair(&qs[n][kk + 8 + 2 * tig]);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) Mma<T>::run(c[i][j], a[i], b[j]);
        }
        __syncthreads();  // xsum written
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = wm + 16 * i + gid + (e >= 2 ? 8 : 0), col = wn + 8 * j + 2 * tig + (e & 1);
                    acc[i][j][e] = __fadd_rn(acc[i][j][e], __fmaf_rn(sc[col], c[i][j][e], __fmul_rn(mn[col], xsum[r])));
                }
        __syncthreads();  // before the next tile overwrites xs, qs, sc, mn, xsum
    }

#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int64_t m = m0 + wm + 16 * i + gid + (e >= 2 ? 8 : 0), n = n0 + wn + 8 * j + 2 * tig + (e & 1);
                if (m < M && n < N) y[m * ldy + n] = from_f32<T>(bias ? __fadd_rn(acc[i][j][e], bias[n]) : acc[i][j][e]);
            }
}

}  // namespace

void linear_w4a16_mma(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                      const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t group_size,
                      cudaStream_t stream) {
    const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
    if (M == 0 || N == 0) return;
    if (ceil_div(M, kBM) > 65535) throw std::invalid_argument("linear_w4a16_mma: M is too large (at most 65535 * 64)");
    const dim3 grid(static_cast<unsigned>(ceil_div(N, kBN)), static_cast<unsigned>(ceil_div(M, kBM)));
    const float * b = bias ? bias->ptr<float>() : nullptr;
    auto launch = [&]<typename T>() {
        w4a16_mma_kernel<T><<<grid, kThreads, 0, stream>>>(x.ptr<T>(), x.stride(0), M, qweight.ptr<uint8_t>(),
                                                           scales.ptr<float>(), mins.ptr<float>(), b, y.ptr<T>(),
                                                           y.stride(0), N, K, group_size);
    };
    if (x.dtype == DType::f16) launch.template operator()<__half>();
    else if (x.dtype == DType::bf16) launch.template operator()<__nv_bfloat16>();
    else throw std::invalid_argument("linear_w4a16_mma: x must be float16 or bfloat16");
    LMD_CUDA_LAUNCHED("linear_w4a16_mma");
}

}  // namespace lmd::cuda
