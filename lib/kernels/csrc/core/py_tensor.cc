// Tensors from Python (core/py_tensor.h): DLPack capsules and HostTensors read as TensorViews.
// Compiled into each extension that takes tensors from Python (lmd.kernels._kernels,
// lmd.turbomind._turbomind); HostTensor's Python type is registered once, by lmd.kernels.
#include "core/py_tensor.h"

#include <string>

#include "core/dlpack.h"

namespace lmd {

[[noreturn]] void fail(const std::string & msg) { throw py::value_error(msg); }

namespace {

DType dtype_of(const DLDataType & t, const char * name) {
    if (t.lanes == 1) {
        if (t.code == kDLFloat && t.bits == 32) return DType::f32;
        if (t.code == kDLFloat && t.bits == 16) return DType::f16;
        if (t.code == kDLBfloat && t.bits == 16) return DType::bf16;
        if (t.code == kDLInt && t.bits == 32) return DType::i32;
        if (t.code == kDLInt && t.bits == 64) return DType::i64;
        if (t.code == kDLInt && t.bits == 8) return DType::i8;
        if (t.code == kDLUInt && t.bits == 8) return DType::u8;
    }
    fail(std::string(name) + ": unsupported dtype (code " + std::to_string(t.code) + ", " +
         std::to_string(t.bits) + " bits)");
}

const DLTensor & dl_tensor_of(py::handle h, const char * name) {
    if (!PyCapsule_CheckExact(h.ptr()) || !PyCapsule_IsValid(h.ptr(), "dltensor")) {
        fail(std::string(name) + ": expected a DLPack capsule (torch.utils.dlpack.to_dlpack(t)) or a HostTensor");
    }
    return static_cast<DLManagedTensor *>(PyCapsule_GetPointer(h.ptr(), "dltensor"))->dl_tensor;
}

TensorView view_of_dl(const DLTensor & t, const char * name) {
    if (t.ndim > kMaxDims) fail(std::string(name) + ": too many dimensions");
    TensorView v;
    v.dtype = dtype_of(t.dtype, name);
    v.data = static_cast<char *>(t.data) + t.byte_offset;
    v.ndim = t.ndim;
    int64_t stride = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
        v.shape[i] = t.shape[i];
        v.strides[i] = t.strides ? t.strides[i] : stride;
        stride *= t.shape[i];
    }
    return v;
}

}  // namespace

TensorView view_of_capsule(py::handle h, const char * name) {
    const DLTensor & t = dl_tensor_of(h, name);
    if (t.device.device_type != kDLCPU) fail(std::string(name) + ": tensor is not on the CPU");
    return view_of_dl(t, name);
}

TensorView view_of_cuda(py::handle h, const char * name) {
    const DLTensor & t = dl_tensor_of(h, name);
    if (t.device.device_type != kDLCUDA) fail(std::string(name) + ": tensor is not on a CUDA device");
    TensorView v = view_of_dl(t, name);
    v.device = Device::cuda;
    v.device_id = t.device.device_id;
    return v;
}

TensorView view_of(py::handle h, const char * name) {
    if (py::isinstance<HostTensor>(h)) return h.cast<const HostTensor &>().view;
    return view_of_capsule(h, name);
}

std::string shape_str(const TensorView & v) {
    std::string s = "[";
    for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.shape[i]);
    return s + "]";
}

void expect(bool ok, const char * name, const TensorView & v, const std::string & what) {
    if (!ok) fail(std::string(name) + " (" + dtype_name(v.dtype) + " " + shape_str(v) + "): " + what);
}


}  // namespace lmd
