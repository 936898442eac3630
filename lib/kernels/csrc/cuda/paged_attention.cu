// Paged attention on the GPU, as cpu::ref::decode_attention_task computes it: scores q·k in float,
// times scale, softmax in float (max, exp, sum), then Σ p v / Σ p, rounded once to out's dtype.
// One thread block per (row, q head, partition of 512 tokens): its warps take keys in turn, the lanes
// of a warp split head_dim (E contiguous elements each, read in one load). A context longer than one
// partition leaves each partition's (max, sum, unnormalised Σ p v) in a float workspace and
// combine_kernel merges them by log-sum-exp. Only the summation order differs from the reference.
// A sliding-window row (window > 0) reads its last `window` tokens, partitions counted from the first.
// An attention sink (gpt-oss) joins the softmax once: in the block's max and sum when one partition
// covers the row, else in combine_kernel's.
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/paged_attention.h"

namespace lmd::cuda {

namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kPart = static_cast<int>(kAttentionPartition);
constexpr int kMaxD = 256;

struct Args {
    const void * q;
    int64_t q_row, q_head;
    const void * k;
    const void * v;
    const float * k_params;
    const float * v_params;
    const int32_t * tables;
    int64_t table_stride;
    int num_tables, max_blocks;
    const int32_t * row_seqs;
    const int32_t * lens;
    void * out;
    int64_t o_row, o_head;
    float * ws;  // null: one partition, the block writes out
    int num_blocks, block_size, num_kv_heads, group, num_heads, D, parts;
    int window;  // > 0: a row attends to its last `window` tokens only
    float scale;
    const float * sinks;  // [Hq] a logit per head in each softmax's denominator, or null
};

// Bytes read as one aligned unit (16-byte loads for 16 and 32 bytes).
template <int Bytes>
struct alignas(Bytes >= 16 ? 16 : Bytes) Raw {
    unsigned char b[Bytes];
};

// The E values of cache row r (a (slot, kv head) row) that `lane` holds: elements [lane E, lane E + E),
// dequantized as the reference does (code * scale, then + zero, no fused multiply-add).
template <typename C, int Bits, int E>
__device__ __forceinline__ void load_row(const void * cache, const float * params, int64_t r, int D, int lane,
                                         float (&x)[E]) {
    if constexpr (Bits == 0) {
        const C * p = static_cast<const C *>(cache) + r * D + lane * E;
        const Raw<E * sizeof(C)> raw = *reinterpret_cast<const Raw<E * sizeof(C)> *>(p);
        const C * c = reinterpret_cast<const C *>(raw.b);
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = to_f32(c[j]);
    } else {
        const float2 sz = *reinterpret_cast<const float2 *>(params + r * 2);
        const uint8_t * row = static_cast<const uint8_t *>(cache) + r * (D * Bits / 8);
        int code[E];
        if constexpr (Bits == 8) {
            const Raw<E> raw = *reinterpret_cast<const Raw<E> *>(row + lane * E);
#pragma unroll
            for (int j = 0; j < E; ++j) code[j] = raw.b[j];
        } else if constexpr (E == 1) {  // half a byte: element `lane`
            code[0] = (row[lane >> 1] >> ((lane & 1) << 2)) & 0xF;
        } else {
            const Raw<E / 2> raw = *reinterpret_cast<const Raw<E / 2> *>(row + lane * (E / 2));
#pragma unroll
            for (int j = 0; j < E; ++j) code[j] = (raw.b[j >> 1] >> ((j & 1) << 2)) & 0xF;
        }
#pragma unroll
        for (int j = 0; j < E; ++j) x[j] = __fadd_rn(__fmul_rn(static_cast<float>(code[j]), sz.x), sz.y);
    }
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float part[kWarps];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float m = part[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, part[w]);
    return m;
}

// The length of row b's context, or -1 when the row's length or table is not valid.
__device__ __forceinline__ int row_len(const Args & a, int b, int & seq) {
    seq = a.row_seqs ? a.row_seqs[b] : b;
    const int len = a.lens[b];
    if (seq < 0 || seq >= a.num_tables || len < 1 || len > a.max_blocks * a.block_size) return -1;
    return len;
}

// The first token row b attends to: its window's start, or 0. Partitions count from there.
__device__ __forceinline__ int row_first(const Args & a, int len) { return a.window > 0 ? max(0, len - a.window) : 0; }

template <typename T>
__device__ __forceinline__ void write_nan(const Args & a, int b, int h) {
    T * o = static_cast<T *>(a.out) + b * a.o_row + h * a.o_head;
    for (int d = threadIdx.x; d < a.D; d += blockDim.x) o[d] = from_f32<T>(NAN);
}

// grid (B, Hq, parts), kThreads threads. C: the cache's element type (uint8_t when quantized).
template <typename T, typename C, int Bits, int E>
__global__ void __launch_bounds__(kThreads) attention_kernel(const Args a) {
    const int b = blockIdx.x, h = blockIdx.y, part = blockIdx.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int seq;
    const int len = row_len(a, b, seq);
    if (len < 0) {  // block-uniform: every thread leaves
        if (!a.ws && part == 0) write_nan<T>(a, b, h);
        return;  // with a workspace, combine_kernel writes the NaN
    }
    const int t0 = row_first(a, len) + part * kPart;
    if (t0 >= len) return;
    const int t1 = min(len, t0 + kPart);
    const int kv_head = h / a.group;
    const int32_t * table = a.tables + seq * a.table_stride;
    const bool active = lane * E < a.D;  // the lanes past head_dim hold zeros

    float qf[E];
    const T * qrow = static_cast<const T *>(a.q) + b * a.q_row + h * a.q_head;
#pragma unroll
    for (int j = 0; j < E; ++j) qf[j] = active ? to_f32(qrow[lane * E + j]) : 0.f;

    __shared__ float p[kPart];  // scores, then their exponentials
    int bad = 0;
    float max_s = -INFINITY;
    for (int t = t0 + warp; t < t1; t += kWarps) {
        const int blk = table[t / a.block_size];  // warp-uniform, so the branch is too
        if (blk < 0 || blk >= a.num_blocks) {
            bad = 1;
            continue;
        }
        const int64_t r = (int64_t(blk) * a.block_size + t % a.block_size) * a.num_kv_heads + kv_head;
        float kf[E] = {};
        if (active) load_row<C, Bits, E>(a.k, a.k_params, r, a.D, lane, kf);
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < E; ++j) dot += qf[j] * kf[j];
        const float s = warp_sum(dot) * a.scale;
        if (lane == 0) p[t - t0] = s;
        max_s = fmaxf(max_s, s);
    }
    if (__syncthreads_or(bad)) {  // a block outside the cache: NaN, not a wild read
        if (!a.ws) {
            write_nan<T>(a, b, h);
        } else if (threadIdx.x == 0) {
            float * w = a.ws + ((int64_t(b) * a.num_heads + h) * a.parts + part) * (a.D + 2);
            for (int d = 0; d < a.D; ++d) w[d] = 0.f;
            w[a.D] = 0.f;
            w[a.D + 1] = NAN;  // the combined sum, so the row, is NaN
        }
        return;
    }
    // synchronises: p is complete. One partition: the sink's logit joins here (else in combine_kernel)
    const bool sink = a.sinks && !a.ws;
    const float m = sink ? fmaxf(block_max(max_s), a.sinks[h]) : block_max(max_s);
    float sum = 0.f;
    for (int i = threadIdx.x; i < t1 - t0; i += kThreads) {
        const float e = expf(p[i] - m);
        p[i] = e;
        sum += e;
    }
    sum = block_sum(sum);  // synchronises: the exponentials are visible to every warp
    if (sink) sum += expf(a.sinks[h] - m);

