// argmax.h: the scalar reference and the dispatch over rows.
#include "cpu/argmax.h"

#include <algorithm>
#include <cmath>

#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace lmd::cpu {

namespace ref {

int32_t argmax_row(const float * x, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; ++i) {
        if (std::isnan(x[i])) return static_cast<int32_t>(i);
        if (x[i] > x[best]) best = i;  // strict: ties keep the lowest index
    }
    return static_cast<int32_t>(best);
}

}  // namespace ref

int32_t argmax_row(const float * x, int64_t V, bool reference) {
    return reference || !isa_at_least(Isa::avx2) ? ref::argmax_row(x, V) : avx2::argmax_row(x, V);
}

void argmax(const TensorView & logits, const TensorView & out, bool reference) {
    const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0);
    const float * x = logits.ptr<float>();
    // a thread a row from ~64k values (a vocabulary row of 49k reads 192 KB: ~10 us)
    const int threads = static_cast<int>(std::min<int64_t>({num_threads(), B, std::max<int64_t>(1, B * V >> 16)}));
    parallel(threads, [&](int t, int nt) {
        for (int64_t b = B * t / nt; b < B * (t + 1) / nt; ++b) {
            const int32_t i = argmax_row(x + b * ld, V, reference);
            if (out.dtype == DType::i64) {
                out.ptr<int64_t>()[b] = i;
            } else {
                out.ptr<int32_t>()[b] = i;
            }
        }
    });
}

}  // namespace lmd::cpu
