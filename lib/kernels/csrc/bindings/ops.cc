// lmd.kernels.ops: the CPU kernels, callable on any DLPack-exporting array
// (torch.utils.dlpack.to_dlpack(t), or a HostTensor made once from such a capsule for
// tensors passed often, like weights). Arguments are borrowed, never consumed: the
// caller's array stays alive for the call and keeps its memory. The GIL is released
// while a kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/dlpack.h"
#include "core/py_tensor.h"
#include "core/tensor.h"
#include "bindings/kv_cache.h"
#include "cpu/argmax.h"
#include "cpu/draft_length.h"
#include "cpu/kernels.h"
#include "cpu/lora.h"
#include "cpu/ngram.h"

namespace py = pybind11;

namespace lmd {

namespace {

void linear(py::handle x_h, py::handle w_h, py::handle bias_h, py::handle y_h, bool reference) {
    const TensorView x = view_of(x_h, "x"), w = view_of(w_h, "w"), y = view_of(y_h, "y");
    TensorView bias;
    const bool has_bias = !bias_h.is_none();
    if (has_bias) bias = view_of(bias_h, "bias");
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    expect(w.ndim == 2 && w.contiguous() && is_float(w.dtype), "w", w, "must be a contiguous float [N, K] tensor");
    expect(w.size(1) == x.size(1), "w", w, "K must match x's " + std::to_string(x.size(1)));
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.size(1) == w.size(0) && y.dtype == x.dtype,
           "y", y, "must be [M, N] = [" + std::to_string(x.size(0)) + ", " + std::to_string(w.size(0)) +
           "] with x's dtype and unit stride in N");
    if (has_bias) {
        expect(bias.ndim == 1 && bias.size(0) == w.size(0) && bias.contiguous() && bias.dtype == w.dtype, "bias",
               bias, "must be [N] with w's dtype");
    }
    py::gil_scoped_release release;
    cpu::linear(x, w, has_bias ? &bias : nullptr, y, reference);
}

// a, b: per slot, the adapter's A [R, K] and B [N, R] (each None where the adapter does not touch
// this matmul); every slot a row names must be one of them.
void lora_apply(py::handle x_h, py::handle y_h, py::handle slots_h, const py::sequence & a_h, const py::sequence & b_h,
                bool reference) {
    const TensorView x = view_of(x_h, "x"), y = view_of(y_h, "y"), rs = view_of(slots_h, "row_slots");
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [T, K] tensor with unit stride in K");
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && is_float(y.dtype), "y", y,
           "must be a float [T, N] tensor with x's T rows and unit stride in N");
    expect(rs.ndim == 1 && rs.dtype == DType::i32 && rs.contiguous() && rs.size(0) == x.size(0), "row_slots", rs,
           "must be a contiguous int32 [T] tensor (-1: no adapter)");
    if (py::len(a_h) != py::len(b_h)) {
        fail("lora_apply: a has " + std::to_string(py::len(a_h)) + " slots and b " + std::to_string(py::len(b_h)));
    }
    const int64_t K = x.size(1), N = y.size(1), num_slots = static_cast<int64_t>(py::len(a_h));
    std::vector<cpu::LoraWeights> slots(static_cast<size_t>(num_slots));
    for (int64_t s = 0; s < num_slots; ++s) {
        const py::handle ah = a_h[s], bh = b_h[s];
        if (ah.is_none() != bh.is_none()) fail("lora_apply: slot " + std::to_string(s) + " has only one of a and b");
        if (ah.is_none()) continue;
        const std::string an = "a[" + std::to_string(s) + "]", bn = "b[" + std::to_string(s) + "]";
        const TensorView a = view_of(ah, an.c_str()), b = view_of(bh, bn.c_str());
        expect(a.ndim == 2 && a.contiguous() && is_float(a.dtype) && a.size(1) == K, an.c_str(), a,
               "must be a contiguous float [R, " + std::to_string(K) + "] tensor (K: x's columns)");
        expect(b.ndim == 2 && b.contiguous() && b.dtype == a.dtype && b.size(0) == N && b.size(1) == a.size(0),
               bn.c_str(), b, "must be a contiguous [" + std::to_string(N) + ", " + std::to_string(a.size(0)) +
               "] tensor with a's dtype (N: y's columns, R: a's rows)");
        slots[s] = {a, b};
    }
    const int32_t * row_slots = rs.ptr<int32_t>();
    for (int64_t t = 0; t < x.size(0); ++t) {
        const int32_t s = row_slots[t];
        if (s < -1 || s >= num_slots) {
            fail("row_slots[" + std::to_string(t) + "] = " + std::to_string(s) + " is not -1 (no adapter) nor a slot 0.." +
                 std::to_string(num_slots - 1));
        }
    }
    py::gil_scoped_release release;
    cpu::lora_apply(x, y, row_slots, slots.data(), num_slots, reference);
}

