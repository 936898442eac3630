// The paged KV cache's arguments, checked once for every binding that takes them (the CPU ops and
// the CUDA kernels): float caches of the model's dtype, or quantized ones with their params.
#pragma once

#include "core/py_tensor.h"

namespace lmd {

// k_cache / v_cache [num_blocks, block_size, num_kv_heads, D] of `dtype` or, with k_params and
// v_params given, a quantized cache (uint8 rows of D codes, 8 bits, or D / 2 bytes, 4 bits) whose
// params `read` reads into kvq (view_of for host tensors, view_of_cuda for device ones). Raises
// ValueError naming the argument; returns whether the cache is quantized.
bool check_kv_cache(const TensorView & kc, const TensorView & vc, py::handle kp_h, py::handle vp_h, DType dtype,
                    int64_t num_kv_heads, int64_t D, KVQuant & kvq, ViewReader read);

}  // namespace lmd
