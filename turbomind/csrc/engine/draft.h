// Speculative decoding's draft-model proposer (vLLM's `draft_model`, LMDeploy's `draft_target`): a
// second LlamaModel sharing the target's vocabulary (a smaller model, or the same one in a cheaper
// format) drafts each decoding sequence's next k tokens greedily. The engine verifies them exactly as
// it verifies n-gram drafts (engine.h): the proposer only decides what the draft says.
//
// The draft model has a paged KV cache of its own (LlamaModel owns its memory) and a BlockManager of
// its own over it, without a prefix cache. Each drafted sequence has a shadow there (a Sequence: its
// tokens, computed count and blocks in the draft cache), keyed by session id. Before drafting, the
// shadow keeps the longest run of its computed tokens that the sequence still has (what it drafted and
// the target rejected goes, and the blocks past it), always leaving the last one to compute, whose
// logits give the first draft token. A shadow's K/V depends on nothing but its tokens (the draft runs
// no LoRA adapter), so a prefix that matches is right whoever computed it.
//
// One propose() call runs every drafting sequence together: each forward pass holds, per shadow, the
// tokens it has yet to compute (its catch-up chunk, then one row per draft position), one StepInputs
// built by a Batch as the engine's are; a pass takes at most max_num_batched_tokens rows and a
// catch-up longer than what is left waits for the next pass. A shadow whose chunk reaches its last
// token reads that row's logits: the argmax is its next draft token (ties to the lowest id). In the
// usual step (every shadow one or two tokens behind) that is one pass per draft position for all.
//
// Blocks: a shadow takes the blocks for its whole step (context + k - 1 drafts computed) before any
// pass; where too few are free it drafts nothing this step (never an error, never an eviction). Between
// steps a shadow holds exactly the blocks its computed tokens need. Shadows of sequences no longer
// running go (retain, release), so after all requests end the draft cache is all free.
//
// Not thread-safe: the engine thread owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/batch.h"
#include "engine/block_manager.h"
#include "engine/scheduler.h"
#include "models/llama.h"

namespace turbomind {

// One sequence to draft for: its context (token_ids[0, n)) and how many tokens to draft (k >= 1).
struct DraftRequest {
    int64_t session_id = 0;
    const std::vector<int32_t> * token_ids = nullptr;
    int64_t num_draft_tokens = 0;
    std::vector<int32_t> * draft = nullptr;  // written: the draft (empty: none this step)
};

class DraftProposer {
public:
    // model: the draft model, its cache's blocks all the proposer's (model->num_blocks() of
    // model->block_size()); max_num_batched_tokens: the most rows of one pass.
    DraftProposer(std::shared_ptr<LlamaModel> model, int64_t max_num_batched_tokens);

    // Drafts for every request, batched (see above); each request's session id once.
    void propose(std::vector<DraftRequest> & requests);
    // Free the shadows of sessions not in running (sequences preempted or finished since).
    void retain(const std::vector<Sequence *> & running);
    // Free session_id's shadow, if it has one (its sequence finished).
    void release(int64_t session_id);

    int64_t num_shadows() const { return static_cast<int64_t>(shadows_.size()); }
    int64_t num_skipped() const { return num_skipped_; }  // drafts not made for want of free blocks, all time
    const BlockManager & blocks() const { return blocks_; }
    const LlamaModel & model() const { return *model_; }
    // "" when the draft cache's blocks add up (between steps), else what is wrong.
    std::string check_invariants() const;

private:
    std::shared_ptr<LlamaModel> model_;
    int64_t max_num_batched_tokens_;
    BlockManager blocks_;
    Batch batch_;
    std::unordered_map<int64_t, std::unique_ptr<Sequence>> shadows_;
    std::vector<float> logits_;  // [shadows caught up in a pass, vocab]
    int64_t num_skipped_ = 0;
};

}  // namespace turbomind
