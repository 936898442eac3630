// lmd.kernels._kernels: the kernel library's Python face. `ops` holds the kernels (each with
// `reference=True` for its scalar reference); the rest says what this CPU and build can do
// and manages the OpenMP threads the kernels run on.
#include <pybind11/pybind11.h>

#include "cpu/cpu_features.h"

#if defined(LMD_WITH_OPENMP)
#include <omp.h>
#endif

namespace py = pybind11;

namespace lmd {
void bind_ops(py::module_ & m);
}

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "lmd's kernel library: CPU kernels (AVX2 with scalar references), shared by both engines";
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
        const lmd::cpu_features & f = lmd::cpu_features_get();
        py::dict d;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["avx512f"] = f.avx512f;
        d["num_procs"] = f.num_procs;
        return d;
    }, "The instruction sets the kernels may use on this CPU, and its processor count.");
    m.def("cpu_features_summary", &lmd::cpu_features_summary);
    m.def("release_openmp_threads", []() {
#if defined(LMD_WITH_OPENMP)
        return omp_pause_resource_all(omp_pause_soft) == 0;
#else
        return false;
#endif
    }, "Let the calling thread's idle OpenMP workers (torch's, after loading) exit. libgomp spins a worker "
       "between parallel regions only while it manages no more threads than there are CPUs; with torch's "
       "pool idle beside the engine thread's, every kernel's workers would sleep and wake instead.");
    lmd::bind_ops(m);
}
