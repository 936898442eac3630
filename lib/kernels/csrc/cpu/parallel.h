// How CPU kernels use threads: fn(thread_index, num_threads) on `threads` OpenMP threads (the
// libgomp torch loads too, so the two never oversubscribe), inline when one; parallel_ranges
// shares a range out in pieces on top of it.
#pragma once

#include <atomic>
#include <algorithm>
#include <cstdint>

#if defined(LMD_WITH_OPENMP)
#include <omp.h>
#endif

namespace lmd::cpu {

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

// Pieces per thread for parallel_ranges: enough that a thread the OS takes away for a moment
// leaves its remaining pieces to the others, few enough that taking one costs nothing.
constexpr int64_t kChunksPerThread = 4;

// fn(begin, end) over [0, n) cut into pieces of whole units of `align`, each thread taking the
// next piece when it is done with one. With a fixed share each, a thread preempted by another
// process (a server's I/O thread waking on the same cores) would hold every other at the end.
template <typename Fn>
void parallel_ranges(int threads, int64_t n, int64_t align, Fn && fn) {
    const int64_t units = (n + align - 1) / align;
    const int64_t chunks = std::min<int64_t>(units, threads > 1 ? threads * kChunksPerThread : 1);
    auto piece = [&](int64_t c) {
        const int64_t begin = std::min(n, units * c / chunks * align);
        const int64_t end = std::min(n, units * (c + 1) / chunks * align);
        if (begin < end) fn(begin, end);
    };
    if (chunks <= 1) {
        for (int64_t c = 0; c < chunks; ++c) piece(c);
        return;
    }
    std::atomic<int64_t> next{0};
    parallel(threads, [&](int, int) {
        for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
             c = next.fetch_add(1, std::memory_order_relaxed)) {
            piece(c);
        }
    });
}

}  // namespace lmd::cpu
