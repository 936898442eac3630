// lmd.kernels._kernels.cuda: the quantized matmuls (cuda/gemm_quant.h), with the arguments and
// checks of their CPU twins in ops (bindings/quant.cc) plus the device's.
#include <string>

#include "bindings/cuda.h"
#include "bindings/quant_args.h"
#include "cuda/gemm_quant.h"

namespace lmd {

namespace {

// The kernels read a 32-wide chunk of a weight row with 16-byte loads.
void check_aligned(const TensorView & qweight) {
    expect(reinterpret_cast<uintptr_t>(qweight.data) % 16 == 0, "qweight", qweight,
           "must start at a 16-byte aligned address");
}

template <bool kTensorCores>
void linear_w4a16(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle mins_h, py::handle bias_h,
                  py::handle y_h, int64_t group_size, uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), qweight = view_of_cuda(qweight_h, "qweight");
    const TensorView scales = view_of_cuda(scales_h, "scales"), mins = view_of_cuda(mins_h, "mins");
    const TensorView y = view_of_cuda(y_h, "y");
    check_w4a16(x, qweight, scales, mins, y, group_size);
    if (kTensorCores) {
        expect(x.dtype == DType::f16 || x.dtype == DType::bf16, "x", x, "must be float16 or bfloat16 (tensor cores)");
    }
    check_aligned(qweight);
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, qweight.size(0), view_of_cuda);
    if (has_bias) expect_same_device({&x, &qweight, &scales, &mins, &bias, &y}, "linear_w4a16");
    else expect_same_device({&x, &qweight, &scales, &mins, &y}, "linear_w4a16");
    if (kTensorCores) {
        cuda::linear_w4a16_mma(x, qweight, scales, mins, has_bias ? &bias : nullptr, y, group_size, stream_of(stream));
    } else {
        cuda::linear_w4a16(x, qweight, scales, mins, has_bias ? &bias : nullptr, y, group_size, stream_of(stream));
    }
}

void linear_w8a16(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle bias_h, py::handle y_h,
                  int64_t group_size, uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), qweight = view_of_cuda(qweight_h, "qweight");
    const TensorView scales = view_of_cuda(scales_h, "scales"), y = view_of_cuda(y_h, "y");
    check_w8a16(x, qweight, scales, y, group_size);
    check_aligned(qweight);
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, qweight.size(0), view_of_cuda);
    if (has_bias) expect_same_device({&x, &qweight, &scales, &bias, &y}, "linear_w8a16");
    else expect_same_device({&x, &qweight, &scales, &y}, "linear_w8a16");
    cuda::linear_w8a16(x, qweight, scales, has_bias ? &bias : nullptr, y, group_size, stream_of(stream));
}

void linear_w8a8(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle bias_h, py::handle y_h,
                 uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), qweight = view_of_cuda(qweight_h, "qweight");
    const TensorView scales = view_of_cuda(scales_h, "scales"), y = view_of_cuda(y_h, "y");
    check_w8a8(x, qweight, scales, y);
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, qweight.size(0), view_of_cuda);
    if (has_bias) expect_same_device({&x, &qweight, &scales, &bias, &y}, "linear_w8a8");
    else expect_same_device({&x, &qweight, &scales, &y}, "linear_w8a8");
    cuda::linear_w8a8(x, qweight, scales, has_bias ? &bias : nullptr, y, stream_of(stream));
}

void quantize_per_token(py::handle x_h, py::handle xq_h, py::handle sx_h, uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), xq = view_of_cuda(xq_h, "xq"), sx = view_of_cuda(sx_h, "sx");
    check_quantize_per_token(x, xq, sx);
    expect_same_device({&x, &xq, &sx}, "quantize_per_token");
    cuda::quantize_per_token(x, xq, sx, stream_of(stream));
}

void bind(py::module_ & m) {
    m.def("linear_w4a16", &linear_w4a16<false>, py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"),
          py::arg("bias"), py::arg("y"), py::arg("group_size"), py::arg("stream") = 0,
          "ops.linear_w4a16 on the GPU: y[M, N] = x[M, K] @ w.T (+ bias[N]), w[n, k] = q[n, k] * "
          "scales[n, k // G] + mins[n, k // G]; qweight uint8 [N, K / 2] (low nibble = even k, 16-byte "
          "aligned), scales and mins float32 [N, K / G], bias float32 [N] or None. Row m of y is the same "
          "bits whatever M.");
    m.def("linear_w4a16_mma", &linear_w4a16<true>, py::arg("x"), py::arg("qweight"), py::arg("scales"),
          py::arg("mins"), py::arg("bias"), py::arg("y"), py::arg("group_size"), py::arg("stream") = 0,
          "linear_w4a16 on tensor cores (mma.sync, sm_80+), for prefill-sized M: x and y float16 or "
          "bfloat16. Not bitwise equal to linear_w4a16 (another order of float additions); row m of y is "
          "the same bits whatever M.");
    m.def("linear_w8a16", &linear_w8a16, py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias"),
          py::arg("y"), py::arg("group_size"), py::arg("stream") = 0,
          "ops.linear_w8a16 on the GPU: y[M, N] = x[M, K] @ w.T (+ bias[N]), w[n, k] = qweight[n, k] * "
          "scales[n, k // G]; qweight int8 [N, K] (16-byte aligned), scales float32 [N, K / G]. Row m of y "
          "is the same bits whatever M.");
    m.def("linear_w8a8", &linear_w8a8, py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("bias"),
          py::arg("y"), py::arg("stream") = 0,
          "ops.linear_w8a8 on the GPU: y[M, N] = x @ w.T (+ bias[N]) with x quantized per token to int8 and "
          "w = qweight int8 [N, K] * scales float32 [N]; int32 accumulation; bitwise the CPU reference.");
    m.def("quantize_per_token", &quantize_per_token, py::arg("x"), py::arg("xq"), py::arg("sx"),
          py::arg("stream") = 0,
          "ops.quantize_per_token on the GPU: xq[M, K] int8 = round(x * 127 / absmax(x[m])), "
          "sx[M] float32 = absmax(x[m]) / 127; bitwise the CPU reference.");
}

}  // namespace

LMD_CUDA_BINDINGS(bind);

}  // namespace lmd
