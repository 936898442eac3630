// lmd.kernels._kernels.cuda: the quantized matmuls (cuda/gemm_quant.h), with the arguments and
// checks of their CPU twins in ops (bindings/quant.cc) plus the device's.
#include <string>

#include "bindings/cuda.h"
#include "cpu/quant.h"
#include "cuda/gemm_quant.h"

namespace lmd {

namespace {

std::string dims(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

void check_group_size(int64_t group_size) {
    if (group_size < 32 || group_size % 32 != 0) {
        fail("group_size = " + std::to_string(group_size) + ": must be a positive multiple of 32 (32, 64, 128)");
    }
}

// x: float [M, K] with unit stride in K; y: [M, N] with x's dtype and unit stride in N.
void check_x_y(const TensorView & x, const TensorView & y, int64_t N, int64_t group_size) {
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.size(1) == N && y.dtype == x.dtype, "y", y,
           "must be [M, N] = " + dims(x.size(0), N) + " with x's dtype and unit stride in N");
    expect(x.size(1) % group_size == 0, "x", x,
           "K = " + std::to_string(x.size(1)) + " is not a multiple of group_size " + std::to_string(group_size));
}

// The kernels read a 32-wide chunk of a weight row with 16-byte loads.
void check_aligned(const TensorView & qweight) {
    expect(reinterpret_cast<uintptr_t>(qweight.data) % 16 == 0, "qweight", qweight,
           "must start at a 16-byte aligned address");
}

void check_group_scales(const TensorView & v, const char * name, int64_t N, int64_t num_groups) {
    expect(v.ndim == 2 && v.contiguous() && v.dtype == DType::f32 && v.size(0) == N && v.size(1) == num_groups, name,
           v, "must be a contiguous float32 [N, K / group_size] = " + dims(N, num_groups) + " tensor");
}

bool read_bias(py::handle bias_h, TensorView & bias, int64_t N) {
    if (bias_h.is_none()) return false;
    bias = view_of_cuda(bias_h, "bias");
    expect(bias.ndim == 1 && bias.size(0) == N && bias.contiguous() && bias.dtype == DType::f32, "bias", bias,
           "must be a float32 [N] tensor, N = " + std::to_string(N));
    return true;
}

template <bool kTensorCores>
void linear_w4a16(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle mins_h, py::handle bias_h,
                  py::handle y_h, int64_t group_size, uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), qweight = view_of_cuda(qweight_h, "qweight");
    const TensorView scales = view_of_cuda(scales_h, "scales"), mins = view_of_cuda(mins_h, "mins");
    const TensorView y = view_of_cuda(y_h, "y");
    check_group_size(group_size);
    expect(qweight.ndim == 2 && qweight.contiguous() && qweight.dtype == DType::u8, "qweight", qweight,
           "must be a contiguous uint8 [N, K / 2] tensor (two 4-bit values a byte)");
    const int64_t N = qweight.size(0);
    check_x_y(x, y, N, group_size);
    if (kTensorCores) {
        expect(x.dtype == DType::f16 || x.dtype == DType::bf16, "x", x, "must be float16 or bfloat16 (tensor cores)");
    }
    const int64_t K = x.size(1);
    expect(qweight.size(1) * 2 == K, "qweight", qweight, "must be [N, K / 2] with x's K = " + std::to_string(K));
    check_aligned(qweight);
    check_group_scales(scales, "scales", N, K / group_size);
    check_group_scales(mins, "mins", N, K / group_size);
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, N);
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
    check_group_size(group_size);
    expect(qweight.ndim == 2 && qweight.contiguous() && qweight.dtype == DType::i8, "qweight", qweight,
           "must be a contiguous int8 [N, K] tensor");
    const int64_t N = qweight.size(0);
    check_x_y(x, y, N, group_size);
    const int64_t K = x.size(1);
    expect(qweight.size(1) == K, "qweight", qweight, "must be [N, K] with x's K = " + std::to_string(K));
    check_aligned(qweight);
    check_group_scales(scales, "scales", N, K / group_size);
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, N);
    if (has_bias) expect_same_device({&x, &qweight, &scales, &bias, &y}, "linear_w8a16");
    else expect_same_device({&x, &qweight, &scales, &y}, "linear_w8a16");
    cuda::linear_w8a16(x, qweight, scales, has_bias ? &bias : nullptr, y, group_size, stream_of(stream));
}

void linear_w8a8(py::handle x_h, py::handle qweight_h, py::handle scales_h, py::handle bias_h, py::handle y_h,
                 uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), qweight = view_of_cuda(qweight_h, "qweight");
    const TensorView scales = view_of_cuda(scales_h, "scales"), y = view_of_cuda(y_h, "y");
    expect(qweight.ndim == 2 && qweight.contiguous() && qweight.dtype == DType::i8, "qweight", qweight,
           "must be a contiguous int8 [N, K] tensor");
    const int64_t N = qweight.size(0);
    check_x_y(x, y, N, 1);
    const int64_t K = x.size(1);
    expect(qweight.size(1) == K, "qweight", qweight, "K must match x's " + std::to_string(K));
    expect(K <= cpu::kW8A8MaxK, "x", x,
           "K must be at most " + std::to_string(cpu::kW8A8MaxK) + " (the int32 dot products would overflow)");
    expect(scales.ndim == 1 && scales.contiguous() && scales.dtype == DType::f32 && scales.size(0) == N, "scales",
           scales, "must be a float32 [N] tensor, N = " + std::to_string(N));
    TensorView bias;
    const bool has_bias = read_bias(bias_h, bias, N);
    if (has_bias) expect_same_device({&x, &qweight, &scales, &bias, &y}, "linear_w8a8");
    else expect_same_device({&x, &qweight, &scales, &y}, "linear_w8a8");
    cuda::linear_w8a8(x, qweight, scales, has_bias ? &bias : nullptr, y, stream_of(stream));
}

void quantize_per_token(py::handle x_h, py::handle xq_h, py::handle sx_h, uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), xq = view_of_cuda(xq_h, "xq"), sx = view_of_cuda(sx_h, "sx");
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    expect(xq.ndim == 2 && xq.stride(1) == 1 && xq.dtype == DType::i8 && xq.size(0) == x.size(0) &&
           xq.size(1) == x.size(1), "xq", xq, "must be an int8 " + dims(x.size(0), x.size(1)) +
           " tensor with unit stride in K");
    expect(sx.ndim == 1 && sx.contiguous() && sx.dtype == DType::f32 && sx.size(0) == x.size(0), "sx", sx,
           "must be a float32 [M] tensor, M = " + std::to_string(x.size(0)));
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
