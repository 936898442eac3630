#include "engine/batch.h"

#include <algorithm>

namespace turbomind {

const StepInputs & Batch::build(const SchedulerOutput & out, int64_t block_size) {
    token_ids_.clear();
    positions_.clear();
    slots_.clear();
    logit_rows_.clear();
    row_seqs_.clear();
    row_lens_.clear();
    sampled_.clear();

    const int64_t num_seqs = static_cast<int64_t>(out.seqs.size());
    int64_t max_blocks = 0;
    for (const Sequence * seq : out.seqs) {
        max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(seq->blocks.block_ids.size()));
    }
    block_tables_.assign(static_cast<size_t>(num_seqs * max_blocks), 0);

    for (int64_t s = 0; s < num_seqs; ++s) {
        Sequence * seq = out.seqs[s];
        const BlockSequence & b = seq->blocks;
        std::copy(b.block_ids.begin(), b.block_ids.end(), block_tables_.begin() + s * max_blocks);
        const int64_t start = b.num_computed_tokens, end = start + out.num_scheduled_tokens[s];
        for (int64_t pos = start; pos < end; ++pos) {
            token_ids_.push_back(b.token_ids[pos]);
            positions_.push_back(pos);
            slots_.push_back(static_cast<int64_t>(b.block_ids[pos / block_size]) * block_size + pos % block_size);
            row_seqs_.push_back(static_cast<int32_t>(s));
            row_lens_.push_back(static_cast<int32_t>(pos + 1));
        }
        if (end == b.num_tokens()) {  // caught up: its next token is sampled from this row
            logit_rows_.push_back(static_cast<int64_t>(token_ids_.size()) - 1);
            sampled_.push_back(seq);
        }
    }

    inputs_.token_ids = token_ids_.data();
    inputs_.positions = positions_.data();
    inputs_.slots = slots_.data();
    inputs_.row_seqs = row_seqs_.data();
    inputs_.row_lens = row_lens_.data();
    inputs_.block_tables = block_tables_.data();
    inputs_.logit_rows = logit_rows_.data();
    inputs_.num_tokens = static_cast<int64_t>(token_ids_.size());
    inputs_.num_seqs = num_seqs;
    inputs_.max_blocks = max_blocks;
    inputs_.num_logit_rows = static_cast<int64_t>(logit_rows_.size());
    return inputs_;
}

}  // namespace turbomind
