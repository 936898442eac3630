#include "cpu/cpu_features.h"

#include <thread>

#if defined(LMD_WITH_OPENMP)
#include <omp.h>
#endif

namespace lmd {

static cpu_features cpu_features_detect() {
    cpu_features f;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    // these keys check that the OS saves the registers too (XCR0), not only CPUID
    f.avx512f = __builtin_cpu_supports("avx512f");
    f.avx512bw = __builtin_cpu_supports("avx512bw");
    f.avx512vl = __builtin_cpu_supports("avx512vl");
    f.avx512dq = __builtin_cpu_supports("avx512dq");
    f.avx512vnni = __builtin_cpu_supports("avx512vnni");
    // GCC and Clang have no "f16c" key on every version; F16C is CPUID.1:ECX bit 29.
    unsigned int eax = 1, ebx = 0, ecx = 0, edx = 0;
    __asm__ __volatile__("cpuid" : "+a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "c"(0));
    f.f16c = (ecx >> 29) & 1u;
#endif
#if defined(LMD_WITH_OPENMP)
    f.num_procs = omp_get_num_procs();
#else
    f.num_procs = static_cast<int>(std::thread::hardware_concurrency());
#endif
    if (f.num_procs < 1) {
        f.num_procs = 1;
    }
    return f;
}

const cpu_features & cpu_features_get() {
    static const cpu_features features = cpu_features_detect();
    return features;
}

std::string cpu_features_summary() {
    const cpu_features & f = cpu_features_get();
    std::string s;
    s += f.avx2 ? "AVX2 " : "";
    s += f.fma ? "FMA " : "";
    s += f.f16c ? "F16C " : "";
    s += f.avx512f ? "AVX512F " : "";
    s += f.avx512bw ? "AVX512BW " : "";
    s += f.avx512vl ? "AVX512VL " : "";
    s += f.avx512dq ? "AVX512DQ " : "";
    s += f.avx512vnni ? "AVX512VNNI " : "";
    s += "procs=" + std::to_string(f.num_procs);
    return s;
}

}  // namespace lmd
