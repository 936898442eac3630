// N elements moved as one load/store: 16 bytes when the caller has checked the alignment, else one.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace lmd::cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

// Whether every pointer is 16-byte aligned and every row stride (in elements of `bytes` each) and
// the row length n keep it so: then rows can be read as 16-byte vectors.
inline bool aligned16(std::initializer_list<const void *> ptrs, std::initializer_list<int64_t> strides, int64_t n,
                      size_t bytes) {
    for (const void * p : ptrs) {
        if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    }
    for (int64_t s : strides) {
        if ((s * static_cast<int64_t>(bytes)) % 16 != 0) return false;
    }
    return (n * static_cast<int64_t>(bytes)) % 16 == 0;
}

// Threads for one block per row of n_vec vectors: a multiple of 32 in [32, 1024].
inline int row_threads(int64_t n_vec, int max_threads = 1024) {
    const int64_t t = (n_vec + 31) / 32 * 32;
    return static_cast<int>(t < 32 ? 32 : t > max_threads ? max_threads : t);
}

}  // namespace lmd::cuda
