// Embedding rows copied one block per token, as 16-byte vectors where every row is aligned.
#include "cuda/common.cuh"
#include "cuda/embedding.h"
#include "cuda/vec.cuh"

namespace lmd::cuda {

namespace {

// Rows of n_vec vectors V (any trivially copyable element type: the copy does no arithmetic).
template <typename V, typename I>
__global__ void embedding_kernel(const I * __restrict__ ids, const V * __restrict__ table, int64_t ldt, int64_t rows,
                                 V * __restrict__ out, int64_t ldo, int64_t n_vec) {
    const int64_t t = blockIdx.x;
    const int64_t id = static_cast<int64_t>(ids[t]);
    V * dst = out + t * ldo;
    if (id < 0 || id >= rows) {
        V zero;
        for (size_t b = 0; b < sizeof(V); ++b) reinterpret_cast<unsigned char *>(&zero)[b] = 0;
        for (int64_t j = threadIdx.x; j < n_vec; j += blockDim.x) dst[j] = zero;
        return;
    }
    const V * src = table + id * ldt;
    for (int64_t j = threadIdx.x; j < n_vec; j += blockDim.x) dst[j] = src[j];
}

// V: the vector type; strides and H are in table elements of `bytes` each.
template <typename V, typename I>
void launch(const TensorView & ids, const TensorView & table, const TensorView & out, size_t bytes,
            cudaStream_t stream) {
    const int64_t per = sizeof(V) / bytes;  // elements per vector
    const int64_t n_vec = table.size(1) / per;
    embedding_kernel<V, I><<<static_cast<unsigned>(ids.size(0)), row_threads(n_vec, 256), 0, stream>>>(
        ids.ptr<I>(), table.ptr<V>(), table.stride(0) / per, table.size(0), out.ptr<V>(), out.stride(0) / per, n_vec);
}

template <typename I>
void launch_ids(const TensorView & ids, const TensorView & table, const TensorView & out, cudaStream_t stream) {
    const size_t bytes = dtype_size(table.dtype);
    if (aligned16({table.data, out.data}, {table.stride(0), out.stride(0)}, table.size(1), bytes)) {
        launch<uint4, I>(ids, table, out, bytes, stream);
    } else if (bytes == 4) {
        launch<uint32_t, I>(ids, table, out, bytes, stream);
    } else {
        launch<uint16_t, I>(ids, table, out, bytes, stream);
    }
}

}  // namespace

void embedding(const TensorView & ids, const TensorView & table, const TensorView & out, cudaStream_t stream) {
    if (ids.size(0) == 0 || table.size(1) == 0) return;
    if (ids.dtype == DType::i32) {
        launch_ids<int32_t>(ids, table, out, stream);
    } else {
        launch_ids<int64_t>(ids, table, out, stream);
    }
    LMD_CUDA_LAUNCHED("embedding");
}

}  // namespace lmd::cuda