    float acc[E] = {};
    for (int t = t0 + warp; t < t1; t += kWarps) {
        const int blk = table[t / a.block_size];
        const int64_t r = (int64_t(blk) * a.block_size + t % a.block_size) * a.num_kv_heads + kv_head;
        float vf[E] = {};
        if (active) load_row<C, Bits, E>(a.v, a.v_params, r, a.D, lane, vf);
        const float w = p[t - t0];
#pragma unroll
        for (int j = 0; j < E; ++j) acc[j] += w * vf[j];
    }
    __shared__ float red[kWarps][kMaxD];
    if (active) {
#pragma unroll
        for (int j = 0; j < E; ++j) red[warp][lane * E + j] = acc[j];
    }
    __syncthreads();
    float * w = a.ws ? a.ws + ((int64_t(b) * a.num_heads + h) * a.parts + part) * (a.D + 2) : nullptr;
    T * o = static_cast<T *>(a.out) + b * a.o_row + h * a.o_head;
    for (int d = threadIdx.x; d < a.D; d += kThreads) {
        float v = red[0][d];
#pragma unroll
        for (int k = 1; k < kWarps; ++k) v += red[k][d];
        if (w) {
            w[d] = v;
        } else {
            o[d] = from_f32<T>(v / sum);
        }
    }
    if (w && threadIdx.x == 0) {
        w[a.D] = m;
        w[a.D + 1] = sum;
    }
}

