// Python bindings of the TurboMind engine: lmd.turbomind._turbomind. Its kernels come from the
// kernel library (lmd_kernels, linked in statically); their Python face is lmd.kernels.
#include <pybind11/pybind11.h>

#include "bindings/pool_stats.h"
#include "cpu/kernels.h"

namespace py = pybind11;

namespace turbomind {
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
    // HostTensor, the kernels' weight handle that LlamaModel takes, is registered by lmd.kernels
    py::module_::import("lmd.kernels");
    // The kernels linked here keep their own thread count (and pool), apart from lmd.kernels'
    m.def("set_num_threads", &lmd::cpu::set_num_threads, py::arg("n"),
          "Threads the engine's kernels may use (TurbomindEngineConfig.num_threads)");
    m.def("num_threads", &lmd::cpu::num_threads);
    m.def("thread_pool_stats", &lmd::thread_pool_stats_dict,
          "The engine's own copy of the kernels' thread pool: as lmd.kernels._kernels.thread_pool_stats.");
    turbomind::bind_engine_parts(m);
    turbomind::bind_models(m);
}
