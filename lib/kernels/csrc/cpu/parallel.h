// How CPU kernels use threads: on the kernels' own pool (thread_pool.h), never OpenMP's, so a
// thread the OS takes away holds only the piece it is in, not the region. Which thread runs a
// piece is never fixed, and no result may depend on it: a piece is a fixed run of rows or
// columns, cut from the threads asked for, computed the same wherever it runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/thread_pool.h"

namespace lmd::cpu {

// fn(piece, thread) for piece in [0, pieces), on up to `threads` threads (thread < threads:
// an index for per-thread scratch), each thread taking the next piece when done with one.
template <typename Fn>
void parallel_pieces(int threads, int64_t pieces, Fn && fn) {
    if (threads <= 1 || pieces <= 1) {
        for (int64_t p = 0; p < pieces; ++p) fn(p, 0);
        return;
    }
    using F = std::remove_reference_t<Fn>;
    run_chunks(threads, pieces, [](void * ctx, int64_t p, int thread) { (*static_cast<F *>(ctx))(p, thread); },
               const_cast<void *>(static_cast<const void *>(&fn)));
}

// Pieces per thread: enough that a thread the OS takes away for a moment leaves its remaining
// pieces to the others, few enough that taking one costs nothing.
constexpr int64_t kChunksPerThread = 4;

// fn(t, nt) for t in [0, nt): share t of nt equal shares of the work (rows nt-th by nt-th), as a
// static schedule would cut it, nt = threads * kChunksPerThread, each share taken by whichever
// thread is free.
template <typename Fn>
void parallel(int threads, Fn && fn) {
    const int nt = threads > 1 ? threads * static_cast<int>(kChunksPerThread) : 1;
    parallel_pieces(threads, nt, [&](int64_t t, int) { fn(static_cast<int>(t), nt); });
}

// fn(begin, end) over [0, n) cut into pieces of whole units of `align` (the cut depends on n,
// align and threads only).
template <typename Fn>
void parallel_ranges(int threads, int64_t n, int64_t align, Fn && fn) {
    const int64_t units = (n + align - 1) / align;
    const int64_t chunks = std::min<int64_t>(units, threads > 1 ? threads * kChunksPerThread : 1);
    parallel_pieces(threads, chunks, [&](int64_t c, int) {
        const int64_t begin = std::min(n, units * c / chunks * align);
        const int64_t end = std::min(n, units * (c + 1) / chunks * align);
        if (begin < end) fn(begin, end);
    });
}

}  // namespace lmd::cpu
