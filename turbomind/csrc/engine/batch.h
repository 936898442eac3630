// One step's model inputs, built from what the scheduler decided (llama.cpp's llama_batch /
// ubatch): a row per scheduled token, each sequence's block table once, and which rows'
// logits are sampled, then which are read as prompt logprobs, then which verify drafted tokens;
// each row's LoRA adapter slot when any sequence of the step runs one.
// The buffers are kept and reused step after step.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/scheduler.h"
#include "models/llama.h"

namespace turbomind {

// What the engine reads of a scheduled sequence's rows besides its next token's (one per sequence
// of the step, in its order).
struct SeqRows {
    bool samples = true;                // false: a prefill-only request (max_new_tokens 0) samples nothing
    int64_t prompt_logprobs_from = -1;  // >= 0: the logits of the positions from there up to the prompt's
                                        // second-to-last (each scores the prompt token after it); -1: none
};

// Rows of the step whose logits are a sequence's prompt logprobs: positions first_position ..
// first_position + num_rows - 1 of out.seqs[seq], at logits rows first_logit_row, ... .
struct PromptRows {
    size_t seq = 0;
    int64_t first_position = 0;
    int64_t num_rows = 0;
    int64_t first_logit_row = 0;
};

class Batch {
public:
    // The inputs of the step `out` schedules; valid until the next build. Reads each sequence's
    // state before the step (num_computed_tokens not yet advanced: call before update()).
    // rows: per sequence of out (null: every one samples, none reads its prompt's rows).
    const StepInputs & build(const SchedulerOutput & out, int64_t block_size,
                             const std::vector<SeqRows> * rows = nullptr);

    // The sequences that caught up in this step and sample, in the order of their logits rows
    // (the first ones): each samples its next token from its row.
    const std::vector<Sequence *> & sampled() const { return sampled_; }
    // The prompt rows whose logits follow the sampled rows'.
    const std::vector<PromptRows> & prompt_rows() const { return prompt_rows_; }
    // Per sampled sequence (speculative decoding): the logits row after its draft's first token,
    // the next ones after the next drafts (after the prompt rows); -1: it has no draft.
    const std::vector<int64_t> & draft_rows() const { return draft_rows_; }

private:
    StepInputs inputs_;
    std::vector<int64_t> token_ids_, positions_, slots_, logit_rows_;
    std::vector<int32_t> row_seqs_, row_lens_;
    std::vector<int32_t> row_adapters_;  // filled only in a step where some sequence runs a LoRA adapter
    std::vector<int32_t> block_tables_;  // [num_seqs, max_blocks], zero padded
    std::vector<Sequence *> sampled_;
    std::vector<PromptRows> prompt_rows_;
    std::vector<int64_t> draft_rows_;
};

}  // namespace turbomind
