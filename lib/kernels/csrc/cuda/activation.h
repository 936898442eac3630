// Activation kernels on the GPU (activation.cu); CPU references in cpu/kernels.h.
#pragma once

#include <cuda_runtime.h>

#include "core/tensor.h"

namespace lmd::cuda {

// out[T, I] = silu(x[:, :I]) * x[:, I:]; x [T, 2 I], float32/float16/bfloat16, rows of unit stride.
void silu_and_mul(const TensorView & x, const TensorView & out, cudaStream_t stream);

}  // namespace lmd::cuda
