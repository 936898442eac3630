// Views over memory the model files own, and the per-thread scratch their steps reuse.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/tensor.h"

namespace turbomind {

using namespace lmd;

// A contiguous view of `shape` at `data`.
inline TensorView view(void * data, DType dtype, std::initializer_list<int64_t> shape) {
    TensorView v;
    v.data = data;
    v.dtype = dtype;
    v.ndim = static_cast<int>(shape.size());
    int i = 0;
    for (int64_t s : shape) v.shape[i++] = s;
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
        v.strides[d] = stride;
        stride *= v.shape[d];
    }
    return v;
}

// A [rows, cols] view at `data` whose rows lie `ld` elements apart (contiguous: ld = cols).
inline TensorView strided(void * data, DType dtype, int64_t rows, int64_t cols, int64_t ld) {
    TensorView v = view(data, dtype, {rows, cols});
    v.strides[0] = ld;
    return v;
}

// Scratch that grows to the largest step seen and is reused (one per thread: `static thread_local`).
struct Scratch {
    std::vector<uint8_t> bytes;
    void * get(size_t n) {
        if (bytes.size() < n) bytes.resize(n);
        return bytes.data();
    }
    template <typename T>
    T * get(int64_t n) {
        return static_cast<T *>(get(static_cast<size_t>(n) * sizeof(T)));
    }
};

}  // namespace turbomind
