// The kernels' thread pool (see thread_pool.h for what a region is and why it ends on work done).
//
// A region is published as fields (fn, ctx, chunks) and one 64-bit claim word: a generation
// (24 bits; it only tells a waiting worker that something new came), the team less one (8 bits)
// and the pieces left unclaimed (32 bits). Piece r - 1 is claimed with a compare-and-swap of
// (g, t, r) -> (g, t, r - 1), so claims count down; the fields are read only after a claim
// succeeded: the region cannot end (nor its fields change) before that piece is done.
#include "cpu/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>

namespace lmd::cpu {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

constexpr int kMaxThreads = 256;  // the team less one fits the claim word's 8 bits
// An idle worker spins this long for the next region before it sleeps: a decode step's regions
// come tens of microseconds apart, its steps milliseconds apart.
constexpr microseconds kWorkerSpin{200};
// The caller spins this long for the last pieces before it sleeps; asleep, its core is free for
// the OS to move the preempted worker onto.
constexpr microseconds kCallerSpin{50};
// A wait for the last pieces longer than this (and than a few pieces' time) is a stall: the
// worker holding one was preempted, and will be for a scheduler slice (milliseconds).
constexpr microseconds kStallWait{300};
constexpr int kStallPieces = 4;
// A stall cuts the team only when the stalls' waits have taken more than this share of the
// regions' time lately (a window of about kStallWindow, halved as it fills): a worker on a core
// shared with a busy process stalls every slice, one beside a thread that wakes briefly now and
// then (the engine handing out a step's tokens) once in tens of milliseconds, and is worth its
// core. Two threads on two cores, one stalled a millisecond per 40 ms step: 2.5%, kept; the same
// with a busy loop on one of the cores: about half, cut.
constexpr double kStallShare = 0.3;
constexpr milliseconds kStallWindow{100};
// A worker that claims nothing in this many regions in a row is late every time (woken too
// slowly on a busy core): as good as a stall, without the wait.
constexpr int kLateRegions = 16;
// After a cut the team grows back by one after a backoff, doubled each time the grown team
// stalls again within kProbation, back to the least after a quiet kProbation.
constexpr milliseconds kBackoffMin{4};
constexpr milliseconds kBackoffMax{512};
constexpr milliseconds kProbation{200};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

inline uint32_t gen_of(uint64_t word) { return static_cast<uint32_t>(word >> 40); }
inline int team_of(uint64_t word) { return static_cast<int>((word >> 32) & 0xff) + 1; }
inline int64_t left_of(uint64_t word) { return static_cast<int64_t>(word & 0xffffffffu); }
inline uint64_t make_word(uint32_t gen, int team, int64_t left) {
    return (static_cast<uint64_t>(gen & 0xffffff) << 40) | (static_cast<uint64_t>(team - 1) << 32) |
           static_cast<uint64_t>(left);
}

class Pool {
public:
    Pool() { pthread_atfork(nullptr, nullptr, [] { pool().after_fork(); }); }

    static Pool & pool() {
        static Pool * p = new Pool;  // never destroyed: its detached workers sleep on it until exit
        return *p;
    }

