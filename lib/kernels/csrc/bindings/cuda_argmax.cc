// lmd.kernels._kernels.cuda: the greedy token per row (cuda/argmax.h).
#include "bindings/cuda.h"
#include "cuda/argmax.h"

namespace lmd {

namespace {

void argmax(py::handle logits_h, py::handle out_h, uintptr_t stream) {
    const TensorView logits = view_of_cuda(logits_h, "logits"), out = view_of_cuda(out_h, "out");
    expect_same_device({&logits, &out}, "argmax");
    expect(logits.ndim == 2 && logits.stride(1) == 1 && is_float(logits.dtype) && logits.size(1) >= 1 &&
           logits.size(1) < (int64_t(1) << 30) && logits.size(0) <= 0x7fffffff, "logits", logits,
           "must be a float [B, V] tensor with unit stride in V and 1 <= V < 2^30");
    expect(out.ndim == 1 && out.size(0) == logits.size(0) && out.dtype == DType::i32 && out.stride(0) == 1, "out", out,
           "must be a contiguous int32 [B] tensor");
    cuda::argmax(logits, out, stream_of(stream));
}

void bind(py::module_ & m) {
    m.def("argmax", &argmax, py::arg("logits"), py::arg("out"), py::arg("stream") = 0,
          "out[b] (int32) = argmax of logits[b, :]: ties to the lowest index, the first NaN above every number "
          "(torch.argmax; TurboMind's greedy sampler).");
}

}  // namespace

LMD_CUDA_BINDINGS(bind);

}  // namespace lmd
