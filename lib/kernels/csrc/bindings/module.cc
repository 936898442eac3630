// lmd.kernels._kernels: the kernel library's Python face. `ops` holds the kernels (each with
// `reference=True` for its scalar reference); the rest says what this CPU and build can do
// and the threads the kernels run on (their own pool; OpenMP is torch's).
#include <pybind11/pybind11.h>

#include <atomic>
#include <vector>

#include "bindings/pool_stats.h"
#include "cpu/cpu_features.h"
#include "cpu/parallel.h"

#if defined(LMD_WITH_OPENMP)
#include <omp.h>
#endif

namespace py = pybind11;

namespace lmd {
void bind_ops(py::module_ & m);
#if defined(LMD_WITH_CUDA)
void bind_cuda(py::module_ & m);  // bindings/cuda.cc
#endif
}

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "lmd's kernel library: CPU kernels (AVX2 with scalar references) and, built with CUDA, the `cuda` "
              "kernels; shared by both engines";
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
        d["avx512bw"] = f.avx512bw;
        d["avx512vl"] = f.avx512vl;
        d["avx512dq"] = f.avx512dq;
        d["avx512vnni"] = f.avx512vnni;
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
    }, "Let the calling thread's idle OpenMP workers (torch's, after loading) exit: libgomp workers left "
       "spinning after torch's last parallel region would take the cores from the kernels' pool.");
    m.def("thread_pool_stats", &lmd::thread_pool_stats_dict,
          "The kernels' thread pool (of this module; TurboMind's engine links its own): workers started, the "
          "team the next region may use, regions run on it and inline, stalls on a preempted worker, team cuts.");
    m.def("thread_pool_check", [](int threads, int64_t regions, int64_t pieces) {
        py::gil_scoped_release release;
        // every piece of every region runs exactly once, on a thread index below `threads`
        std::vector<std::atomic<int64_t>> runs(pieces);
        std::atomic<int64_t> bad_thread{0};
        for (int64_t r = 0; r < regions; ++r) {
            lmd::cpu::parallel_pieces(threads, pieces, [&](int64_t p, int thread) {
                runs[p].fetch_add(1, std::memory_order_relaxed);
                if (thread < 0 || thread >= threads) bad_thread.fetch_add(1, std::memory_order_relaxed);
            });
        }
        int64_t wrong = bad_thread.load();
        for (int64_t p = 0; p < pieces; ++p) wrong += runs[p].load() != regions;
        return wrong;
    }, py::arg("threads"), py::arg("regions"), py::arg("pieces"),
       "Runs `regions` regions of `pieces` pieces on `threads` threads; returns how many pieces did not run "
       "exactly once per region or ran on a thread index out of range (0: all well). For the tests.");
    lmd::bind_ops(m);
#if defined(LMD_WITH_CUDA)
    lmd::bind_cuda(m);
#endif
}