    void run(int threads, int64_t chunks, ChunkFn fn, void * ctx) {
        threads = std::min(threads, kMaxThreads);
        if (threads <= 1 || chunks <= 1 || chunks > 0xffffffff || busy_.exchange(true, std::memory_order_acquire)) {
            inline_regions_.fetch_add(1, std::memory_order_relaxed);
            for (int64_t c = 0; c < chunks; ++c) fn(ctx, c, 0);
            return;
        }
        start_workers(threads - 1);
        threads = std::min(threads, workers_ + 1);
        const Clock::time_point start = Clock::now();
        const int team = team_for(threads, start);
        if (team <= 1) {
            inline_regions_.fetch_add(1, std::memory_order_relaxed);
            for (int64_t c = 0; c < chunks; ++c) fn(ctx, c, 0);
            busy_.store(false, std::memory_order_release);
            return;
        }
        regions_.fetch_add(1, std::memory_order_relaxed);
        publish(fn, ctx, chunks, team);

        int64_t mine = 0;
        for (uint64_t w = word_.load(std::memory_order_relaxed); left_of(w) > 0;) {
            if (word_.compare_exchange_weak(w, w - 1, std::memory_order_acquire, std::memory_order_relaxed)) {
                fn(ctx, left_of(w) - 1, 0);
                done_.fetch_add(1, std::memory_order_acq_rel);
                ++mine;
                w = word_.load(std::memory_order_relaxed);
            }
        }
        const Clock::time_point claimed = Clock::now();
        wait_done(chunks);
        const Clock::time_point end = Clock::now();

        const auto piece = mine ? (claimed - start) / mine : Clock::duration::zero();
        const bool stalled = end - claimed > std::max<Clock::duration>(kStallWait, kStallPieces * piece);
        late_ = mine == chunks ? late_ + 1 : 0;
        window_ += end - start;
        if (stalled) stalled_ += end - claimed;
        if (window_ > kStallWindow) {  // the older half counts half
            window_ /= 2;
            stalled_ /= 2;
        }
        const bool costly = stalled && stalled_ > kStallShare * window_;
        if (stalled) stalls_.fetch_add(1, std::memory_order_relaxed);
        if (costly || late_ >= kLateRegions) shrink(team, end);
        busy_.store(false, std::memory_order_release);
    }

    ThreadPoolStats stats() const {
        ThreadPoolStats s;
        s.workers = num_workers_.load(std::memory_order_relaxed);
        s.team = team_now_.load(std::memory_order_relaxed);
        s.regions = regions_.load(std::memory_order_relaxed);
        s.inline_regions = inline_regions_.load(std::memory_order_relaxed);
        s.stalls = stalls_.load(std::memory_order_relaxed);
        s.shrinks = shrinks_.load(std::memory_order_relaxed);
        return s;
    }

private:
    // ---- the caller's side (only the thread holding busy_) ----

    // Up to n workers; where the OS will not start another, the team makes do with those it has.
    void start_workers(int n) {
        try {
            for (; workers_ < n; ++workers_) std::thread([this, i = workers_ + 1] { worker(i); }).detach();
        } catch (const std::system_error &) {
        }
        num_workers_.store(workers_, std::memory_order_relaxed);
    }

    // The team this region may use: the caller's threads, less what stalls took away until
    // the backoff after the last cut has passed.
    int team_for(int threads, Clock::time_point now) {
        if (team_ == 0 || team_ > threads) team_ = threads;
        if (team_ < threads && now >= grow_at_) {
            ++team_;
            grown_at_ = now;
            late_ = 0;
        }
        team_now_.store(team_, std::memory_order_relaxed);
        return team_;
    }

    void shrink(int team, Clock::time_point now) {
        shrinks_.fetch_add(1, std::memory_order_relaxed);
        window_ = stalled_ = Clock::duration::zero();  // the smaller team is judged afresh
        backoff_ = now - grown_at_ < kProbation ? std::min<Clock::duration>(2 * backoff_, kBackoffMax)
                                                 : Clock::duration(kBackoffMin);
        team_ = std::max(1, team - 1);
        team_now_.store(team_, std::memory_order_relaxed);
        grow_at_ = now + backoff_;
        late_ = 0;
    }

    void publish(ChunkFn fn, void * ctx, int64_t chunks, int team) {
        // written before the word: a worker's successful claim (acquire) sees them
        done_.store(0, std::memory_order_relaxed);
        fn_.store(fn, std::memory_order_relaxed);
        ctx_.store(ctx, std::memory_order_relaxed);
        chunks_.store(chunks, std::memory_order_relaxed);
        ++gen_;
        word_.store(make_word(gen_, team, chunks), std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            // a worker between its last look at word_ and its wait holds mu_: taking it orders the two
            { std::lock_guard<std::mutex> lock(mu_); }
            wake_.notify_all();
        }
    }

