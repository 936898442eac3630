// The quantized matmuls' arguments (layouts: cpu/quant.h), checked once for the CPU ops
// (bindings/quant.cc) and their CUDA twins (bindings/cuda_gemm.cc). Each raises ValueError naming
// the argument that is wrong.
#pragma once

#include "core/py_tensor.h"

namespace lmd {

// x float [M, K] (unit stride in K), qweight uint8 [N, K / 2], scales and mins float32
// [N, K / group_size], y [M, N] with x's dtype (unit stride in N); group_size a multiple of 32.
void check_w4a16(const TensorView & x, const TensorView & qweight, const TensorView & scales, const TensorView & mins,
                 const TensorView & y, int64_t group_size);
// As check_w4a16 with qweight int8 [N, K] and no mins.
void check_w8a16(const TensorView & x, const TensorView & qweight, const TensorView & scales, const TensorView & y,
                 int64_t group_size);
// x float [M, K], qweight int8 [N, K], scales float32 [N], y [M, N]; K at most cpu::kW8A8MaxK.
void check_w8a8(const TensorView & x, const TensorView & qweight, const TensorView & scales, const TensorView & y);
// x float [M, K], xq int8 [M, K], sx float32 [M].
void check_quantize_per_token(const TensorView & x, const TensorView & xq, const TensorView & sx);
// The optional float32 [N] bias, read with `read` into bias; whether there is one.
bool read_bias(py::handle bias_h, TensorView & bias, int64_t N, ViewReader read);

}  // namespace lmd
