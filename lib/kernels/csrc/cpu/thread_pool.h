// The kernels' own team of threads: a parallel region is `chunks` pieces of work that the
// calling thread and the pool's workers claim one at a time from an atomic counter, and the
// region ends when every piece is done, not when every thread has arrived. A worker the OS
// has taken away (another process busy on its core) then holds nobody: it claims nothing until
// it runs again, and only a piece it had already claimed is waited for. Idle workers spin a
// short while for the next region, then sleep; the caller does the same for the last pieces.
// When the caller's waits for pieces (their worker preempted mid-piece) cost a good share of the
// regions' time lately, the team shrinks by one for a while and grows back on a probe: on a core
// shared with a busy process, a worker costs more in stalls than it brings; a stall now and then
// (another thread of the process waking for a moment) does not cut it.
//
// One region runs at a time per pool (one pool per library that links lmd_kernels); a region
// started while another runs (a second calling thread, or a kernel inside a region) runs its
// pieces inline on its caller, so the cores are never oversubscribed by the kernels themselves.
#pragma once

#include <cstdint>

namespace lmd::cpu {

// fn(ctx, chunk, thread): run piece `chunk` on thread `thread` (0: the caller; < threads). It
// must not throw: the other threads may still be running pieces on the caller's data.
using ChunkFn = void (*)(void * ctx, int64_t chunk, int thread);

// Runs fn over chunks [0, chunks) on up to `threads` threads (the caller included) and returns
// when all are done. Every piece runs exactly once; which thread runs it is not fixed.
void run_chunks(int threads, int64_t chunks, ChunkFn fn, void * ctx);

struct ThreadPoolStats {
    int workers = 0;        // threads started (besides callers)
    int team = 0;           // threads the next region may use, the caller included (0: no limit yet)
    int64_t regions = 0;    // regions run on the pool
    int64_t inline_regions = 0;  // regions run on their caller alone (busy pool, one thread, one chunk)
    int64_t stalls = 0;     // regions whose caller waited long for a preempted worker's piece
    int64_t shrinks = 0;    // times the team was cut after a stall
};

ThreadPoolStats thread_pool_stats();

}  // namespace lmd::cpu
