// The greedy token of a row of logits, both engines' greedy sampling (TurboMind's sampler, the
// PyTorch engine's all-greedy steps): the index of the row's largest value, ties to the lowest
// index, a NaN larger than any number so the row's first NaN wins (torch.argmax; cuda/argmax.h on
// the GPU). A scalar reference (argmax.cc) defines it, an AVX2 version (argmax_avx2.cc) equals it:
// the row's maximum in a first pass, then the first index that holds it (or the first NaN).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace lmd::cpu {

// The greedy index of x[0, V), V >= 1.
int32_t argmax_row(const float * x, int64_t V, bool reference = false);

// out[b] = argmax_row(logits[b]) for each row: logits float32 [B, V], unit stride in V, any row
// stride; out int32 or int64 [B]. Rows split over the kernels' threads where they pay.
void argmax(const TensorView & logits, const TensorView & out, bool reference = false);

namespace ref {
int32_t argmax_row(const float * x, int64_t V);
}
namespace avx2 {
int32_t argmax_row(const float * x, int64_t V);
}

}  // namespace lmd::cpu
