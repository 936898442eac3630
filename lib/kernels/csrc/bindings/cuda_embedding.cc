// lmd.kernels._kernels.cuda: the token embedding lookup (cuda/embedding.h).
#include "bindings/cuda.h"
#include "cuda/embedding.h"

namespace lmd {

namespace {

void embedding(py::handle ids_h, py::handle table_h, py::handle out_h, uintptr_t stream) {
    const TensorView ids = view_of_cuda(ids_h, "ids"), table = view_of_cuda(table_h, "table");
    const TensorView out = view_of_cuda(out_h, "out");
    expect_same_device({&ids, &table, &out}, "embedding");
    expect(ids.ndim == 1 && (ids.dtype == DType::i32 || ids.dtype == DType::i64) && ids.stride(0) == 1 &&
           ids.size(0) <= 0x7fffffff, "ids", ids, "must be a contiguous int32 or int64 [T] tensor");
    expect(table.ndim == 2 && table.stride(1) == 1 && is_float(table.dtype), "table", table,
           "must be a float [V, H] tensor with unit stride in H");
    expect(out.ndim == 2 && out.stride(1) == 1 && out.size(0) == ids.size(0) && out.size(1) == table.size(1) &&
           out.dtype == table.dtype, "out", out, "must be [T, H] with table's dtype and unit stride in H");
    cuda::embedding(ids, table, out, stream_of(stream));
}

void bind(py::module_ & m) {
    m.def("embedding", &embedding, py::arg("ids"), py::arg("table"), py::arg("out"), py::arg("stream") = 0,
          "out[T, H] = table[ids[T]]; an id outside the table gives a row of zeros.");
}

}  // namespace

LMD_CUDA_BINDINGS(bind);

}  // namespace lmd
