// The draft-model proposer; see draft.h for the shadows, the passes and the blocks.
#include "engine/draft.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

namespace turbomind {

DraftProposer::DraftProposer(std::shared_ptr<LlamaModel> model, int64_t max_num_batched_tokens)
    : model_(std::move(model)),
      max_num_batched_tokens_(max_num_batched_tokens),
      blocks_(static_cast<int32_t>(model_->num_blocks()), static_cast<int32_t>(model_->block_size()),
              /*enable_prefix_caching=*/false) {}

void DraftProposer::propose(std::vector<DraftRequest> & requests) {
    // the shadows that draft this step, and their requests
    std::vector<Sequence *> shadows;
    std::vector<DraftRequest *> owners;
    for (DraftRequest & r : requests) {
        r.draft->clear();
        const std::vector<int32_t> & tokens = *r.token_ids;
        const int64_t n = static_cast<int64_t>(tokens.size());
        if (n < 1 || r.num_draft_tokens < 1) continue;
        std::unique_ptr<Sequence> & slot = shadows_[r.session_id];
        if (!slot) {
            slot = std::make_unique<Sequence>();
            slot->session_id = r.session_id;
            slot->status = SequenceStatus::running;
        }
        BlockSequence & b = slot->blocks;
        // keep the longest run of computed tokens the sequence still has, its last token to compute
        const int64_t limit = std::min(b.num_computed_tokens, n - 1);
        int64_t keep = 0;
        while (keep < limit && b.token_ids[keep] == tokens[keep]) ++keep;
        b.num_computed_tokens = keep;
        b.token_ids.assign(tokens.begin(), tokens.end());
        blocks_.rollback(b, keep);
        // the whole step's blocks up front: the context and every draft but the last computed
        if (!blocks_.allocate(b, n + r.num_draft_tokens - 1)) {  // too few free: no draft this step
            ++num_skipped_;
            continue;
        }
        shadows.push_back(slot.get());
        owners.push_back(&r);
    }

    const int64_t vocab = model_->config().vocab_size;
    SchedulerOutput out;
    std::vector<size_t> who;  // per scheduled shadow of a pass: its index in shadows
    try {
        while (!shadows.empty()) {
            out.seqs.clear();
            out.num_scheduled_tokens.clear();
            who.clear();
            int64_t budget = max_num_batched_tokens_;
            for (size_t i = 0; i < shadows.size() && budget > 0; ++i) {
                const BlockSequence & b = shadows[i]->blocks;
                const int64_t n = std::min(b.num_tokens() - b.num_computed_tokens, budget);
                out.seqs.push_back(shadows[i]);
                out.num_scheduled_tokens.push_back(n);
                who.push_back(i);
                budget -= n;
            }
            const StepInputs & in = batch_.build(out, blocks_.block_size());
            logits_.resize(static_cast<size_t>(in.num_logit_rows * vocab));
            model_->forward(in, logits_.data());
            // a shadow whose chunk reached its last token has the next logits row (the batch's order)
            std::vector<uint8_t> done(shadows.size(), 0);
            const float * row = logits_.data();
            for (size_t s = 0; s < out.seqs.size(); ++s) {
                BlockSequence & b = out.seqs[s]->blocks;
                b.num_computed_tokens += out.num_scheduled_tokens[s];
                if (b.num_computed_tokens < b.num_tokens()) continue;  // a catch-up chunk goes on next pass
                const int32_t token = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
                row += vocab;
                DraftRequest & r = *owners[who[s]];
                r.draft->push_back(token);
                if (static_cast<int64_t>(r.draft->size()) == r.num_draft_tokens) {
                    done[who[s]] = 1;  // the last draft is never computed here
                } else {
                    b.token_ids.push_back(token);
                }
            }
            size_t kept = 0;
            for (size_t i = 0; i < shadows.size(); ++i) {
                if (done[i]) continue;
                shadows[kept] = shadows[i];
                owners[kept++] = owners[i];
            }
            shadows.resize(kept);
            owners.resize(kept);
        }
    } catch (const std::exception & e) {
        // the shadows mid-draft hold blocks past their computed tokens: drop them, and every draft
        for (DraftRequest & r : requests) {
            r.draft->clear();
            release(r.session_id);
        }
        throw std::runtime_error(std::string("the draft model failed: ") + e.what());
    }
}

void DraftProposer::retain(const std::vector<Sequence *> & running) {
    std::unordered_set<int64_t> alive;
    for (const Sequence * seq : running) alive.insert(seq->session_id);
    for (auto it = shadows_.begin(); it != shadows_.end();) {
        if (alive.count(it->first)) {
            ++it;
            continue;
        }
        blocks_.free(it->second->blocks);
        it = shadows_.erase(it);
    }
}

void DraftProposer::release(int64_t session_id) {
    auto it = shadows_.find(session_id);
    if (it == shadows_.end()) return;
    blocks_.free(it->second->blocks);
    shadows_.erase(it);
}

std::string DraftProposer::check_invariants() const {
    std::vector<const BlockSequence *> held;
    for (const auto & [sid, shadow] : shadows_) {
        const BlockSequence & b = shadow->blocks;
        const std::string who = "the draft model's shadow of session " + std::to_string(sid);
        if (b.num_computed_tokens > b.num_tokens()) {
            return who + " has " + std::to_string(b.num_computed_tokens) + " computed tokens of " +
                   std::to_string(b.num_tokens());
        }
        const int64_t need = blocks_.blocks_needed(b.num_computed_tokens);
        if (static_cast<int64_t>(b.block_ids.size()) != need) {
            return who + " holds " + std::to_string(b.block_ids.size()) + " blocks for its " +
                   std::to_string(b.num_computed_tokens) + " computed tokens, which need " + std::to_string(need);
        }
        held.push_back(&b);
    }
    std::string err = blocks_.check_invariants(&held);
    return err.empty() ? err : "the draft model's cache: " + err;
}

}  // namespace turbomind
