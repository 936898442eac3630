// RoPE + KV-cache fill on the GPU, one warp per (token, head) of q, k and v. The arithmetic is the
// CPU reference's (cpu/kernels_ref.cc rope_fill_kv_row, kv_quantize_row) operation for operation,
// with the _rn intrinsics so that nvcc does not fuse a multiply and an add the reference rounds
// separately: the results are the reference's bit for bit.
#include "cuda/common.cuh"
#include "cuda/rope_kv.h"

namespace lmd::cuda {

namespace {

constexpr int kWarps = 4;  // warps per block

struct RopeArgs {
    int64_t ldq;         // qkv's row stride
    const int64_t * pos;
    int64_t ldcs, max_pos;
    int half, rot, D, Hq, Hk;
    const int64_t * slots;
    int64_t num_slots, jobs;  // jobs = T * (Hq + 2 Hk)
    void * k_cache;
    void * v_cache;
    float * k_params;
    float * v_params;
};

// Element d of the head at src, rotated with the table row cs (reference: rotate()).
template <typename T>
__device__ __forceinline__ float rotated(const T * src, const T * cs, int half, int rot, int d) {
    if (d < half) {
        const float c = to_f32(cs[d]), s = to_f32(cs[half + d]);
        return __fsub_rn(__fmul_rn(to_f32(src[d]), c), __fmul_rn(to_f32(src[half + d]), s));
    }
    if (d < rot) {
        const int i = d - half;
        const float c = to_f32(cs[i]), s = to_f32(cs[half + i]);
        return __fadd_rn(__fmul_rn(to_f32(src[d]), c), __fmul_rn(to_f32(src[i]), s));
    }
    return to_f32(src[d]);
}

__device__ __forceinline__ int kv_code(float x, float lo, float inv, int qmax) {
    const float c = rintf(__fmul_rn(__fsub_rn(x, lo), inv));  // rint: half to even, as nearbyint
    return c < 0.f ? 0 : c > static_cast<float>(qmax) ? qmax : static_cast<int>(c);
}

// kBits: 0 for a cache of T, else 8 or 4 (uint8 codes + float32 scale and zero per row).
template <typename T, int kBits>
__global__ void rope_fill_kv_kernel(const T * __restrict__ qkv, const T * __restrict__ cos_sin,
                                    T * __restrict__ q_out, RopeArgs a) {
    const int64_t job = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (job >= a.jobs) return;  // the whole warp leaves: no block-wide sync below
    const int lane = threadIdx.x % 32, heads = a.Hq + 2 * a.Hk, D = a.D;
    const int64_t t = job / heads;
    const int h = static_cast<int>(job % heads);
    const int64_t p = a.pos[t];
    const bool bad_pos = p < 0 || p >= a.max_pos;
    const T * cs = cos_sin + (bad_pos ? 0 : p) * a.ldcs;
    const T * src = qkv + t * a.ldq + int64_t(h) * D;  // k heads follow q's, v heads follow k's
    if (h < a.Hq) {
        T * dst = q_out + (t * a.Hq + h) * D;
        for (int d = lane; d < D; d += 32) dst[d] = from_f32<T>(bad_pos ? 0.f : rotated(src, cs, a.half, a.rot, d));
        return;
    }
    const int64_t slot = a.slots[t];
    if (bad_pos || slot < 0 || slot >= a.num_slots) return;
    const bool is_k = h < a.Hq + a.Hk;
    const int kh = h - a.Hq - (is_k ? 0 : a.Hk);
    const int64_t r = slot * a.Hk + kh;  // the (slot, head) row of the caches
    auto value = [&](int d) { return is_k ? rotated(src, cs, a.half, a.rot, d) : to_f32(src[d]); };
    if constexpr (kBits == 0) {
        T * dst = static_cast<T *>(is_k ? a.k_cache : a.v_cache) + r * D;
        for (int d = lane; d < D; d += 32) dst[d] = from_f32<T>(value(d));
    } else {
        float lo = INFINITY, hi = -INFINITY;  // fmin/fmax: exact, so any order gives the reference's
        for (int d = lane; d < D; d += 32) {
            const float v = value(d);
            lo = fminf(lo, v);
            hi = fmaxf(hi, v);
        }
        for (int o = 16; o > 0; o >>= 1) {
            lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
            hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        constexpr int qmax = (1 << kBits) - 1;
        const float scale = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(qmax));
        const float inv = scale > 0.f ? __fdiv_rn(1.f, scale) : 0.f;
        uint8_t * q = static_cast<uint8_t *>(is_k ? a.k_cache : a.v_cache) + r * (D * kBits / 8);
        if constexpr (kBits == 8) {
            for (int d = lane; d < D; d += 32) q[d] = static_cast<uint8_t>(kv_code(value(d), lo, inv, qmax));
        } else {
            for (int j = lane; j < D / 2; j += 32) {
                const int c0 = kv_code(value(2 * j), lo, inv, qmax), c1 = kv_code(value(2 * j + 1), lo, inv, qmax);
                q[j] = static_cast<uint8_t>(c0 | (c1 << 4));
            }
        }
        if (lane == 0) {
            float * params = (is_k ? a.k_params : a.v_params) + r * 2;
            params[0] = scale;
            params[1] = lo;
        }
    }
}

}  // namespace

void rope_fill_kv(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                  const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                  const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, const KVQuant * kv_quant,
                  cudaStream_t stream) {
    const int64_t T = qkv.size(0);
    RopeArgs a{};
    a.ldq = qkv.stride(0);
    a.pos = positions.ptr<int64_t>();
    a.ldcs = cos_sin.stride(0);
    a.max_pos = cos_sin.size(0);
    a.rot = static_cast<int>(cos_sin.size(1));
    a.half = a.rot / 2;
    a.D = static_cast<int>(q_out.size(2));
    a.Hq = static_cast<int>(num_heads);
    a.Hk = static_cast<int>(num_kv_heads);
    a.slots = slots.ptr<int64_t>();
    a.num_slots = k_cache.size(0) * k_cache.size(1);
    a.jobs = T * (num_heads + 2 * num_kv_heads);
    a.k_cache = k_cache.data;
    a.v_cache = v_cache.data;
    if (kv_quant) {
        a.k_params = kv_quant->k_params.ptr<float>();
        a.v_params = kv_quant->v_params.ptr<float>();
    }
    if (a.jobs == 0 || a.D == 0) return;
    const unsigned blocks = static_cast<unsigned>(ceil_div(a.jobs, kWarps));
    const int bits = kv_quant ? kv_quant->bits : 0;
    dispatch_float(qkv.dtype, "rope_fill_kv", [&]<typename E>() {
        const E * x = qkv.ptr<E>();
        const E * cs = cos_sin.ptr<E>();
        E * q = q_out.ptr<E>();
        if (bits == 8) {
            rope_fill_kv_kernel<E, 8><<<blocks, kWarps * 32, 0, stream>>>(x, cs, q, a);
        } else if (bits == 4) {
            rope_fill_kv_kernel<E, 4><<<blocks, kWarps * 32, 0, stream>>>(x, cs, q, a);
        } else {
            rope_fill_kv_kernel<E, 0><<<blocks, kWarps * 32, 0, stream>>>(x, cs, q, a);
        }
    });
    LMD_CUDA_LAUNCHED("rope_fill_kv");
}

}  // namespace lmd::cuda