// grid (B, Hq), kThreads threads: out = Σ_i acc_i e^(m_i - M) / Σ_i sum_i e^(m_i - M), M = max_i m_i.
template <typename T>
__global__ void __launch_bounds__(kThreads) combine_kernel(const Args a) {
    const int b = blockIdx.x, h = blockIdx.y;
    int seq;
    const int len = row_len(a, b, seq);
    if (len < 0) {
        write_nan<T>(a, b, h);
        return;
    }
    const int n = (len - row_first(a, len) + kPart - 1) / kPart, stride = a.D + 2;
    const float * w = a.ws + (int64_t(b) * a.num_heads + h) * a.parts * stride;
    float M = -INFINITY;
    for (int i = 0; i < n; ++i) M = fmaxf(M, w[i * stride + a.D]);
    if (a.sinks) M = fmaxf(M, a.sinks[h]);
    float S = a.sinks ? expf(a.sinks[h] - M) : 0.f;
    for (int i = 0; i < n; ++i) S += w[i * stride + a.D + 1] * expf(w[i * stride + a.D] - M);
    T * o = static_cast<T *>(a.out) + b * a.o_row + h * a.o_head;
    for (int d = threadIdx.x; d < a.D; d += kThreads) {
        float v = 0.f;
        for (int i = 0; i < n; ++i) v += w[i * stride + d] * expf(w[i * stride + a.D] - M);
        o[d] = from_f32<T>(v / S);
    }
}

// The elements per lane: the power of two >= D / 32 (0 for a head dim the kernel does not take).
int lane_elems(int64_t D) {
    if (D < 1 || D > kMaxD) return 0;
    int e = 1;
    while (e * 32 < D) e *= 2;
    return D % e == 0 ? e : 0;
}

template <typename T, typename C, int Bits>
void launch(const Args & a, int E, dim3 grid, cudaStream_t stream) {
    switch (E) {
        case 1: attention_kernel<T, C, Bits, 1><<<grid, kThreads, 0, stream>>>(a); break;
        case 2: attention_kernel<T, C, Bits, 2><<<grid, kThreads, 0, stream>>>(a); break;
        case 4: attention_kernel<T, C, Bits, 4><<<grid, kThreads, 0, stream>>>(a); break;
        case 8: attention_kernel<T, C, Bits, 8><<<grid, kThreads, 0, stream>>>(a); break;
        default: throw std::invalid_argument("paged_attention: unsupported head_dim");
    }
}

}  // namespace

