// Dispatch and threading of the latent attention (mla_attention.h): one piece per (query row, head).
#include "cpu/mla_attention.h"

#include <algorithm>
#include <vector>

#include "cpu/cpu_features.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace lmd::cpu {

void paged_latent_attention(const TensorView & q, const TensorView & cache, const TensorView & block_tables,
                            const int32_t * row_seqs, const TensorView & context_lens, float scale,
                            const TensorView & out, bool reference) {
    const int64_t B = q.size(0), num_heads = q.size(1), D = q.size(2), v_dim = out.size(2);
    const int32_t * lens = context_lens.ptr<int32_t>();
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
    const cpu_features & f = cpu_features_get();
    const bool vector = !reference && f.avx2 && f.fma && f.f16c && D % 8 == 0 && v_dim % 8 == 0;
    const int64_t tasks = B * num_heads;
    const int threads = static_cast<int>(std::min<int64_t>(num_threads(), tasks));
    // [thread][max_len scores | D floats: the scaled query, then the output's sums]
    std::vector<std::vector<float>> scratch(threads);
    parallel_pieces(threads, tasks, [&](int64_t task, int thread) {
        std::vector<float> & s = scratch[thread];
        if (s.empty()) s.resize(max_len + D);
        const int64_t b = task / num_heads, h = task % num_heads;
        const int32_t * table = block_tables.ptr<int32_t>() + (row_seqs ? row_seqs[b] : b) * block_tables.stride(0);
        if (vector) {
            avx2::latent_attention_task(q, cache, table, lens[b], scale, out, b, h, s.data(), s.data() + max_len);
        } else {
            ref::latent_attention_task(q, cache, table, lens[b], scale, out, b, h, s.data(), s.data() + max_len);
        }
    });
}

}  // namespace lmd::cpu
