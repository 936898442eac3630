// The quantized matmuls in lmd.kernels.ops (next to the float kernels of
// bindings/ops.cc, with the same conventions): W4A16, W8A8 and W8A8's activation quantizer.
// Layouts: cpu/quant.h; converters from GGUF and AWQ: lmd.weights.
#include <pybind11/pybind11.h>

#include <string>

#include "core/py_tensor.h"
#include "cpu/quant.h"

namespace lmd {
namespace {

std::string dims(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

// x: float [M, K] with unit stride in K; y: [M, N] with x's dtype and unit stride in N.
void check_x_y(const TensorView & x, const TensorView & y, int64_t N) {
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.size(1) == N && y.dtype == x.dtype, "y", y,
           "must be [M, N] = " + dims(x.size(0), N) + " with x's dtype and unit stride in N");
}

void check_bias(py::handle bias_h, TensorView & bias, int64_t N) {
    bias = view_of(bias_h, "bias");
    expect(bias.ndim == 1 && bias.size(0) == N && bias.contiguous() && bias.dtype == DType::f32, "bias", bias,
           "must be a float32 [N] tensor, N = " + std::to_string(N));
}

void linear_w4a16(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle mins_h, py::handle bias_h,
                  py::handle y_h, int64_t group_size, bool reference) {
    const TensorView x = view_of(x_h, "x"), qweight = view_of(qweight_h, "qweight");
    const TensorView scales = view_of(scales_h, "scales"), mins = view_of(mins_h, "mins"), y = view_of(y_h, "y");
    if (group_size < 32 || group_size % 32 != 0) {
        fail("group_size = " + std::to_string(group_size) + ": must be a positive multiple of 32 (32, 64, 128)");
    }
    expect(qweight.ndim == 2 && qweight.contiguous() && qweight.dtype == DType::u8, "qweight", qweight,
           "must be a contiguous uint8 [N, K / 2] tensor (two 4-bit values a byte)");
    const int64_t N = qweight.size(0);
    check_x_y(x, y, N);
    const int64_t K = x.size(1);
    expect(K % group_size == 0, "x", x,
           "K = " + std::to_string(K) + " is not a multiple of group_size " + std::to_string(group_size));
    expect(qweight.size(1) * 2 == K, "qweight", qweight, "must be [N, K / 2] with x's K = " + std::to_string(K));
    const int64_t num_groups = K / group_size;
    expect(scales.ndim == 2 && scales.contiguous() && scales.dtype == DType::f32 && scales.size(0) == N &&
           scales.size(1) == num_groups, "scales", scales, "must be a contiguous float32 [N, K / group_size] = " +
           dims(N, num_groups) + " tensor");
    expect(mins.ndim == 2 && mins.contiguous() && mins.dtype == DType::f32 && mins.size(0) == N &&
           mins.size(1) == num_groups, "mins", mins, "must be a contiguous float32 [N, K / group_size] = " +
           dims(N, num_groups) + " tensor");
    TensorView bias;
    const bool has_bias = !bias_h.is_none();
    if (has_bias) check_bias(bias_h, bias, N);
    py::gil_scoped_release release;
    cpu::linear_w4a16(x, qweight, scales, mins, has_bias ? &bias : nullptr, y, group_size, reference);
}

void linear_w8a16(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle bias_h, py::handle y_h,
                  int64_t group_size, bool reference) {
    const TensorView x = view_of(x_h, "x"), qweight = view_of(qweight_h, "qweight");
    const TensorView scales = view_of(scales_h, "scales"), y = view_of(y_h, "y");
    if (group_size < 32 || group_size % 32 != 0) {
        fail("group_size = " + std::to_string(group_size) + ": must be a positive multiple of 32 (32, 64, 128)");
    }
    expect(qweight.ndim == 2 && qweight.contiguous() && qweight.dtype == DType::i8, "qweight", qweight,
           "must be a contiguous int8 [N, K] tensor");
    const int64_t N = qweight.size(0);
    check_x_y(x, y, N);
    const int64_t K = x.size(1);
    expect(K % group_size == 0, "x", x,
           "K = " + std::to_string(K) + " is not a multiple of group_size " + std::to_string(group_size));
    expect(qweight.size(1) == K, "qweight", qweight, "must be [N, K] with x's K = " + std::to_string(K));
    const int64_t num_groups = K / group_size;
    expect(scales.ndim == 2 && scales.contiguous() && scales.dtype == DType::f32 && scales.size(0) == N &&
           scales.size(1) == num_groups, "scales", scales, "must be a contiguous float32 [N, K / group_size] = " +
           dims(N, num_groups) + " tensor");
    TensorView bias;
    const bool has_bias = !bias_h.is_none();
    if (has_bias) check_bias(bias_h, bias, N);
    py::gil_scoped_release release;
    cpu::linear_w8a16(x, qweight, scales, has_bias ? &bias : nullptr, y, group_size, reference);
}

void linear_w8a8(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle bias_h, py::handle y_h,
                 bool reference) {
    const TensorView x = view_of(x_h, "x"), qweight = view_of(qweight_h, "qweight");
    const TensorView scales = view_of(scales_h, "scales"), y = view_of(y_h, "y");
    expect(qweight.ndim == 2 && qweight.contiguous() && qweight.dtype == DType::i8, "qweight", qweight,
           "must be a contiguous int8 [N, K] tensor");
    const int64_t N = qweight.size(0);
    check_x_y(x, y, N);
    const int64_t K = x.size(1);
    expect(qweight.size(1) == K, "qweight", qweight, "K must match x's " + std::to_string(K));
    expect(K <= cpu::kW8A8MaxK, "x", x,
           "K must be at most " + std::to_string(cpu::kW8A8MaxK) + " (the int32 dot products would overflow)");
    expect(scales.ndim == 1 && scales.contiguous() && scales.dtype == DType::f32 && scales.size(0) == N, "scales",
           scales, "must be a float32 [N] tensor, N = " + std::to_string(N));
    TensorView bias;
    const bool has_bias = !bias_h.is_none();
    if (has_bias) check_bias(bias_h, bias, N);
    py::gil_scoped_release release;
    cpu::linear_w8a8(x, qweight, scales, has_bias ? &bias : nullptr, y, reference);
}

void quantize_per_token(py::handle x_h, py::handle xq_h, py::handle sx_h, bool reference) {
    const TensorView x = view_of(x_h, "x"), xq = view_of(xq_h, "xq"), sx = view_of(sx_h, "sx");
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    expect(xq.ndim == 2 && xq.stride(1) == 1 && xq.dtype == DType::i8 && xq.size(0) == x.size(0) &&
           xq.size(1) == x.size(1), "xq", xq, "must be an int8 " + dims(x.size(0), x.size(1)) +
           " tensor with unit stride in K");
    expect(sx.ndim == 1 && sx.contiguous() && sx.dtype == DType::f32 && sx.size(0) == x.size(0), "sx", sx,
           "must be a float32 [M] tensor, M = " + std::to_string(x.size(0)));
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
    ops.def("linear_w8a8", &linear_w8a8, py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias"),
            py::arg("y"), py::arg("reference") = false,
            "y[M, N] = x @ w.T (+ bias[N]) with x quantized per token to int8 (quantize_per_token) and "
            "w = qweight int8 [N, K] * scales float32 [N]; int32 accumulation.");
    ops.def("quantize_per_token", &quantize_per_token, py::arg("x"), py::arg("xq"), py::arg("sx"),
            py::arg("reference") = false,
            "xq[M, K] int8 = round(x * 127 / absmax(x[m])), sx[M] float32 = absmax(x[m]) / 127.");
}

}  // namespace lmd
