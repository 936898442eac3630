// Tensors from Python: DLPack capsules (torch.utils.dlpack.to_dlpack(t)) or HostTensors
// (a capsule parsed once and kept alive, for arguments passed often, like weights),
// read as TensorViews after checking device and dtype. Shared by every binding file.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "core/tensor.h"

namespace lmd {

namespace py = pybind11;

struct HostTensor {
    TensorView view;
    py::object owner;  // the capsule, which holds a reference to the array
};

// Raises ValueError(msg).
[[noreturn]] void fail(const std::string & msg);

TensorView view_of_capsule(py::handle h, const char * name);  // host memory only
TensorView view_of(py::handle h, const char * name);  // a capsule or a HostTensor, host memory only
// A capsule of a tensor in CUDA memory (the CUDA kernels' bindings).
TensorView view_of_cuda(py::handle h, const char * name);
// view_of or view_of_cuda, for checks that both the CPU and the CUDA bindings share.
using ViewReader = TensorView (*)(py::handle, const char *);
std::string shape_str(const TensorView & v);
// Raises ValueError "name (dtype [shape]): what" unless ok.
void expect(bool ok, const char * name, const TensorView & v, const std::string & what);
inline bool is_float(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

}  // namespace lmd
