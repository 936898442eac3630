// lmd.kernels._kernels.cuda: the activation kernels (cuda/activation.h).
#include "bindings/cuda.h"
#include "cuda/activation.h"

namespace lmd {

namespace {

void silu_and_mul(py::handle x_h, py::handle out_h, uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), out = view_of_cuda(out_h, "out");
    expect_same_device({&x, &out}, "silu_and_mul");
    expect(x.ndim == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 && is_float(x.dtype), "x", x,
           "must be a float [T, 2 I] tensor with unit stride in its last dim");
    expect(out.ndim == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
           out.dtype == x.dtype, "out", out, "must be [T, I] with x's dtype");
    cuda::silu_and_mul(x, out, stream_of(stream));
}

void bind(py::module_ & m) {
    m.def("silu_and_mul", &silu_and_mul, py::arg("x"), py::arg("out"), py::arg("stream") = 0,
          "out[T, I] = silu(x[:, :I]) * x[:, I:] (ops.silu_and_mul on the GPU).");
}

}  // namespace

LMD_CUDA_BINDINGS(bind);

}  // namespace lmd