bool paged_attention_supports(int64_t head_dim) { return lane_elems(head_dim) != 0; }

int64_t paged_attention_workspace_floats(int64_t rows, int64_t num_heads, int64_t head_dim, int64_t max_context) {
    const int64_t parts = ceil_div(std::max<int64_t>(max_context, 1), kAttentionPartition);
    return parts > 1 ? rows * num_heads * parts * (head_dim + 2) : 0;
}

void paged_attention(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                     const TensorView & block_tables, const int32_t * row_seqs, const TensorView & context_lens,
                     float scale, const TensorView & out, const PagedKVQuant & kv_quant, float * workspace,
                     cudaStream_t stream, int64_t window, const float * sinks) {
    const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
    if (B == 0 || Hq == 0) return;
    const int E = lane_elems(D);
    if (E == 0) throw std::invalid_argument("paged_attention: unsupported head_dim " + std::to_string(D));
    Args a{};
    a.q = q.data;
    a.q_row = q.stride(0);
    a.q_head = q.stride(1);
    a.k = k_cache.data;
    a.v = v_cache.data;
    a.k_params = kv_quant.k_params;
    a.v_params = kv_quant.v_params;
    a.tables = block_tables.ptr<int32_t>();
    a.table_stride = block_tables.stride(0);
    a.num_tables = static_cast<int>(block_tables.size(0));
    a.max_blocks = static_cast<int>(block_tables.size(1));
    a.row_seqs = row_seqs;
    a.lens = context_lens.ptr<int32_t>();
    a.out = out.data;
    a.o_row = out.stride(0);
    a.o_head = out.stride(1);
    a.num_blocks = static_cast<int>(k_cache.size(0));
    a.block_size = static_cast<int>(k_cache.size(1));
    a.num_kv_heads = static_cast<int>(k_cache.size(2));
    a.num_heads = static_cast<int>(Hq);
    a.group = static_cast<int>(Hq / k_cache.size(2));
    a.D = static_cast<int>(D);
    a.scale = scale;
    a.window = static_cast<int>(std::min<int64_t>(window, INT32_MAX));
    a.sinks = sinks;
    const int64_t max_context = block_tables.size(1) * k_cache.size(1);
    a.parts = static_cast<int>(ceil_div(std::max<int64_t>(max_context, 1), kAttentionPartition));
    const int64_t ws_floats = paged_attention_workspace_floats(B, Hq, D, max_context);
    bool owned = false;
    if (ws_floats > 0) {
        if (!workspace) {
            void * p = nullptr;
            LMD_CUDA_CHECK(cudaMallocAsync(&p, ws_floats * sizeof(float), stream));
            workspace = static_cast<float *>(p);
            owned = true;
        }
        a.ws = workspace;
    }
    const dim3 grid(static_cast<unsigned>(B), static_cast<unsigned>(Hq), static_cast<unsigned>(a.parts));
    try {
        dispatch_float(q.dtype, "paged_attention", [&]<typename T>() {
            switch (kv_quant.bits) {
                case 0: launch<T, T, 0>(a, E, grid, stream); break;
                case 8: launch<T, uint8_t, 8>(a, E, grid, stream); break;
                case 4: launch<T, uint8_t, 4>(a, E, grid, stream); break;
                default: throw std::invalid_argument("paged_attention: kv bits must be 0, 8 or 4");
            }
            LMD_CUDA_LAUNCHED("paged_attention");
            if (a.ws) {
                combine_kernel<T><<<dim3(static_cast<unsigned>(B), static_cast<unsigned>(Hq)), kThreads, 0, stream>>>(a);
                LMD_CUDA_LAUNCHED("paged_attention combine");
            }
        });
    } catch (...) {
        if (owned) cudaFreeAsync(workspace, stream);
        throw;
    }
    if (owned) LMD_CUDA_CHECK(cudaFreeAsync(workspace, stream));
}

}  // namespace lmd::cuda
