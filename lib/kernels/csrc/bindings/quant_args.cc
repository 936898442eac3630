// The quantized matmuls' arguments, checked once (quant_args.h).
#include "bindings/quant_args.h"

#include <string>

#include "cpu/quant.h"

namespace lmd {

namespace {

std::string dims(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

void check_group_size(int64_t group_size) {
    if (group_size < 32 || group_size % 32 != 0) {
        fail("group_size = " + std::to_string(group_size) + ": must be a positive multiple of 32 (32, 64, 128)");
    }
}

// x: float [M, K] with unit stride in K; y: [M, N] with x's dtype and unit stride in N.
void check_x_y(const TensorView & x, const TensorView & y, int64_t N) {
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.size(1) == N && y.dtype == x.dtype, "y", y,
           "must be [M, N] = " + dims(x.size(0), N) + " with x's dtype and unit stride in N");
}

void check_k_groups(const TensorView & x, int64_t group_size) {
    expect(x.size(1) % group_size == 0, "x", x,
           "K = " + std::to_string(x.size(1)) + " is not a multiple of group_size " + std::to_string(group_size));
}

void check_group_scales(const TensorView & v, const char * name, int64_t N, int64_t num_groups) {
    expect(v.ndim == 2 && v.contiguous() && v.dtype == DType::f32 && v.size(0) == N && v.size(1) == num_groups, name,
           v, "must be a contiguous float32 [N, K / group_size] = " + dims(N, num_groups) + " tensor");
}

}  // namespace

void check_w4a16(const TensorView & x, const TensorView & qweight, const TensorView & scales, const TensorView & mins,
                 const TensorView & y, int64_t group_size) {
    check_group_size(group_size);
    expect(qweight.ndim == 2 && qweight.contiguous() && qweight.dtype == DType::u8, "qweight", qweight,
           "must be a contiguous uint8 [N, K / 2] tensor (two 4-bit values a byte)");
    const int64_t N = qweight.size(0);
    check_x_y(x, y, N);
    check_k_groups(x, group_size);
    const int64_t K = x.size(1);
    expect(qweight.size(1) * 2 == K, "qweight", qweight, "must be [N, K / 2] with x's K = " + std::to_string(K));
    check_group_scales(scales, "scales", N, K / group_size);
    check_group_scales(mins, "mins", N, K / group_size);
}

void check_w8a16(const TensorView & x, const TensorView & qweight, const TensorView & scales, const TensorView & y,
                 int64_t group_size) {
    check_group_size(group_size);
    expect(qweight.ndim == 2 && qweight.contiguous() && qweight.dtype == DType::i8, "qweight", qweight,
           "must be a contiguous int8 [N, K] tensor");
    const int64_t N = qweight.size(0);
    check_x_y(x, y, N);
    check_k_groups(x, group_size);
    const int64_t K = x.size(1);
    expect(qweight.size(1) == K, "qweight", qweight, "must be [N, K] with x's K = " + std::to_string(K));
    check_group_scales(scales, "scales", N, K / group_size);
}

void check_w8a8(const TensorView & x, const TensorView & qweight, const TensorView & scales, const TensorView & y) {
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
}

void check_quantize_per_token(const TensorView & x, const TensorView & xq, const TensorView & sx) {
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    expect(xq.ndim == 2 && xq.stride(1) == 1 && xq.dtype == DType::i8 && xq.size(0) == x.size(0) &&
           xq.size(1) == x.size(1), "xq", xq, "must be an int8 " + dims(x.size(0), x.size(1)) +
           " tensor with unit stride in K");
    expect(sx.ndim == 1 && sx.contiguous() && sx.dtype == DType::f32 && sx.size(0) == x.size(0), "sx", sx,
           "must be a float32 [M] tensor, M = " + std::to_string(x.size(0)));
}

bool read_bias(py::handle bias_h, TensorView & bias, int64_t N, ViewReader read) {
    if (bias_h.is_none()) return false;
    bias = read(bias_h, "bias");
    expect(bias.ndim == 1 && bias.size(0) == N && bias.contiguous() && bias.dtype == DType::f32, "bias", bias,
           "must be a float32 [N] tensor, N = " + std::to_string(N));
    return true;
}

}  // namespace lmd
