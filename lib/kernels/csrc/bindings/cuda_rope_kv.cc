// lmd.kernels._kernels.cuda: RoPE + KV-cache fill (cuda/rope_kv.h), with ops.rope_fill_kv's argument
// checks, except the range checks of positions and slots: those live on the device, and the kernel
// handles a value out of range without touching memory outside the tensors (see cuda/rope_kv.h).
#include "bindings/cuda.h"
#include "bindings/kv_cache.h"
#include "cuda/rope_kv.h"

namespace lmd {

namespace {

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
    KVQuant kvq;
    const bool quantized = check_kv_cache(kc, vc, kp_h, vp_h, qkv.dtype, num_kv_heads, D, kvq, view_of_cuda);
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
