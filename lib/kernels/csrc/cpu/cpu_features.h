// What the CPU running this process can do; the kernel dispatch reads it once.
#pragma once

#include <string>

namespace lmd {

struct cpu_features {
    bool avx2 = false;
    bool fma = false;
    bool f16c = false;
    bool avx512f = false;
    bool avx512bw = false;
    bool avx512vl = false;
    bool avx512dq = false;
    bool avx512vnni = false;  // VPDPBUSD: int8 dot products accumulated in int32
    int  num_procs = 1;  // logical processors this process may run on
};

const cpu_features & cpu_features_get();
std::string cpu_features_summary();

}  // namespace lmd
