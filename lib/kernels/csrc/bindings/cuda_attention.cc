// lmd.kernels._kernels.cuda: paged attention (cuda/paged_attention.h), with ops.paged_decode_attention's
// checks (bindings/ops.cc) plus the device ones. The lengths and tables live on the device, so their
// values are checked by the kernel (a bad row gets NaN) rather than here, which would synchronise.
#include <cstdint>
#include <string>

#include "bindings/cuda.h"
#include "bindings/kv_cache.h"
#include "cuda/paged_attention.h"

namespace lmd {

namespace {

bool aligned(const TensorView & v, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(v.data) % bytes == 0; }

void paged_decode_attention(py::handle q_h, py::handle k_h, py::handle v_h, py::handle tables_h, py::handle lens_h,
                            float scale, py::handle out_h, uintptr_t stream, py::handle kp_h, py::handle vp_h,
                            py::handle row_seqs_h, py::handle ws_h, int64_t window, py::handle sinks_h) {
    const char * op = "paged_decode_attention";
    const TensorView q = view_of_cuda(q_h, "q"), kc = view_of_cuda(k_h, "k_cache"), vc = view_of_cuda(v_h, "v_cache");
    const TensorView tables = view_of_cuda(tables_h, "block_tables"), lens = view_of_cuda(lens_h, "context_lens");
    const TensorView out = view_of_cuda(out_h, "out");
    expect_same_device({&q, &kc, &vc, &tables, &lens, &out}, op);
    expect(q.ndim == 3 && q.stride(2) == 1 && is_float(q.dtype), "q", q, "must be a float [B, Hq, D] tensor with unit stride in D");
    const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
    expect(cuda::paged_attention_supports(D), "q", q,
           "head_dim " + std::to_string(D) + " is not supported (at most 256, and a multiple of the power of two "
           ">= head_dim / 32: 16, 24, 32, 64, 80, 96, 128, 256 are)");
    expect(kc.ndim == 4, "k_cache", kc, "must be [num_blocks, block_size, Hk, D]");
    const int64_t Hk = kc.size(2);
    KVQuant kv;
    const bool quantized = check_kv_cache(kc, vc, kp_h, vp_h, q.dtype, Hk, D, kv, view_of_cuda);
    // the kernel reads caches in 16-byte vectors and (scale, zero) pairs in 8-byte ones
    expect(aligned(kc, 16), "k_cache", kc, "must start on a 16-byte boundary");
    expect(aligned(vc, 16), "v_cache", vc, "must start on a 16-byte boundary");
    cuda::PagedKVQuant kvq;
    if (quantized) {
        expect_same_device({&q, &kv.k_params, &kv.v_params}, op);
        expect(aligned(kv.k_params, 8), "k_params", kv.k_params, "must start on an 8-byte boundary");
        expect(aligned(kv.v_params, 8), "v_params", kv.v_params, "must start on an 8-byte boundary");
        kvq = {kv.k_params.ptr<float>(), kv.v_params.ptr<float>(), kv.bits};
    }
    expect(Hk > 0 && Hq % Hk == 0, "q", q, "heads must be a multiple of the cache's KV heads");
    expect(kc.size(0) <= INT32_MAX && kc.size(0) * kc.size(1) <= INT32_MAX, "k_cache", kc,
           "must have fewer than 2^31 slots");
    expect(tables.ndim == 2 && tables.dtype == DType::i32 && tables.stride(1) == 1 && tables.size(1) >= 1 &&
           tables.size(1) * kc.size(1) <= 65535 * cuda::kAttentionPartition, "block_tables", tables,
           "must be an int32 [S, max_blocks] tensor with unit stride in its last dim, of at most 65535 * 512 tokens");
    const int32_t * row_seqs = nullptr;
    if (row_seqs_h.is_none()) {
        expect(tables.size(0) == B, "block_tables", tables, "must have one row per query row (or give row_seqs)");
    } else {
        const TensorView rs = view_of_cuda(row_seqs_h, "row_seqs");
        expect_same_device({&q, &rs}, op);
        expect(rs.ndim == 1 && rs.dtype == DType::i32 && rs.stride(0) == 1 && rs.size(0) == B, "row_seqs", rs,
               "must be an int32 [B] tensor");
        row_seqs = rs.ptr<int32_t>();
    }
    expect(lens.ndim == 1 && lens.dtype == DType::i32 && lens.stride(0) == 1 && lens.size(0) == B,
           "context_lens", lens, "must be an int32 [B] tensor");
    expect(out.ndim == 3 && out.stride(2) == 1 && out.dtype == q.dtype && out.size(0) == B && out.size(1) == Hq &&
           out.size(2) == D, "out", out, "must have q's shape and dtype");
    expect(B <= INT32_MAX && Hq <= 65535, "q", q, "must have fewer than 2^31 rows and 65536 heads");
    if (window < 0) fail("window = " + std::to_string(window) + " must be >= 0 (0: the whole context)");
    const float * sinks = nullptr;
    if (!sinks_h.is_none()) {
        const TensorView s = view_of_cuda(sinks_h, "sinks");
        expect_same_device({&q, &s}, op);
        expect(s.ndim == 1 && s.size(0) == Hq && s.dtype == DType::f32 && s.contiguous(), "sinks", s,
               "must be a contiguous float32 [Hq] tensor (a logit per query head)");
        sinks = s.ptr<float>();
    }
    float * workspace = nullptr;
    const int64_t need = cuda::paged_attention_workspace_floats(B, Hq, D, tables.size(1) * kc.size(1));
    if (!ws_h.is_none()) {
        const TensorView ws = view_of_cuda(ws_h, "workspace");
        expect_same_device({&q, &ws}, op);
        expect(ws.dtype == DType::f32 && ws.contiguous() && ws.numel() >= need, "workspace", ws,
               "must be a contiguous float32 tensor of at least paged_attention_workspace_size(...) = " +
               std::to_string(need) + " elements");
        workspace = ws.ptr<float>();
    }
    py::gil_scoped_release release;
    cuda::paged_attention(q, kc, vc, tables, row_seqs, lens, scale, out, kvq, workspace, stream_of(stream), window,
                          sinks);
}

void bind(py::module_ & m) {
    m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("out"), py::arg("stream") = 0,
          py::arg("k_params") = py::none(), py::arg("v_params") = py::none(), py::arg("row_seqs") = py::none(),
          py::arg("workspace") = py::none(), py::arg("window") = 0, py::arg("sinks") = py::none(),
          "ops.paged_decode_attention on the GPU: out[B, Hq, D], query row b attends to the first context_lens[b] "
          "tokens of its table (block_tables[b], or block_tables[row_seqs[b]]: prefill rows of one sequence "
          "share a table, each with its causal length). k_params/v_params: a quantized cache (uint8, 8 or 4 "
          "bits). workspace: float32, paged_attention_workspace_size(...) elements (None: allocated on the "
          "stream when needed). window > 0: each row attends to its last window tokens only. sinks: float32 "
          "[Hq], each head's logit in its softmax's denominator (gpt-oss). A row with a "
          "length or table entry outside the cache gets NaN.");
    m.def("paged_attention_workspace_size", &cuda::paged_attention_workspace_floats, py::arg("num_rows"),
          py::arg("num_heads"), py::arg("head_dim"), py::arg("max_context"),
          "float32 elements of paged_decode_attention's workspace, max_context = block_tables.shape[1] * "
          "block_size: num_rows * num_heads * ceil(max_context / 512) * (head_dim + 2), 0 when max_context <= 512.");
}

}  // namespace

LMD_CUDA_BINDINGS(bind);

}  // namespace lmd
