// Dispatch and threading of the CPU kernels: shape checks live in the bindings, the
// arithmetic in kernels_ref.cc / kernels_avx2.cc; this file splits the work across threads.
#include "cpu/kernels.h"
#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/cpu_features.h"

namespace lmd::cpu {

const char * isa_name(Isa level) {
    return level == Isa::avx512 ? "avx512" : level == Isa::avx2 ? "avx2" : "ref";
}

namespace {

std::atomic<int> g_num_threads{0};  // 0: one per processor

Isa detect_isa() {
    const cpu_features & f = cpu_features_get();
    if (!(f.avx2 && f.fma && f.f16c)) return Isa::ref;
    if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq) return Isa::avx512;
    return Isa::avx2;
}

bool parse_isa(const char * name, Isa & out) {
    if (name == nullptr || *name == '\0') {
        out = detect_isa();
        return true;
    }
    for (Isa level : {Isa::ref, Isa::avx2, Isa::avx512}) {
        if (std::strcmp(name, isa_name(level)) == 0) {
            out = level;
            return true;
        }
    }
    return false;
}

// The level in use, read by every dispatch: the environment's cap at start, then set_isa's.
std::atomic<int> & level_in_use() {
    static std::atomic<int> level{[] {
        Isa l = detect_isa();
        Isa capped;
        const char * env = std::getenv("LMD_CPU_ISA");
        if (!parse_isa(env, capped)) {
            std::fprintf(stderr, "lmd: LMD_CPU_ISA=%s is not one of ref, avx2, avx512: ignored (the kernels run %s)\n",
                         env, isa_name(l));
        } else if (capped > l) {
            std::fprintf(stderr, "lmd: LMD_CPU_ISA=%s is more than this CPU has: the kernels run %s\n", env,
                         isa_name(l));
        } else {
            l = capped;
        }
        return static_cast<int>(l);
    }()};
    return level;
}

}  // namespace

void set_num_threads(int n) { g_num_threads.store(n > 0 ? n : 0); }

int num_threads() {
    const int n = g_num_threads.load();
    return n > 0 ? n : cpu_features_get().num_procs;
}

Isa isa_supported() { return detect_isa(); }

Isa isa_level() { return static_cast<Isa>(level_in_use().load(std::memory_order_relaxed)); }

const char * isa() { return isa_name(isa_level()); }

bool set_isa(const char * name) {
    Isa level;
    if (!parse_isa(name, level) || level > detect_isa()) return false;
    level_in_use().store(static_cast<int>(level));
    return true;
}

bool use_avx512_vnni() { return isa_at_least(Isa::avx512) && cpu_features_get().avx512vnni; }

void linear(const TensorView & x, const TensorView & w, const TensorView * bias, const TensorView & y,
            bool reference) {
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    if (M == 0 || N == 0) return;
    // below ~64k multiply-adds a second thread costs more than it saves
    const int threads = static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, M * N * K >> 16)));
    if (reference || !isa_at_least(Isa::avx2)) {
        parallel(threads, [&](int t, int nt) {
            ref::linear_rows(x, w, bias, y, N * t / nt, N * (t + 1) / nt);
        });
        return;
    }
    const float * xf = x.ptr<float>();
    int64_t ldx = x.stride(0);
    std::vector<float> converted;
    if (x.dtype != DType::f32) {  // 16-bit activations: widen once, not once per weight row
        converted.resize(M * K);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < K; ++k) converted[m * K + k] = load_f32(x.data, m * ldx + k, x.dtype);
        xf = converted.data();
        ldx = K;
    }
    // runs of output columns (rows of w): w is read once in all
    constexpr int64_t kAlign = 12;  // whole tiles of 3 and of 4 rows
    parallel_ranges(threads, N, kAlign, [&](int64_t n0, int64_t n1) {
        avx2::linear_rows(xf, ldx, M, K, w, bias, y, n0, n1);
    });
}

