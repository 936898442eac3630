#include "engine/batch.h"

#include <algorithm>

namespace turbomind {

const StepInputs & Batch::build(const SchedulerOutput & out, int64_t block_size, const std::vector<SeqRows> * rows) {
    token_ids_.clear();
    positions_.clear();
    slots_.clear();
    logit_rows_.clear();
    row_seqs_.clear();
    row_lens_.clear();
    row_adapters_.clear();
    sampled_.clear();
    prompt_rows_.clear();
    std::vector<int64_t> prompt_logit_rows;  // the token rows of prompt_rows_, to follow the sampled ones
    draft_rows_.clear();
    std::vector<int64_t> draft_logit_rows;  // the drafts' token rows, to follow the prompt rows

    const int64_t num_seqs = static_cast<int64_t>(out.seqs.size());
    int64_t max_blocks = 0;
    bool adapters = false;
    for (const Sequence * seq : out.seqs) {
        max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(seq->blocks.block_ids.size()));
        adapters = adapters || seq->adapter_slot >= 0;
    }
    block_tables_.assign(static_cast<size_t>(num_seqs * max_blocks), 0);

    for (int64_t s = 0; s < num_seqs; ++s) {
        Sequence * seq = out.seqs[s];
        const BlockSequence & b = seq->blocks;
        std::copy(b.block_ids.begin(), b.block_ids.end(), block_tables_.begin() + s * max_blocks);
        const int64_t start = b.num_computed_tokens, end = start + out.num_scheduled_tokens[s];
        const int64_t num_draft = static_cast<int64_t>(seq->draft_token_ids.size());
        for (int64_t pos = start; pos < end; ++pos) {  // the context's tokens, then the draft's
            token_ids_.push_back(pos < b.num_tokens() ? b.token_ids[pos] : seq->draft_token_ids[pos - b.num_tokens()]);
            positions_.push_back(pos);
            slots_.push_back(static_cast<int64_t>(b.block_ids[pos / block_size]) * block_size + pos % block_size);
            row_seqs_.push_back(static_cast<int32_t>(s));
            row_lens_.push_back(static_cast<int32_t>(pos + 1));
            if (adapters) row_adapters_.push_back(seq->adapter_slot);
        }
        const SeqRows wants = rows ? (*rows)[s] : SeqRows{};
        if (wants.prompt_logprobs_from >= 0) {  // positions [first, last) score the prompt tokens after them
            const int64_t first = std::max(start, wants.prompt_logprobs_from);
            const int64_t last = std::min(end, seq->num_prompt_tokens - 1);
            if (first < last) {
                const int64_t row0 = static_cast<int64_t>(token_ids_.size()) - (end - start);
                prompt_rows_.push_back({static_cast<size_t>(s), first, last - first,
                                        static_cast<int64_t>(prompt_logit_rows.size())});
                for (int64_t pos = first; pos < last; ++pos) prompt_logit_rows.push_back(row0 + pos - start);
            }
        }
        // caught up: its next token is sampled from its context's last row, and each draft's row
        // verifies the token after that draft
        if (end == b.num_tokens() + num_draft && wants.samples) {
            const int64_t last = static_cast<int64_t>(token_ids_.size()) - 1 - num_draft;
            logit_rows_.push_back(last);
            sampled_.push_back(seq);
            draft_rows_.push_back(num_draft ? static_cast<int64_t>(draft_logit_rows.size()) : -1);
            for (int64_t d = 1; d <= num_draft; ++d) draft_logit_rows.push_back(last + d);
        }
    }
    for (PromptRows & p : prompt_rows_) p.first_logit_row += static_cast<int64_t>(logit_rows_.size());
    logit_rows_.insert(logit_rows_.end(), prompt_logit_rows.begin(), prompt_logit_rows.end());
    for (int64_t & r : draft_rows_) r += r >= 0 ? static_cast<int64_t>(logit_rows_.size()) : 0;
    logit_rows_.insert(logit_rows_.end(), draft_logit_rows.begin(), draft_logit_rows.end());

    inputs_.token_ids = token_ids_.data();
    inputs_.positions = positions_.data();
    inputs_.slots = slots_.data();
    inputs_.row_seqs = row_seqs_.data();
    inputs_.row_lens = row_lens_.data();
    inputs_.block_tables = block_tables_.data();
    inputs_.logit_rows = logit_rows_.data();
    inputs_.row_adapters = adapters ? row_adapters_.data() : nullptr;
    inputs_.num_tokens = static_cast<int64_t>(token_ids_.size());
    inputs_.num_seqs = num_seqs;
    inputs_.max_blocks = max_blocks;
    inputs_.num_logit_rows = static_cast<int64_t>(logit_rows_.size());
    return inputs_;
}

}  // namespace turbomind
