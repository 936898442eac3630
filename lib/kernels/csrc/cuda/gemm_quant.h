// Quantized-weight matmuls on the GPU (gemm_quant.cu): the twins of cpu/quant.h's W4A16 and
// W8A16, on the same layouts (described there and in lmd/weights/quant_layouts.py).
#pragma once

#include <cuda_runtime.h>

#include "core/tensor.h"

namespace lmd::cuda {

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]), w[n, k] = q[n, k] * scales[n, k / G] + mins[n, k / G].
// x, y: one float dtype, unit stride in the last dim, any row stride; qweight uint8 [N, K / 2]
// (16-byte aligned), scales, mins, bias float32, contiguous; all on the stream's device (the
// bindings check). Row m of y is bitwise the same whatever M: the kernel computes each row alone.
void linear_w4a16(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                  const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t group_size,
                  cudaStream_t stream);

// linear_w4a16 on tensor cores (gemm_w4a16_mma.cu), for prefill: x and y float16 or bfloat16,
// the rest as above. Same formula, float accumulation, another order of additions: within the
// tolerance of the reference, not bitwise equal to linear_w4a16; row m is bitwise the same
// whatever M here too.
void linear_w4a16_mma(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                      const TensorView & mins, const TensorView * bias, const TensorView & y, int64_t group_size,
                      cudaStream_t stream);

// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias[N]), w[n, k] = q[n, k] * scales[n, k / G]; qweight int8
// [N, K] (16-byte aligned); the rest as for linear_w4a16.
void linear_w8a16(const TensorView & x, const TensorView & qweight, const TensorView & scales,
                  const TensorView * bias, const TensorView & y, int64_t group_size, cudaStream_t stream);

// xq[M, K] int8 (unit stride in K) and sx[M] float32 from x[M, K]: cpu::quantize_per_token's
// formula (gemm_w8a8.cu), bitwise.
void quantize_per_token(const TensorView & x, const TensorView & xq, const TensorView & sx, cudaStream_t stream);

// y[M, N] = float(int32 dot(xq[m], w[n])) * sx[m] * sw[n] (+ bias[n]) with x quantized per token
// as above (scratch from cudaMallocAsync on the stream); w int8 [N, K], sw and bias float32 [N],
// contiguous; K at most cpu::kW8A8MaxK. Bitwise the reference's (the int32 dot is exact).
void linear_w8a8(const TensorView & x, const TensorView & w, const TensorView & sw, const TensorView * bias,
                 const TensorView & y, cudaStream_t stream);

}  // namespace lmd::cuda