void paged_decode_attention(py::handle q_h, py::handle k_h, py::handle v_h, py::handle tables_h, py::handle lens_h,
                            float scale, py::handle out_h, bool reference, py::handle kp_h, py::handle vp_h,
                            int64_t window, float softcap, py::handle sinks_h) {
    const TensorView q = view_of(q_h, "q"), kc = view_of(k_h, "k_cache"), vc = view_of(v_h, "v_cache");
    const TensorView tables = view_of(tables_h, "block_tables"), lens = view_of(lens_h, "context_lens");
    const TensorView out = view_of(out_h, "out");
    expect(q.ndim == 3 && q.stride(2) == 1 && is_float(q.dtype), "q", q, "must be a float [B, Hq, D] tensor with unit stride in D");
    expect(kc.ndim == 4, "k_cache", kc, "must be [num_blocks, block_size, Hk, D]");
    KVQuant kvq;
    const bool quantized = check_kv_cache(kc, vc, kp_h, vp_h, q.dtype, kc.size(2), q.size(2), kvq, view_of);
    expect(q.size(1) % kc.size(2) == 0, "q", q, "heads must be a multiple of the cache's KV heads");
    expect(tables.ndim == 2 && tables.dtype == DType::i32 && tables.stride(1) == 1 && tables.size(0) == q.size(0),
           "block_tables", tables, "must be an int32 [B, max_blocks] tensor");
    expect(lens.ndim == 1 && lens.dtype == DType::i32 && lens.stride(0) == 1 && lens.size(0) == q.size(0),
           "context_lens", lens, "must be an int32 [B] tensor");
    expect(out.ndim == 3 && out.stride(2) == 1 && out.dtype == q.dtype && out.size(0) == q.size(0) &&
           out.size(1) == q.size(1) && out.size(2) == q.size(2), "out", out, "must have q's shape and dtype");
    const int32_t * len = lens.ptr<int32_t>();
    const int32_t * table = tables.ptr<int32_t>();
    if (window < 0) fail("window = " + std::to_string(window) + " must be >= 0 (0: the whole context)");
    if (!(softcap >= 0.f)) fail("softcap = " + std::to_string(softcap) + " must be >= 0 (0: none)");
    const float * sinks = nullptr;
    if (!sinks_h.is_none()) {
        const TensorView s = view_of(sinks_h, "sinks");
        expect(s.ndim == 1 && s.size(0) == q.size(1) && s.dtype == DType::f32 && s.contiguous(), "sinks", s,
               "must be a contiguous float32 [Hq] tensor (a logit per query head)");
        sinks = s.ptr<float>();
    }
    const int64_t block_size = kc.size(1), num_blocks = kc.size(0), max_blocks = tables.size(1);
    for (int64_t b = 0; b < q.size(0); ++b) {  // a bad table must be an error, not a wild read
        if (len[b] < 1 || (len[b] + block_size - 1) / block_size > max_blocks) {
            fail("context_lens[" + std::to_string(b) + "] = " + std::to_string(len[b]) +
                 " is outside [1, " + std::to_string(max_blocks * block_size) + "]");
        }
        const int64_t first = window > 0 ? std::max<int64_t>(0, len[b] - window) : 0;  // blocks before: not read
        for (int64_t i = first / block_size; i < (len[b] + block_size - 1) / block_size; ++i) {
            const int32_t id = table[b * tables.stride(0) + i];
            if (id < 0 || id >= num_blocks) {
                fail("block_tables[" + std::to_string(b) + ", " + std::to_string(i) + "] = " + std::to_string(id) +
                     " is not a block of the cache (0.." + std::to_string(num_blocks - 1) + ")");
            }
        }
    }
    py::gil_scoped_release release;
    cpu::paged_decode_attention(q, kc, vc, tables, lens, scale, out, quantized ? &kvq : nullptr, reference, window,
                                softcap, sinks);
}

