// The kernels' thread pool's counters as a Python dict: each extension that links lmd_kernels
// (lmd.kernels._kernels, lmd.turbomind._turbomind) has its own pool and binds this for it.
#pragma once

#include <pybind11/pybind11.h>

#include "cpu/thread_pool.h"

namespace lmd {

inline pybind11::dict thread_pool_stats_dict() {
    const cpu::ThreadPoolStats s = cpu::thread_pool_stats();
    pybind11::dict d;
    d["workers"] = s.workers;
    d["team"] = s.team;
    d["regions"] = s.regions;
    d["inline_regions"] = s.inline_regions;
    d["stalls"] = s.stalls;
    d["shrinks"] = s.shrinks;
    return d;
}

}  // namespace lmd
