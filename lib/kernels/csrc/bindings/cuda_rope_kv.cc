// lmd.kernels._kernels.cuda: RoPE + KV-cache fill (cuda/rope_kv.h), with ops.rope_fill_kv's argument
// checks, except the range checks of positions and slots: those live on the device, and the kernel
// handles a value out of range without touching memory outside the tensors (see cuda/rope_kv.h).
#include "bindings/cuda.h"
#include "cuda/rope_kv.h"

namespace lmd {

namespace {

// The caches of a float model (dtype = the model's) or, with k_params/v_params given, a quantized one
// (uint8 rows of D codes, 8 bits, or D / 2 bytes, 4 bits): checked as ops.cc's check_kv_cache does.
bool check_kv_cache(const TensorView & kc, const TensorView & vc, py::handle kp_h, py::handle vp_h, DType dtype,
                    int64_t num_kv_heads, int64_t D, cuda::KVQuantView & kvq) {
    const bool quantized = !kp_h.is_none() || !vp_h.is_none();
    if (!quantized) {
        expect(kc.ndim == 4 && kc.contiguous() && kc.dtype == dtype && kc.size(2) == num_kv_heads && kc.size(3) == D,
               "k_cache", kc, "must be a contiguous [num_blocks, block_size, " + std::to_string(num_kv_heads) + ", " +
               std::to_string(D) + "] tensor of " + dtype_name(dtype));
    } else {
        if (kp_h.is_none() || vp_h.is_none()) fail("k_params and v_params: give both (a quantized cache) or neither");
        expect(kc.ndim == 4 && kc.contiguous() && kc.dtype == DType::u8 && kc.size(2) == num_kv_heads &&
               (kc.size(3) == D || (D % 2 == 0 && kc.size(3) == D / 2)), "k_cache", kc,
               "a quantized cache must be a contiguous uint8 [num_blocks, block_size, " + std::to_string(num_kv_heads) +
               ", D or D / 2] tensor (8 or 4 bits), D = " + std::to_string(D));
        kvq.bits = kc.size(3) == D ? 8 : 4;
        kvq.k_params = view_of_cuda(kp_h, "k_params");
        kvq.v_params = view_of_cuda(vp_h, "v_params");
        for (const TensorView * p : {&kvq.k_params, &kvq.v_params}) {
            expect(p->ndim == 4 && p->contiguous() && p->dtype == DType::f32 && p->size(0) == kc.size(0) &&
                   p->size(1) == kc.size(1) && p->size(2) == kc.size(2) && p->size(3) == 2,
                   p == &kvq.k_params ? "k_params" : "v_params", *p,
                   "must be a contiguous float32 [num_blocks, block_size, Hk, 2] tensor (scale, zero)");
        }
    }
    expect(vc.ndim == 4 && vc.contiguous() && vc.dtype == kc.dtype, "v_cache", vc, "must match k_cache");
    for (int i = 0; i < 4; ++i) expect(vc.size(i) == kc.size(i), "v_cache", vc, "must have k_cache's shape");
    return quantized;
}

void rope_fill_kv(py::handle qkv_h, py::handle pos_h, py::handle cs_h, py::handle k_h, py::handle v_h,
                  py::handle slots_h, py::handle q_out_h, int64_t num_heads, int64_t num_kv_heads, py::handle kp_h,
                  py::handle vp_h, uintptr_t stream) {
    const TensorView qkv = view_of_cuda(qkv_h, "qkv"), pos = view_of_cuda(pos_h, "positions");
    const TensorView cs = view_of_cuda(cs_h, "cos_sin"), kc = view_of_cuda(k_h, "k_cache");
    const TensorView vc = view_of_cuda(v_h, "v_cache"), slots = view_of_cuda(slots_h, "slots");
    const TensorView q_out = view_of_cuda(q_out_h, "q_out");
    if (num_heads < 1 || num_kv_heads < 1 || num_heads > 4096 || num_kv_heads > 4096) {
        fail("num_heads and num_kv_heads must be in [1, 4096], got " + std::to_string(num_heads) + " and " +
             std::to_string(num_kv_heads));
    }
    const int64_t T = qkv.size(0);
    expect(T < (int64_t(1) << 32) / (num_heads + 2 * num_kv_heads), "qkv", qkv, "has too many rows for one launch");
    expect(q_out.ndim == 3 && q_out.contiguous() && q_out.size(0) == T && q_out.size(1) == num_heads &&
           q_out.dtype == qkv.dtype && q_out.size(2) >= 1 && q_out.size(2) <= 4096, "q_out", q_out,
           "must be a contiguous [T, num_heads, D] tensor with qkv's dtype and 1 <= D <= 4096");
    const int64_t D = q_out.size(2);
    expect(qkv.ndim == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D &&
           is_float(qkv.dtype), "qkv", qkv, "must be a float [T, (Hq + 2 Hk) * D] tensor with unit stride in its last dim");
    expect(pos.ndim == 1 && pos.size(0) == T && pos.dtype == DType::i64 && pos.stride(0) == 1, "positions", pos,
           "must be an int64 [T] tensor");
    expect(slots.ndim == 1 && slots.size(0) == T && slots.dtype == DType::i64 && slots.stride(0) == 1, "slots", slots,
           "must be an int64 [T] tensor");
    expect(cs.ndim == 2 && cs.stride(1) == 1 && cs.size(1) % 2 == 0 && cs.size(1) <= D && cs.dtype == qkv.dtype,
           "cos_sin", cs, "must be [max_position, rot] with even rot <= head_dim and qkv's dtype");
    expect(kc.ndim == 4, "k_cache", kc, "must be [num_blocks, block_size, Hk, D]");
    cuda::KVQuantView kvq;
    const bool quantized = check_kv_cache(kc, vc, kp_h, vp_h, qkv.dtype, num_kv_heads, D, kvq);
    if (quantized) {
        expect_same_device({&qkv, &pos, &cs, &kc, &vc, &slots, &q_out, &kvq.k_params, &kvq.v_params}, "rope_fill_kv");
    } else {
        expect_same_device({&qkv, &pos, &cs, &kc, &vc, &slots, &q_out}, "rope_fill_kv");
    }
    cuda::rope_fill_kv(qkv, pos, cs, kc, vc, slots, q_out, num_heads, num_kv_heads, quantized ? &kvq : nullptr,
                       stream_of(stream));
}

void bind(py::module_ & m) {
    m.def("rope_fill_kv", &rope_fill_kv, py::arg("qkv"), py::arg("positions"), py::arg("cos_sin"),
          py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("q_out"), py::arg("num_heads"),
          py::arg("num_kv_heads"), py::arg("k_params") = py::none(), py::arg("v_params") = py::none(),
          py::arg("stream") = 0,
          "ops.rope_fill_kv on the GPU: rotate q (into q_out) and k (into the cache at slots) of a fused qkv; "
          "copy v into the cache, quantized with k_params / v_params. A position outside cos_sin gives a q_out "
          "of zeros and writes no k / v; a slot outside the cache (e.g. -1) writes no k / v.");
}

}  // namespace

LMD_CUDA_BINDINGS(bind);

}  // namespace lmd
