// Python bindings of the TurboMind core: lmd.turbomind._turbomind.
#include <pybind11/pybind11.h>

#include "cpu_features.h"

#if defined(LMD_WITH_OPENMP)
#include <omp.h>
#endif

namespace py = pybind11;

namespace turbomind {
void bind_ops(py::module_ & m);
void bind_engine_parts(py::module_ & m);
void bind_models(py::module_ & m);
}

PYBIND11_MODULE(_turbomind, m) {
    m.doc() = "TurboMind: lmd's C++ inference engine";
    m.attr("__version__") = LMD_VERSION;
#if defined(LMD_WITH_CUDA)
    m.attr("with_cuda") = true;
#else
    m.attr("with_cuda") = false;
#endif
#if defined(LMD_WITH_OPENMP)
    m.attr("with_openmp") = true;
#else
    m.attr("with_openmp") = false;
#endif

    m.def("cpu_features", []() {
        const turbomind::cpu_features & f = turbomind::cpu_features_get();
        py::dict d;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["avx512f"] = f.avx512f;
        d["num_procs"] = f.num_procs;
        return d;
    }, "The instruction sets the kernels may use on this CPU, and its processor count.");
    m.def("cpu_features_summary", &turbomind::cpu_features_summary);
    m.def("release_openmp_threads", []() {
#if defined(LMD_WITH_OPENMP)
        return omp_pause_resource_all(omp_pause_soft) == 0;
#else
        return false;
#endif
    }, "Let the calling thread's idle OpenMP workers (torch's, after loading) exit. libgomp spins a worker "
       "between parallel regions only while it manages no more threads than there are CPUs; with torch's "
       "pool idle beside the engine thread's, every kernel's workers would sleep and wake instead.");
    turbomind::bind_ops(m);
    turbomind::bind_engine_parts(m);
    turbomind::bind_models(m);
}
