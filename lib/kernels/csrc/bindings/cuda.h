// The CUDA half's Python face, lmd.kernels._kernels.cuda (built with LMD_WITH_CUDA only).
// Each bindings/cuda_*.cc file registers its kernels with LMD_CUDA_BINDINGS(fn): fn(m) is called
// with the `cuda` submodule when the extension loads, so a new file needs no edit elsewhere.
// Every kernel takes `stream`, the address of the CUDA stream to run on (0: the default stream;
// from torch: torch.cuda.current_stream().cuda_stream), and runs asynchronously on it.
#pragma once

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "core/py_tensor.h"

namespace lmd {

using CudaBindings = void (*)(py::module_ & m);

struct RegisterCudaBindings {
    explicit RegisterCudaBindings(CudaBindings f);
};

#define LMD_CUDA_BINDINGS(fn) static ::lmd::RegisterCudaBindings lmd_cuda_bindings_##fn(fn)

inline cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Raises ValueError unless every view is on one CUDA device (the current one).
void expect_same_device(std::initializer_list<const TensorView *> views, const char * what);

void bind_cuda(py::module_ & m);  // module.cc

}  // namespace lmd
