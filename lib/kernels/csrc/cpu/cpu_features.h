// What the CPU running this process can do; the kernel dispatch reads it once.
#pragma once

#include <string>

namespace lmd {

struct cpu_features {
    bool avx2 = false;
    bool fma = false;
    bool f16c = false;
    bool avx512f = false;
    int  num_procs = 1;  // logical processors this process may run on
};

const cpu_features & cpu_features_get();
std::string cpu_features_summary();

}  // namespace lmd
