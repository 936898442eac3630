// Which sequences run in the next step, and how many of their tokens. The C++ twin of
// pytorch_backend/scheduler.py: the same queues, the same rule, the same decisions (tested
// against it step by step in tests/test_tm_scheduler.py).
//
// Policy only: the BlockManager owns the blocks, the batch builder and the model the tensors.
// The scheduler owns the queues: waiting (FIFO; preempted sequences go back to its front),
// running (in admission order) and idle (interactive sessions between turns, least recently
// used first, whose kept blocks are the first thing given up when blocks run short). It holds
// sequences by pointer; their owner (the engine) keeps them alive until finish(seq, false).
//
// Not thread-safe: the engine thread owns it.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <string>
#include <utility>
#include <vector>

#include "engine/block_manager.h"

namespace turbomind {

enum class SequenceStatus : int8_t {
    waiting,   // queued (new, or preempted and to be recomputed)
    running,   // scheduled: prefilling in chunks or decoding
    idle,      // an interactive session between turns: tokens (and maybe blocks) kept
    finished,  // done; its blocks are freed
};

// What the scheduler reads and writes of a sequence (pytorch_backend/sequence.py's fields of the
// same names). The engine's sequence extends it with what sampling and outputs need.
struct Sequence {
    int64_t session_id = 0;
    BlockSequence blocks;            // the whole context, computed count, blocks
    int64_t num_prompt_tokens = 0;   // the context before this turn's generation (earlier turns included)
    int64_t num_cached_tokens = 0;   // of those, what this turn found in the cache (prefix hit or kept session)
    SequenceStatus status = SequenceStatus::waiting;
    bool is_admitted = false;        // this turn was admitted once (num_cached_tokens is measured then)
    int64_t num_preemptions = 0;
    bool skip_reading_prefix_cache = false;  // admitted without a prefix match (its prompt rows are wanted)
    // speculative decoding: tokens drafted to follow the context, verified in this step with its
    // next token (set by the engine before schedule(), which may cut them; none outside a step)
    std::vector<int32_t> draft_token_ids;
    // the LoRA adapter its rows run (LlamaModel's slot; -1: the base model); its uid, which salts its
    // prefix-cache keys, is blocks.adapter_uid
    int32_t adapter_slot = -1;

    virtual ~Sequence() = default;
    int64_t num_tokens() const { return blocks.num_tokens(); }
    int64_t num_generated_tokens() const { return blocks.num_tokens() - num_prompt_tokens; }
    // An interactive session's next turn: its prompt follows the kept history.
    void start_turn(const std::vector<int32_t> & token_ids);
};

// All the batch builder gets for one step. Sequence i computes tokens
// [num_computed_tokens, num_computed_tokens + num_scheduled_tokens[i]) of its context (read from
// the sequence before update()).
struct SchedulerOutput {
    std::vector<Sequence *> seqs;
    std::vector<int64_t> num_scheduled_tokens;
    // preempted by this call (back in waiting, nothing computed), in the order they were
    std::vector<Sequence *> preempted;
    // cannot be served at all: out of the queues, blocks freed, status finished; the engine fails them
    std::vector<std::pair<Sequence *, std::string>> failed;

    bool empty() const { return seqs.empty(); }
};

class Scheduler {
public:
    Scheduler(BlockManager & block_manager, int64_t max_batch_size, int64_t max_num_batched_tokens);

    bool has_work() const { return !waiting_.empty() || !running_.empty(); }
    const std::deque<Sequence *> & waiting() const { return waiting_; }
    const std::vector<Sequence *> & running() const { return running_; }
    const std::list<Sequence *> & idle() const { return idle_; }
    int64_t num_preemptions() const { return num_preemptions_; }

    // A new sequence joins the end of the queue.
    void add(Sequence * seq);
    // An idle session's next turn (after seq->start_turn) joins the queue with whatever of its
    // cache it still holds.
    void resume(Sequence * seq);
    // The next step's sequences and token counts (the rule is at the top of scheduler.cc).
    SchedulerOutput schedule();
    // The step of out ran: its tokens are in the cache (full blocks join the prefix cache). A
    // drafted sequence's computed count stops at its context: its drafts wait for accept_draft.
    void update(const SchedulerOutput & out);
    // Speculative decoding, after update(): the first num_accepted of seq's drafts were right and
    // the engine has put them in its context; their K/V counts as computed, the blocks its
    // rejected drafts took are given back, its drafts are cleared.
    void accept_draft(Sequence * seq, int64_t num_accepted);
    // Take seq out of the queues; keep: an interactive session keeps its blocks, idle. Without
    // keep its blocks are freed and the scheduler forgets it.
    void finish(Sequence * seq, bool keep);

    // "" when the blocks add up, else what is wrong: the block manager's invariants over every
    // sequence holding blocks, and each holding exactly what its computed tokens need (between steps).
    std::string check_invariants() const;

private:
    void schedule_drafts(SchedulerOutput & out, int64_t & budget);
    void preempt(Sequence * seq);
    bool release_kept(const Sequence * but);

    BlockManager & blocks_;
    int64_t max_batch_size_;
    int64_t max_num_batched_tokens_;
    std::deque<Sequence *> waiting_;
    std::vector<Sequence *> running_;
    std::list<Sequence *> idle_;  // least recently used first
    int64_t num_preemptions_ = 0;
};

}  // namespace turbomind
