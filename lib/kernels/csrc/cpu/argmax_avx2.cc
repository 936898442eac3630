// argmax.h's row with AVX2: the maximum over eight lanes in four chains (NaNs noted on the way),
// then the first index holding it, eight at a time; the reference's index in every case: max_ps
// keeps a number over a NaN, so a row with a NaN goes to the first NaN instead, and the second
// pass compares with ==, for which -0 and +0 are the same as for the reference's >.
#include <immintrin.h>

#include <cmath>

#include "cpu/argmax.h"

namespace lmd::cpu::avx2 {

int32_t argmax_row(const float * x, int64_t V) {
    const __m256 lowest = _mm256_set1_ps(-INFINITY);
    __m256 m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest, nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= V; i += 32) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b), m2 = _mm256_max_ps(m2, c), m3 = _mm256_max_ps(m3, d);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    }
    for (; i + 8 <= V; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i);
        m0 = _mm256_max_ps(m0, a);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    __m256 m = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float top = lanes[0];
    for (int l = 1; l < 8; ++l) top = lanes[l] > top ? lanes[l] : top;
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < V; ++j) {
        any_nan = any_nan || std::isnan(x[j]);
        top = x[j] > top ? x[j] : top;
    }
    if (any_nan) {
        for (int64_t j = 0; j < V; ++j)
            if (std::isnan(x[j])) return static_cast<int32_t>(j);
    }
    const __m256 t = _mm256_set1_ps(top);
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), t, _CMP_EQ_OQ));
        if (hit) return static_cast<int32_t>(j + __builtin_ctz(static_cast<unsigned>(hit)));
    }
    for (; j < V; ++j)
        if (x[j] == top) return static_cast<int32_t>(j);
    return 0;  // not reached: top is one of the row's values
}

}  // namespace lmd::cpu::avx2