namespace {

constexpr int64_t kMaxTilePairs = 64;  // attention_rows_task's (row, query head) pairs at most
constexpr int64_t kTilePairs = 8;      // what a tile of rows aims at: its keys and values read once for 8

// The float cache without a window: runs of consecutive query rows that read one table (a prefill
// chunk's rows; decode rows are runs of one) go to attention_rows_task together, rows * group <= 8
// pairs a task (the group query heads of a KV head always together). Each row's result is
// decode_attention_task's, bit for bit, whatever rows share its tile.
void attention_row_tiles(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                         const TensorView & block_tables, const int32_t * row_seqs, const TensorView & context_lens,
                         float scale, float softcap, const float * sinks, const TensorView & out, int64_t max_len) {
    const int64_t B = q.size(0), D = q.size(2), num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
    const int64_t group = q.size(1) / num_kv_heads, max_rows = std::max<int64_t>(1, kTilePairs / group);
    const int32_t * lens = context_lens.ptr<int32_t>();
    auto table_of = [&](int64_t b) {
        return block_tables.ptr<int32_t>() + (row_seqs ? row_seqs[b] : b) * block_tables.stride(0);
    };
    auto same_table = [&](int64_t a, int64_t b) {
        if (row_seqs) return row_seqs[a] == row_seqs[b];
        const int64_t blocks = (std::max(lens[a], lens[b]) + block_size - 1) / block_size;
        return std::equal(table_of(a), table_of(a) + blocks, table_of(b));
    };
    std::vector<int64_t> starts;  // tile i: rows [starts[i], starts[i + 1])
    for (int64_t b = 0; b < B;) {
        starts.push_back(b);
        const int64_t b0 = b++;
        while (b < B && b - b0 < max_rows && same_table(b0, b)) ++b;
    }
    starts.push_back(B);
    const int64_t tiles = static_cast<int64_t>(starts.size()) - 1, tasks = tiles * num_kv_heads;
    const int threads = static_cast<int>(std::min<int64_t>(num_threads(), tasks));
    std::vector<std::vector<float>> scratch(threads);
    parallel_pieces(threads, tasks, [&](int64_t task, int thread) {
        std::vector<float> & s = scratch[thread];
        if (s.empty()) s.resize(max_rows * group * (max_len + D));
        // the last tiles first: a prefill chunk's longest rows are its last, and left to the end they
        // would keep one thread busy while the other has nothing left
        const int64_t tile = tiles - 1 - task / num_kv_heads, h = task % num_kv_heads, b0 = starts[tile];
        TensorView table = block_tables;  // row b0's table, whatever row index reads it
        table.data = const_cast<int32_t *>(table_of(b0));
        table.strides[0] = 0;
        avx2::attention_rows_task(q, k_cache, v_cache, table, context_lens, scale, softcap, sinks, out, b0,
                                  starts[tile + 1] - b0, h, s.data());
    });
}

// row_seqs: the table row of each query row (null: row b reads table b). A task sees its own
// sequence's table as a one-row view with stride 0, so the tasks index it by b unchanged.
void paged_attention(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                     const TensorView & block_tables, const int32_t * row_seqs, const TensorView & context_lens,
                     float scale, float softcap, const float * sinks, const TensorView & out, const KVQuant * kv_quant,
                     bool reference, int64_t window) {
    const int64_t B = q.size(0), num_heads = q.size(1), num_kv_heads = k_cache.size(2);
    const int64_t group = num_heads / num_kv_heads;
    const int32_t * lens = context_lens.ptr<int32_t>();
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
    const bool vector = !reference && isa_at_least(Isa::avx2) && q.size(2) % 8 == 0 && q.size(2) <= 256;
    if (vector && !kv_quant && window == 0 && group <= kMaxTilePairs) {
        attention_row_tiles(q, k_cache, v_cache, block_tables, row_seqs, context_lens, scale, softcap, sinks, out, max_len);
        return;
    }
    const int64_t tasks = B * num_kv_heads;
    const int threads = static_cast<int>(std::min<int64_t>(num_threads(), tasks));
    std::vector<std::vector<float>> scratch(threads);  // [thread][group * max_len]
    parallel_pieces(threads, tasks, [&](int64_t task, int thread) {
        std::vector<float> & s = scratch[thread];
        if (s.empty()) s.resize(group * max_len);
        const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
        TensorView table = block_tables;
        if (row_seqs) {
            table.data = block_tables.ptr<int32_t>() + row_seqs[b] * block_tables.stride(0);
            table.strides[0] = 0;
        }
        if (vector && kv_quant) {
            avx2::decode_attention_quant_task(q, k_cache, v_cache, table, context_lens, scale, softcap, sinks, out,
                                              *kv_quant, b, first, h, s.data());
        } else if (vector) {
            avx2::decode_attention_task(q, k_cache, v_cache, table, context_lens, scale, softcap, sinks, out, b, first, h,
                                        s.data());
        } else {
            ref::decode_attention_task(q, k_cache, v_cache, table, context_lens, scale, softcap, sinks, out, kv_quant, b,
                                       first, h, s.data());
        }
    });
}

}  // namespace

