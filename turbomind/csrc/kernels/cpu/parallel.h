// The one way CPU kernels use threads: fn(thread_index, num_threads) on `threads` OpenMP
// threads (the libgomp torch loads too, so the two never oversubscribe), inline when one.
#pragma once

#if defined(LMD_WITH_OPENMP)
#include <omp.h>
#endif

namespace turbomind::cpu {

template <typename Fn>
void parallel(int threads, Fn && fn) {
#if defined(LMD_WITH_OPENMP)
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        fn(omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    fn(0, 1);
}

}  // namespace turbomind::cpu
