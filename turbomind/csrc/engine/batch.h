// One step's model inputs, built from what the scheduler decided (llama.cpp's llama_batch /
// ubatch): a row per scheduled token, each sequence's block table once, and which rows'
// logits are sampled. The buffers are kept and reused step after step.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/scheduler.h"
#include "models/llama.h"

namespace turbomind {

class Batch {
public:
    // The inputs of the step `out` schedules; valid until the next build. Reads each sequence's
    // state before the step (num_computed_tokens not yet advanced: call before update()).
    const StepInputs & build(const SchedulerOutput & out, int64_t block_size);

    // The sequences that caught up in this step, in the order of their logits rows: each
    // samples its next token from its row.
    const std::vector<Sequence *> & sampled() const { return sampled_; }

private:
    StepInputs inputs_;
    std::vector<int64_t> token_ids_, positions_, slots_, logit_rows_;
    std::vector<int32_t> row_seqs_, row_lens_;
    std::vector<int32_t> block_tables_;  // [num_seqs, max_blocks], zero padded
    std::vector<Sequence *> sampled_;
};

}  // namespace turbomind
