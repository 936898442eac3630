// lmd.kernels._kernels.cuda: RMS norm (cuda/norm.h), with ops.rms_norm's argument checks.
#include "bindings/cuda.h"
#include "cuda/norm.h"

namespace lmd {

namespace {

void rms_norm(py::handle x_h, py::handle w_h, float eps, py::handle out_h, py::handle residual_h, uintptr_t stream) {
    const TensorView x = view_of_cuda(x_h, "x"), w = view_of_cuda(w_h, "weight"), out = view_of_cuda(out_h, "out");
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x, "must be a float [M, H] tensor with unit stride in H");
    expect(w.ndim == 1 && w.size(0) == x.size(1) && w.contiguous() && w.dtype == x.dtype, "weight", w,
           "must be [H] with x's dtype");
    expect(out.ndim == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == x.size(1) &&
           out.dtype == x.dtype, "out", out, "must have x's shape and dtype");
    expect(x.size(0) <= 0x7fffffff, "x", x, "must have fewer than 2^31 rows");
    TensorView residual;
    const bool has_residual = !residual_h.is_none();
    if (has_residual) {
        residual = view_of_cuda(residual_h, "residual");
        expect(residual.ndim == 2 && residual.stride(1) == 1 && residual.size(0) == x.size(0) &&
               residual.size(1) == x.size(1) && residual.dtype == x.dtype, "residual", residual,
               "must have x's shape and dtype");
        expect_same_device({&x, &w, &out, &residual}, "rms_norm");
    } else {
        expect_same_device({&x, &w, &out}, "rms_norm");
    }
    cuda::rms_norm(x, w, eps, out, has_residual ? &residual : nullptr, stream_of(stream));
}

void bind(py::module_ & m) {
    m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("out"),
          py::arg("residual") = py::none(), py::arg("stream") = 0,
          "out = rms_norm(x) * weight; with residual: residual += x first, and the sum is normalised "
          "(ops.rms_norm on the GPU).");
}

}  // namespace

LMD_CUDA_BINDINGS(bind);

}  // namespace lmd