    void wait_done(int64_t chunks) {
        const Clock::time_point spin_end = Clock::now() + kCallerSpin;
        for (int i = 1; done_.load(std::memory_order_acquire) < chunks; ++i) {
            cpu_relax();
            if (i % 64 == 0 && Clock::now() > spin_end) {
                std::unique_lock<std::mutex> lock(done_mu_);
                caller_sleeping_.store(true, std::memory_order_seq_cst);
                while (done_.load(std::memory_order_seq_cst) < chunks) done_cv_.wait(lock);
                caller_sleeping_.store(false, std::memory_order_relaxed);
            }
        }
    }

    // ---- the workers' side ----

    void worker(int index) {
        uint32_t seen = gen_of(word_.load(std::memory_order_acquire));
        for (;;) {
            uint64_t w = wait_for_region(seen);
            seen = gen_of(w);
            while (index < team_of(w) && left_of(w) > 0) {
                if (!word_.compare_exchange_weak(w, w - 1, std::memory_order_acquire, std::memory_order_relaxed)) {
                    continue;
                }
                // this piece is ours and not done, so the region and its fields stay as they are
                const int64_t chunks = chunks_.load(std::memory_order_relaxed);
                const ChunkFn fn = fn_.load(std::memory_order_relaxed);
                void * ctx = ctx_.load(std::memory_order_relaxed);
                fn(ctx, left_of(w) - 1, index);
                if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == chunks &&
                    caller_sleeping_.load(std::memory_order_seq_cst)) {
                    { std::lock_guard<std::mutex> lock(done_mu_); }
                    done_cv_.notify_one();
                }
                w = word_.load(std::memory_order_relaxed);
            }
        }
    }

    // The claim word of the first region after generation `seen`: spin a while, then sleep.
    uint64_t wait_for_region(uint32_t seen) {
        const Clock::time_point spin_end = Clock::now() + kWorkerSpin;
        uint64_t w;
        for (int i = 1; gen_of(w = word_.load(std::memory_order_acquire)) == seen; ++i) {
            cpu_relax();
            if (i % 64 == 0 && Clock::now() > spin_end) {
                std::unique_lock<std::mutex> lock(mu_);
                sleepers_.fetch_add(1, std::memory_order_seq_cst);
                while (gen_of(w = word_.load(std::memory_order_seq_cst)) == seen) wake_.wait(lock);
                sleepers_.fetch_sub(1, std::memory_order_relaxed);
                break;
            }
        }
        return w;
    }

    // The child of a fork has the caller's thread only: start afresh (the parent's workers,
    // mutexes and flags are not its own).
    void after_fork() {
        new (&mu_) std::mutex;
        new (&wake_) std::condition_variable;
        new (&done_mu_) std::mutex;
        new (&done_cv_) std::condition_variable;
        workers_ = 0;
        num_workers_.store(0);
        sleepers_.store(0);
        caller_sleeping_.store(false);
        busy_.store(false);
    }

    std::atomic<bool> busy_{false};
    std::atomic<uint64_t> word_{0};
    std::atomic<int64_t> done_{0};
    std::atomic<ChunkFn> fn_{nullptr};
    std::atomic<void *> ctx_{nullptr};
    std::atomic<int64_t> chunks_{0};
    std::atomic<int> sleepers_{0};
    std::atomic<bool> caller_sleeping_{false};
    std::mutex mu_, done_mu_;
    std::condition_variable wake_, done_cv_;

    // the caller's (whoever holds busy_)
    uint32_t gen_ = 0;
    int workers_ = 0;
    int team_ = 0;
    int late_ = 0;
    Clock::time_point grow_at_{}, grown_at_{};
    Clock::duration window_{}, stalled_{};  // regions' time lately, and the stalls' waits in it
    Clock::duration backoff_{kBackoffMin};

    // what stats() reads from any thread
    std::atomic<int> num_workers_{0}, team_now_{0};
    std::atomic<int64_t> regions_{0}, inline_regions_{0}, stalls_{0}, shrinks_{0};
};

}  // namespace

void run_chunks(int threads, int64_t chunks, ChunkFn fn, void * ctx) { Pool::pool().run(threads, chunks, fn, ctx); }

ThreadPoolStats thread_pool_stats() { return Pool::pool().stats(); }

}  // namespace lmd::cpu
