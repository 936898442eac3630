#include "cpu/ngram.h"

#include <algorithm>

namespace lmd::cpu {

std::vector<int32_t> ngram_propose(const int32_t * tokens, int64_t n, int min_n, int max_n, int k) {
    std::vector<int32_t> draft;
    if (k <= 0 || min_n < 1) return draft;
    for (int64_t m = std::min<int64_t>(max_n, n - 1); m >= min_n; --m) {
        const int32_t * suffix = tokens + n - m;
        // latest start i < n - m: the match must end before the suffix starts to be followed by a token
        for (int64_t i = n - m - 1; i >= 0; --i) {
            if (!std::equal(suffix, suffix + m, tokens + i)) continue;
            draft.reserve(k);
            for (int64_t j = 0; j < k; ++j) {
                const int64_t from = i + m + j;  // in tokens, or (past its end) in the draft written so far
                draft.push_back(from < n ? tokens[from] : draft[from - n]);
            }
            return draft;
        }
    }
    return draft;
}

}  // namespace lmd::cpu
