// The quantized matmuls in lmd.kernels.ops (next to the float kernels of
// bindings/ops.cc, with the same conventions): W4A16, W8A8 and W8A8's activation quantizer.
// Layouts: cpu/quant.h; converters from GGUF and AWQ: lmd.weights.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/quant_args.h"
#include "core/py_tensor.h"
#include "cpu/quant.h"

namespace lmd {
namespace {

void linear_w4a16(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle mins_h, py::handle bias_h,
                  py::handle y_h, int64_t group_size, bool reference) {
    const TensorView x = view_of(x_h, "x"), qweight = view_of(qweight_h, "qweight");
    const TensorView scales = view_of(scales_h, "scales"), mins = view_of(mins_h, "mins"), y = view_of(y_h, "y");
    check_w4a16(x, qweight, scales, mins, y, group_size);
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, qweight.size(0), view_of);
    py::gil_scoped_release release;
    cpu::linear_w4a16(x, qweight, scales, mins, has_bias ? &bias : nullptr, y, group_size, reference);
}

// linear_w8a16 and linear_w8a8_group: one set of checks, then fn.
template <typename Fn>
void w8_group_call(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle bias_h, py::handle y_h,
                   int64_t group_size, bool reference, Fn && fn) {
    const TensorView x = view_of(x_h, "x"), qweight = view_of(qweight_h, "qweight");
    const TensorView scales = view_of(scales_h, "scales"), y = view_of(y_h, "y");
    check_w8a16(x, qweight, scales, y, group_size);
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, qweight.size(0), view_of);
    py::gil_scoped_release release;
    fn(x, qweight, scales, has_bias ? &bias : nullptr, y, group_size, reference);
}

void linear_w8a16(py::handle x, py::handle qweight, py::handle scales, py::handle bias, py::handle y,
                  int64_t group_size, bool reference) {
    w8_group_call(x, qweight, scales, bias, y, group_size, reference, cpu::linear_w8a16);
}

void linear_w8a8_group(py::handle x, py::handle qweight, py::handle scales, py::handle bias, py::handle y,
                       int64_t group_size, bool reference) {
    w8_group_call(x, qweight, scales, bias, y, group_size, reference, cpu::linear_w8a8_group);
}

void linear_w8a8(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle bias_h, py::handle y_h,
                 bool reference) {
    const TensorView x = view_of(x_h, "x"), qweight = view_of(qweight_h, "qweight");
    const TensorView scales = view_of(scales_h, "scales"), y = view_of(y_h, "y");
    check_w8a8(x, qweight, scales, y);
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, qweight.size(0), view_of);
    py::gil_scoped_release release;
    cpu::linear_w8a8(x, qweight, scales, has_bias ? &bias : nullptr, y, reference);
}

void quantize_per_token(py::handle x_h, py::handle xq_h, py::handle sx_h, bool reference) {
    const TensorView x = view_of(x_h, "x"), xq = view_of(xq_h, "xq"), sx = view_of(sx_h, "sx");
    check_quantize_per_token(x, xq, sx);
    py::gil_scoped_release release;
    cpu::quantize_per_token(x, xq, sx, reference);
}

}  // namespace

void bind_quant(py::module_ & ops) {
    ops.def("linear_w4a16", &linear_w4a16, py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
            py::arg("bias"), py::arg("y"), py::arg("group_size"), py::arg("reference") = false,
            "y[M, N] = x[M, K] @ w.T (+ bias[N]) with w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]: "
            "qweight uint8 [N, K / 2] (element k in byte k // 2, low nibble = even k), scales and mins "
            "float32 [N, K / G], bias float32 [N] or None. Layouts: lmd.weights.quant.");
    ops.def("linear_w8a16", &linear_w8a16, py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias"),
            py::arg("y"), py::arg("group_size"), py::arg("reference") = false,
            "y[M, N] = x[M, K] @ w.T (+ bias[N]) with w[n, k] = qweight[n, k] * scales[n, k // G]: qweight "
            "int8 [N, K], scales float32 [N, K / G] (G a multiple of 32 dividing K; GGUF Q8_0 is G = 32), "
            "bias float32 [N] or None. Layouts: lmd.weights.quant.");
    ops.def("linear_w8a8_group", &linear_w8a8_group, py::arg("x"), py::arg("qweight"), py::arg("scales"),
            py::arg("bias"), py::arg("y"), py::arg("group_size"), py::arg("reference") = false,
            "linear_w8a16 with x quantized to int8 per 32 k (as llama.cpp's Q8_0 x Q8_0): integer dots per "
            "block, scaled in float32 (cpu/quant.h, W8A8 by groups).");
    ops.def("linear_w8a8", &linear_w8a8, py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias"),
            py::arg("y"), py::arg("reference") = false,
            "y[M, N] = x @ w.T (+ bias[N]) with x quantized per token to int8 (quantize_per_token) and "
            "w = qweight int8 [N, K] * scales float32 [N]; int32 accumulation.");
    ops.def("quantize_per_token", &quantize_per_token, py::arg("x"), py::arg("xq"), py::arg("sx"),
            py::arg("reference") = false,
            "xq[M, K] int8 = round(x * 127 / absmax(x[m])), sx[M] float32 = absmax(x[m]) / 127.");
}

}  // namespace lmd
