// Prompt-lookup drafting for speculative decoding (vLLM's `ngram` proposer, llama.cpp's lookup
// decoding): the text a sequence is about to write is often text it has already seen (a document
// it rewrites, code it edits, a name it repeats). Both engines draft with this one function: the
// PyTorch engine through lmd.kernels.ops.ngram_propose, TurboMind's C++ engine directly.
#pragma once

#include <cstdint>
#include <vector>

namespace lmd::cpu {

// The longest suffix of tokens[0, n) of max_n down to min_n tokens that also occurs earlier, at its
// latest earlier occurrence i, drafts the up to k tokens that followed it: tokens[i + m], tokens[i + m + 1],
// ... (m the suffix length). A continuation that runs into the suffix's own tokens goes on through the
// draft itself, as an overlapping copy does (a run or a period repeats for all k). Empty when no suffix of
// at least min_n tokens occurred before, or k == 0.
std::vector<int32_t> ngram_propose(const int32_t * tokens, int64_t n, int min_n, int max_n, int k);

}  // namespace lmd::cpu
