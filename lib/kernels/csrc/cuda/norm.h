// RMS norm on the GPU (norm.cu); CPU reference in cpu/kernels.h (rms_norm).
#pragma once

#include <cuda_runtime.h>

#include "core/tensor.h"

namespace lmd::cuda {

// out[M, H] = rms_norm(x) * w; with residual (x's shape): residual += x first (rounded to the dtype)
// and the sum is normalised. x, out, residual: unit stride in H; w: [H] contiguous; one float dtype.
void rms_norm(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
              const TensorView * residual, cudaStream_t stream);

}  // namespace lmd::cuda
