// lmd.kernels._kernels.cuda: the device's facts and every registered bindings/cuda_*.cc file.
#include "bindings/cuda.h"

#include <vector>

namespace lmd {

namespace {

std::vector<CudaBindings> & registry() {
    static std::vector<CudaBindings> r;
    return r;
}

}  // namespace

RegisterCudaBindings::RegisterCudaBindings(CudaBindings f) { registry().push_back(f); }

void expect_same_device(std::initializer_list<const TensorView *> views, const char * what) {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess) fail(std::string(what) + ": no CUDA device");
    for (const TensorView * v : views) {
        if (v->device != Device::cuda || v->device_id != current) {
            fail(std::string(what) + ": every tensor must be on the current CUDA device (cuda:" +
                 std::to_string(current) + ")");
        }
    }
}

void bind_cuda(py::module_ & m) {
    py::module_ cuda = m.def_submodule("cuda", "The kernel library's CUDA kernels (csrc/cuda), on DLPack views of "
                                               "device tensors; each runs asynchronously on the stream it is given.");
    cuda.def("device_count", []() {
        int n = 0;
        return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
    }, "CUDA devices this process sees (0 when there is no driver or device).");
    cuda.def("runtime_version", []() {
        int v = 0;
        cudaRuntimeGetVersion(&v);
        return v;
    }, "The CUDA runtime lmd was built against, e.g. 13000.");
    cuda.def("compiled_archs", []() { return std::string(LMD_CUDA_ARCHS); },
             "The GPU architectures the CUDA kernels were compiled for (CMAKE_CUDA_ARCHITECTURES).");
    for (CudaBindings f : registry()) f(cuda);
}

}  // namespace lmd