void paged_decode_attention(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                            const TensorView & block_tables, const TensorView & context_lens, float scale,
                            const TensorView & out, const KVQuant * kv_quant, bool reference, int64_t window,
                            float softcap, const float * sinks) {
    paged_attention(q, k_cache, v_cache, block_tables, nullptr, context_lens, scale, softcap, sinks, out, kv_quant,
                    reference, window);
}

void paged_decode_attention(const TensorView & q, const TensorView & k_cache, const TensorView & v_cache,
                            const TensorView & block_tables, const TensorView & row_seqs,
                            const TensorView & context_lens, float scale, const TensorView & out,
                            const KVQuant * kv_quant, bool reference, int64_t window, float softcap,
                            const float * sinks) {
    paged_attention(q, k_cache, v_cache, block_tables, row_seqs.ptr<int32_t>(), context_lens, scale, softcap, sinks, out,
                    kv_quant, reference, window);
}

namespace {

// Rows split across threads when there are enough elements to pay for waking them.
template <typename Fn>
void for_rows(int64_t rows, int64_t elems_per_row, Fn && fn) {
    const int threads = static_cast<int>(std::min<int64_t>({num_threads(), rows, std::max<int64_t>(1, rows * elems_per_row >> 14)}));
    parallel(threads, [&](int t, int nt) {
        for (int64_t m = rows * t / nt; m < rows * (t + 1) / nt; ++m) fn(m);
    });
}

}  // namespace

void rms_norm(const TensorView & x, const TensorView & w, float eps, const TensorView & out,
              const TensorView * residual, bool reference) {
    const bool vector = !reference && isa_at_least(Isa::avx2);
    for_rows(x.size(0), x.size(1), [&](int64_t m) {
        if (vector) {
            avx2::rms_norm_row(x, w, eps, out, residual, m);
        } else {
            ref::rms_norm_row(x, w, eps, out, residual, m);
        }
    });
}

void rope_fill_kv(const TensorView & qkv, const TensorView & positions, const TensorView & cos_sin,
                  const TensorView & k_cache, const TensorView & v_cache, const TensorView & slots,
                  const TensorView & q_out, int64_t num_heads, int64_t num_kv_heads, const KVQuant * kv_quant,
                  bool reference) {
    // the AVX2 rows are the reference's bits (no fused multiply-add): ~5 us a token and layer scalar, 5% of a
    // 16-row SmolLM2 decode step
    const bool vector = !reference && isa_at_least(Isa::avx2) && q_out.size(2) <= 256;  // kMaxHeadDim (simd_avx2.h)
    for_rows(qkv.size(0), qkv.size(1), [&](int64_t t) {
        if (vector) {
            avx2::rope_fill_kv_row(qkv, positions, cos_sin, k_cache, v_cache, slots, q_out, num_heads, num_kv_heads,
                                   kv_quant, t);
        } else {
            ref::rope_fill_kv_row(qkv, positions, cos_sin, k_cache, v_cache, slots, q_out, num_heads, num_kv_heads,
                                  kv_quant, t);
        }
    });
}

void silu_and_mul(const TensorView & x, const TensorView & out, bool reference) {
    const bool vector = !reference && isa_at_least(Isa::avx2);
    for_rows(x.size(0), x.size(1), [&](int64_t m) {
        if (vector) {
            avx2::silu_and_mul_row(x, out, m);
        } else {
            ref::silu_and_mul_row(x, out, m);
        }
    });
}

void gelu_tanh_and_mul(const TensorView & x, const TensorView & out) {
    for_rows(x.size(0), x.size(1), [&](int64_t m) { ref::gelu_tanh_and_mul_row(x, out, m); });
}

}  // namespace lmd::cpu
