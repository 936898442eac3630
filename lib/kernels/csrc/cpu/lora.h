// Multi-LoRA on a batch whose rows run different adapters (lmd/lora.py: S-LoRA / Punica's SGMV,
// on the CPU): y[t] += B[s] (A[s] x[t]) for each row t of adapter s = row_slots[t], the adapters
// never merged into the base weights, so one step serves any mix of them and the base model.
//
// The rows are cut into runs of one slot (a sequence's rows are consecutive in a step, so a run is
// usually a sequence, or several of one adapter), and each run is two small matmuls through
// cpu::linear (kernels.h): the shrink xa[M, R] = x[M, K] · A[R, K]ᵀ and the expand
// d[M, N] = xa · B[N, R]ᵀ, both float32 in thread-local scratch (16-bit x widened exactly first),
// then y[t, n] = y[t, n] + d[t, n] rounded once to y's dtype. A run of one row is a GEMV over A
// and B, a prefill chunk a GEMM. The shrink's output stays float32 (PEFT rounds it to the model
// dtype in 16-bit models; the difference is below that dtype's rounding of y).
//
// Like every kernel here, row t's result depends on nothing but row t: not on the rows beside it,
// the runs, nor the thread count (cpu::linear's guarantee).
#pragma once

#include "core/tensor.h"

namespace lmd::cpu {

// One adapter's matmul: a [R, K], b [N, R], contiguous, in one float dtype (the scale folded
// into b); a.data == nullptr: this adapter does not touch the matmul.
struct LoraWeights {
    TensorView a, b;
};

// y[T, N] += per row (x[t] · a[s]ᵀ) · b[s]ᵀ, s = row_slots[t]; rows with s < 0 (no adapter) or an
// absent slots[s] are left alone. x [T, K] and y [T, N]: 2-D, unit stride in the last dim, any
// row stride, one float dtype each; 0 <= s < num_slots (the caller checks: bindings/lora.cc).
void lora_apply(const TensorView & x, const TensorView & y, const int32_t * row_slots, const LoraWeights * slots,
                int64_t num_slots, bool reference = false);

}  // namespace lmd::cpu
