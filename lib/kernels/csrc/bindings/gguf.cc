// The GGUF block matmuls in lmd.kernels.ops (cpu/gguf.h): a GGUF file's quantized tensors as
// stored, dequantized or multiplied in place.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/quant_args.h"
#include "core/py_tensor.h"
#include "cpu/gguf.h"

namespace lmd {
namespace {

// raw: contiguous uint8 [N, K / QK * B] of a type this library runs; K: the weight's columns.
void check_raw(const TensorView & raw, int type, int64_t K) {
    const cpu::GgufTypeInfo t = cpu::gguf_type_info(type);
    if (!t.block_values) fail("type " + std::to_string(type) + " is not a GGUF type lmd runs (lmd.kernels.GGUF_TYPES)");
    if (K % t.block_values) {
        fail("K = " + std::to_string(K) + " is not a multiple of the type's " + std::to_string(t.block_values) +
             "-value blocks");
    }
    expect(raw.ndim == 2 && raw.contiguous() && raw.dtype == DType::u8 && raw.size(1) == cpu::gguf_row_bytes(type, K),
           "raw", raw,
           "must be a contiguous uint8 [N, " + std::to_string(cpu::gguf_row_bytes(type, K)) + "] tensor (K = " +
               std::to_string(K) + " in blocks of " + std::to_string(t.block_values) + " values, " +
               std::to_string(t.block_bytes) + " bytes each)");
}

void gguf_dequantize(py::handle raw_h, int type, py::handle out_h, bool reference) {
    const TensorView raw = view_of(raw_h, "raw"), out = view_of(out_h, "out");
    expect(out.ndim == 2 && out.contiguous() && out.dtype == DType::f32, "out", out,
           "must be a contiguous float32 [N, K] tensor");
    check_raw(raw, type, out.size(1));
    expect(raw.size(0) == out.size(0), "out", out, "must have raw's N = " + std::to_string(raw.size(0)) + " rows");
    py::gil_scoped_release release;
    cpu::gguf_dequantize(raw, type, out, reference);
}

void linear_gguf(py::handle x_h, py::handle raw_h, int type, py::handle bias_h, py::handle y_h,
                 bool int8_activations, bool reference) {
    const TensorView x = view_of(x_h, "x"), raw = view_of(raw_h, "raw"), y = view_of(y_h, "y");
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    check_raw(raw, type, x.size(1));
    const int64_t N = raw.size(0);
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.size(1) == N && y.dtype == x.dtype, "y", y,
           "must be [M, N] = [" + std::to_string(x.size(0)) + ", " + std::to_string(N) +
               "] with x's dtype and unit stride in N");
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, N, view_of);
    py::gil_scoped_release release;
    cpu::linear_gguf(x, raw, type, has_bias ? &bias : nullptr, y, int8_activations, reference);
}

void gguf_to_w8a16(py::handle raw_h, int type, py::handle q_h, py::handle s_h) {
    const TensorView raw = view_of(raw_h, "raw"), q = view_of(q_h, "qweight"), s = view_of(s_h, "scales");
    const int G = cpu::gguf_w8a16_group(type);
    if (!G) fail("type " + std::to_string(type) + " has float mins (or is not a GGUF type lmd runs): no W8A16 form");
    expect(q.ndim == 2 && q.contiguous() && q.dtype == DType::i8, "qweight", q, "must be a contiguous int8 [N, K] tensor");
    check_raw(raw, type, q.size(1));
    expect(raw.size(0) == q.size(0), "qweight", q, "must have raw's N = " + std::to_string(raw.size(0)) + " rows");
    expect(s.ndim == 2 && s.contiguous() && s.dtype == DType::f32 && s.size(0) == q.size(0) &&
           s.size(1) == q.size(1) / G, "scales", s,
           "must be a contiguous float32 [N, K / " + std::to_string(G) + "] tensor");
    py::gil_scoped_release release;
    cpu::gguf_to_w8a16(raw, type, q, s);
}

}  // namespace

void bind_gguf(py::module_ & ops) {
    py::dict types;
    for (auto [name, id] : {std::pair<const char *, cpu::GgufType>{"Q4_0", cpu::GgufType::Q4_0},
                            {"Q4_1", cpu::GgufType::Q4_1}, {"Q5_0", cpu::GgufType::Q5_0},
                            {"Q5_1", cpu::GgufType::Q5_1}, {"Q8_0", cpu::GgufType::Q8_0},
                            {"Q4_K", cpu::GgufType::Q4_K}, {"Q5_K", cpu::GgufType::Q5_K},
                            {"Q6_K", cpu::GgufType::Q6_K}, {"IQ4_NL", cpu::GgufType::IQ4_NL}}) {
        const cpu::GgufTypeInfo t = cpu::gguf_type_info(static_cast<int>(id));
        types[name] = py::make_tuple(static_cast<int>(id), t.block_values, t.block_bytes);
    }
    ops.attr("GGUF_TYPES") = types;
    ops.def("gguf_dequantize", &gguf_dequantize, py::arg("raw"), py::arg("type"), py::arg("out"),
            py::arg("reference") = false,
            "out[N, K] float32 = the weight of GGUF blocks raw uint8 [N, K / QK * B] of ggml type id `type` "
            "(GGUF_TYPES: name -> (id, QK, B)), exactly as gguf.quants.dequantize.");
    ops.def("gguf_w8a16_group", &cpu::gguf_w8a16_group, py::arg("type"),
            "G of the W8A16 form of GGUF type id `type` (32; 16 for Q6_K), or 0 for a type with float mins.");
    ops.def("gguf_to_w8a16", &gguf_to_w8a16, py::arg("raw"), py::arg("type"), py::arg("qweight"), py::arg("scales"),
            "GGUF blocks raw uint8 [N, K / QK * B] of a type without float mins (Q4_0, Q5_0, Q8_0, IQ4_NL, Q6_K) "
            "as W8A16: qweight int8 [N, K] (the codes less the type's offset) and scales float32 [N, K / G], "
            "G = gguf_w8a16_group(type); the same weights exactly (cpu/gguf.h).");
    ops.def("linear_gguf", &linear_gguf, py::arg("x"), py::arg("raw"), py::arg("type"), py::arg("bias"), py::arg("y"),
            py::arg("int8_activations") = false, py::arg("reference") = false,
            "y[M, N] = x[M, K] @ w.T (+ bias[N]) with w GGUF blocks as stored (raw uint8 [N, K / QK * B], ggml "
            "type id `type`); int8_activations quantizes x to int8 per 32 k as llama.cpp does (cpu/gguf.h).");
}

}  // namespace lmd
