// Token embedding lookup on the GPU (embedding.cu).
#pragma once

#include <cuda_runtime.h>

#include "core/tensor.h"

namespace lmd::cuda {

// out[t, :] = table[ids[t], :]; ids int32 or int64 [T]; table [V, H] and out [T, H] of one float dtype,
// unit stride in H. An id outside [0, V) gives a row of zeros: ids live on the device, so the caller
// cannot check them cheaply, and the kernel must never read outside the table.
void embedding(const TensorView & ids, const TensorView & table, const TensorView & out, cudaStream_t stream);

}  // namespace lmd::cuda