void rms_norm(py::handle x_h, py::handle w_h, float eps, py::handle out_h, py::handle residual_h, bool reference) {
    const TensorView x = view_of(x_h, "x"), w = view_of(w_h, "weight"), out = view_of(out_h, "out");
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x, "must be a float [M, H] tensor with unit stride in H");
    expect(w.ndim == 1 && w.size(0) == x.size(1) && w.contiguous() && w.dtype == x.dtype, "weight", w,
           "must be [H] with x's dtype");
    expect(out.ndim == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == x.size(1) &&
           out.dtype == x.dtype, "out", out, "must have x's shape and dtype");
    TensorView residual;
    const bool has_residual = !residual_h.is_none();
    if (has_residual) {
        residual = view_of(residual_h, "residual");
        expect(residual.ndim == 2 && residual.stride(1) == 1 && residual.size(0) == x.size(0) &&
               residual.size(1) == x.size(1) && residual.dtype == x.dtype, "residual", residual,
               "must have x's shape and dtype");
    }
    py::gil_scoped_release release;
    cpu::rms_norm(x, w, eps, out, has_residual ? &residual : nullptr, reference);
}

void rope_fill_kv(py::handle qkv_h, py::handle pos_h, py::handle cs_h, py::handle k_h, py::handle v_h,
                  py::handle slots_h, py::handle q_out_h, int64_t num_heads, int64_t num_kv_heads, bool reference,
                  py::handle kp_h, py::handle vp_h) {
    const TensorView qkv = view_of(qkv_h, "qkv"), pos = view_of(pos_h, "positions"), cs = view_of(cs_h, "cos_sin");
    const TensorView kc = view_of(k_h, "k_cache"), vc = view_of(v_h, "v_cache"), slots = view_of(slots_h, "slots");
    const TensorView q_out = view_of(q_out_h, "q_out");
    const int64_t T = qkv.size(0);
    expect(q_out.ndim == 3 && q_out.contiguous() && q_out.size(0) == T && q_out.size(1) == num_heads &&
           q_out.dtype == qkv.dtype, "q_out", q_out, "must be a contiguous [T, num_heads, D] tensor with qkv's dtype");
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
    const bool quantized = check_kv_cache(kc, vc, kp_h, vp_h, qkv.dtype, num_kv_heads, D, kvq, view_of);
    const int64_t num_slots = kc.size(0) * kc.size(1), max_pos = cs.size(0);
    for (int64_t t = 0; t < T; ++t) {
        const int64_t p = pos.ptr<int64_t>()[t], s = slots.ptr<int64_t>()[t];
        if (p < 0 || p >= max_pos) fail("positions[" + std::to_string(t) + "] = " + std::to_string(p) + " is outside the rotary table (0.." + std::to_string(max_pos - 1) + ")");
        if (s < 0 || s >= num_slots) fail("slots[" + std::to_string(t) + "] = " + std::to_string(s) + " is not a slot of the cache (0.." + std::to_string(num_slots - 1) + ")");
    }
    py::gil_scoped_release release;
    cpu::rope_fill_kv(qkv, pos, cs, kc, vc, slots, q_out, num_heads, num_kv_heads, quantized ? &kvq : nullptr,
                      reference);
}

// x [T, 2 I] and out [T, I] checked for the gated activations
void check_gated(const TensorView & x, const TensorView & out) {
    expect(x.ndim == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 && is_float(x.dtype), "x", x,
           "must be a float [T, 2 I] tensor with unit stride in its last dim");
    expect(out.ndim == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
           out.dtype == x.dtype, "out", out, "must be [T, I] with x's dtype");
}

void silu_and_mul(py::handle x_h, py::handle out_h, bool reference) {
    const TensorView x = view_of(x_h, "x"), out = view_of(out_h, "out");
    check_gated(x, out);
    py::gil_scoped_release release;
    cpu::silu_and_mul(x, out, reference);
}

void argmax(py::handle logits_h, py::handle out_h, bool reference) {
    const TensorView logits = view_of(logits_h, "logits"), out = view_of(out_h, "out");
    expect(logits.ndim == 2 && logits.stride(1) == 1 && logits.size(1) >= 1 && logits.dtype == DType::f32, "logits",
           logits, "must be a float32 [B, V] tensor (V >= 1) with unit stride in V");
    expect(out.ndim == 1 && out.size(0) == logits.size(0) && out.stride(0) == 1 &&
           (out.dtype == DType::i32 || out.dtype == DType::i64), "out", out, "must be a contiguous int32 or int64 [B]");
    py::gil_scoped_release release;
    cpu::argmax(logits, out, reference);
}

