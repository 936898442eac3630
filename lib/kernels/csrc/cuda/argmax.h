// Greedy token choice on the GPU (argmax.cu).
#pragma once

#include <cuda_runtime.h>

#include "core/tensor.h"

namespace lmd::cuda {

// out[b] = the index of row b's largest logit; logits [B, V] float32/float16/bfloat16 with unit stride
// in V; out int32 [B]. Ties go to the lowest index (TurboMind's sampler, torch.argmax); a NaN counts as
// larger than any number, so the first NaN of a row wins (torch.argmax).
void argmax(const TensorView & logits, const TensorView & out, cudaStream_t stream);

}  // namespace lmd::cuda