void gelu_tanh_and_mul(py::handle x_h, py::handle out_h) {
    const TensorView x = view_of(x_h, "x"), out = view_of(out_h, "out");
    check_gated(x, out);
    py::gil_scoped_release release;
    cpu::gelu_tanh_and_mul(x, out);
}

}  // namespace

void bind_quant(py::module_ & ops);  // bindings/quant.cc
void bind_gemm(py::module_ & ops);   // bindings/gemm.cc
void bind_gguf(py::module_ & ops);   // bindings/gguf.cc
void bind_mla(py::module_ & ops);    // bindings/mla.cc

void bind_ops(py::module_ & m) {
    py::module_ ops = m.def_submodule("ops", "The CPU kernels on DLPack tensors");
    py::class_<HostTensor>(ops, "HostTensor",
                           "A tensor handed to the kernels often (a weight): parsed once from a DLPack capsule, "
                           "which it keeps alive.")
        .def(py::init([](py::object capsule) { return HostTensor{view_of_capsule(capsule, "tensor"), capsule}; }),
             py::arg("capsule"))
        .def_property_readonly("shape", [](const HostTensor & t) {
            py::tuple s(t.view.ndim);
            for (int i = 0; i < t.view.ndim; ++i) s[i] = t.view.shape[i];
            return s;
        })
        .def_property_readonly("dtype", [](const HostTensor & t) { return dtype_name(t.view.dtype); });
    ops.def("linear", &linear, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"),
            py::arg("reference") = false, "y[M, N] = x[M, K] @ w[N, K].T (+ bias[N]), accumulated in float32.");
    ops.def("lora_apply", &lora_apply, py::arg("x"), py::arg("y"), py::arg("row_slots"), py::arg("a"), py::arg("b"),
            py::arg("reference") = false,
            "Multi-LoRA (cpu/lora.h): y[t] += (x[t] @ a[s].T) @ b[s].T for s = row_slots[t] (-1: none), in place; a "
            "and b: per slot [R_s, K] and [N, R_s] (None: the adapter leaves this matmul alone). Runs of rows of one "
            "slot are two small matmuls each, accumulated in float32 and added to y rounded once.");
    ops.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
            py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("out"),
            py::arg("reference") = false, py::arg("k_params") = py::none(), py::arg("v_params") = py::none(),
            py::arg("window") = 0, py::arg("softcap") = 0.f, py::arg("sinks") = py::none(),
            "out[B, Hq, D]: each query attends to its sequence's context_lens[b] cached tokens (with window > 0, "
            "the last window of them only: a sliding-window layer; with softcap > 0, each scaled score s becomes "
            "tanh(s / softcap) * softcap: Gemma 2; with sinks, float32 [Hq], each head's sink logit joins the "
            "softmax's denominator: gpt-oss). With k_params and v_params (float32 "
            "[num_blocks, block_size, Hk, 2]: scale, zero), the caches are quantized: uint8 [..., D] (8 bits) or "
            "[..., D / 2] (4 bits).");
    ops.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("out"),
            py::arg("residual") = py::none(), py::arg("reference") = false,
            "out = rms_norm(x) * weight; with residual: residual += x first, and the sum is normalised.");
    ops.def("rope_fill_kv", &rope_fill_kv, py::arg("qkv"), py::arg("positions"), py::arg("cos_sin"),
            py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("q_out"), py::arg("num_heads"),
            py::arg("num_kv_heads"), py::arg("reference") = false, py::arg("k_params") = py::none(),
            py::arg("v_params") = py::none(),
            "Rotate q (into q_out) and k (into the cache at slots) of a fused qkv; copy v into the cache. With "
            "k_params and v_params, k and v are quantized into the cache (see paged_decode_attention).");
    ops.def("silu_and_mul", &silu_and_mul, py::arg("x"), py::arg("out"), py::arg("reference") = false,
            "out[T, I] = silu(x[:, :I]) * x[:, I:].");
    ops.def("argmax", &argmax, py::arg("logits"), py::arg("out"), py::arg("reference") = false,
            "out[b] = the greedy token of logits[b]: its largest value's index, ties to the lowest, the first NaN "
            "before any number (torch.argmax).");
    ops.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, py::arg("x"), py::arg("out"),
            "out[T, I] = gelu_tanh(x[:, :I]) * x[:, I:] (GeGLU: torch's gelu(approximate='tanh')).");
    ops.def("ngram_propose", [](const std::vector<int32_t> & tokens, int min_n, int max_n, int k) {
                if (min_n < 1 || max_n < min_n || k < 0)
                    throw py::value_error("ngram_propose: need 1 <= min_n <= max_n and k >= 0, got min_n=" +
                                          std::to_string(min_n) + ", max_n=" + std::to_string(max_n) +
                                          ", k=" + std::to_string(k));
                return cpu::ngram_propose(tokens.data(), (int64_t) tokens.size(), min_n, max_n, k);
            }, py::arg("tokens"), py::arg("min_n"), py::arg("max_n"), py::arg("k"),
            "Prompt-lookup draft (speculative decoding): the up to k tokens that followed the latest earlier "
            "occurrence of the longest suffix of tokens (max_n down to min_n long); [] when none occurred.");
    py::class_<cpu::DraftAcceptance>(ops, "DraftAcceptance",
                                     "A sequence's recent drafts (speculative decoding): tokens accepted and drafts "
                                     "with a rejection, both decaying (cpu/draft_length.h).")
        .def(py::init<>())
        .def_readwrite("accepted", &cpu::DraftAcceptance::accepted)
        .def_readwrite("rejected", &cpu::DraftAcceptance::rejected)
        .def("rate", &cpu::DraftAcceptance::rate, "The chance the next drafted token is accepted.")
        .def("decay", &cpu::DraftAcceptance::decay, "Once per decoding step, drafted or not.")
        .def("observe", &cpu::DraftAcceptance::observe, py::arg("drafted"), py::arg("accepted"),
             "A verified draft of `drafted` tokens, the first `accepted` of them accepted.");
    py::class_<cpu::DraftLength>(ops, "DraftLength",
                                 "The draft length that pays, from a fit of decode-only steps' wall time over their "
                                 "rows and each sequence's acceptance rate (cpu/draft_length.h).")
        .def(py::init([](int64_t max_tokens) {
                 if (max_tokens < 1) throw py::value_error("DraftLength: max_tokens must be >= 1, got " +
                                                           std::to_string(max_tokens));
                 return cpu::DraftLength(max_tokens);
             }), py::arg("max_tokens"))
        .def("observe_step", &cpu::DraftLength::observe_step, py::arg("rows"), py::arg("seconds"),
             "A step whose every row was a decoding sequence's token or draft.")
        .def("length", &cpu::DraftLength::length, py::arg("acceptance"), py::arg("num_decoding"), py::arg("limit"),
             "Drafted tokens for a sequence this step (0: none), at most min(max_tokens, limit).")
        .def_property_readonly("step_seconds", &cpu::DraftLength::step_seconds)
        .def_property_readonly("row_seconds", &cpu::DraftLength::row_seconds);
    ops.def("set_num_threads", &cpu::set_num_threads, py::arg("n"), "Threads per kernel (0: one per processor).");
    ops.def("num_threads", &cpu::num_threads);
    ops.def("isa", &cpu::isa, "The kernels in use: 'avx512', 'avx2' or 'ref' (the scalar reference).");
    ops.def("set_isa", [](const std::string & name) {
                if (!cpu::set_isa(name.c_str()))
                    throw py::value_error("set_isa: '" + name + "' is not one of 'ref', 'avx2', 'avx512' that this CPU "
                                          "runs (it has up to '" + cpu::isa_name(cpu::isa_supported()) + "')");
            }, py::arg("name"),
            "Cap the kernels' instruction set ('ref', 'avx2', 'avx512'; '' for the best this CPU has); "
            "LMD_CPU_ISA sets it at start.");
    ops.def("supported_isas", []() {
                std::vector<std::string> out{"ref"};
                if (cpu::isa_supported() >= cpu::Isa::avx2) out.push_back("avx2");
                if (cpu::isa_supported() >= cpu::Isa::avx512) out.push_back("avx512");
                return out;
            }, "The instruction sets this CPU runs, lowest first.");
    ops.def("avx512_vnni", &cpu::use_avx512_vnni, "Whether the W4A8 kernel runs its AVX512-VNNI path.");
    bind_quant(ops);
    bind_gguf(ops);
    bind_gemm(ops);
    bind_mla(ops);
}

}  // namespace lmd
