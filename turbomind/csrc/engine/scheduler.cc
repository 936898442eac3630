#include "engine/scheduler.h"

#include <algorithm>
#include <string>

namespace turbomind {

void Sequence::start_turn(const std::vector<int32_t> & token_ids) {
    blocks.token_ids.insert(blocks.token_ids.end(), token_ids.begin(), token_ids.end());
    num_prompt_tokens = blocks.num_tokens();
    num_cached_tokens = 0;
    is_admitted = false;
    status = SequenceStatus::waiting;
}

Scheduler::Scheduler(BlockManager & block_manager, int64_t max_batch_size, int64_t max_num_batched_tokens)
    : blocks_(block_manager), max_batch_size_(max_batch_size), max_num_batched_tokens_(max_num_batched_tokens) {}

void Scheduler::add(Sequence * seq) {
    seq->status = SequenceStatus::waiting;
    waiting_.push_back(seq);
}

void Scheduler::resume(Sequence * seq) {
    idle_.remove(seq);
    add(seq);
}

// The rule: every sequence has num_computed_tokens and num_tokens; a step gives each the tokens
// that let it catch up, within max_num_batched_tokens and max_batch_size.
//
// Running sequences first, oldest first (a decode needs 1 token, a chunked prefill the rest of
// its prompt); then waiting ones in FIFO order while the budget lasts. A sequence meets the
// prefix cache when it is admitted (not one that skips reading it, skip_reading_prefix_cache: its
// prompt logprobs need every row). When blocks run out, idle sessions give theirs up first,
// then the newest running sequence is preempted: its blocks are freed and it goes back to the
// front of the queue with nothing computed, to be recomputed (its generated tokens stay in its
// context). A preemption ends admissions for this step.
//
// Speculative decoding: the running sequences' draft_token_ids follow their contexts in the step,
// before any admission (as vLLM's spec tokens), with what budget and free blocks the running
// sequences' own tokens leave (schedule_drafts); a running sequence not scheduled loses its draft.
SchedulerOutput Scheduler::schedule() {
    SchedulerOutput out;
    int64_t budget = max_num_batched_tokens_;

    size_t i = 0;
    while (i < running_.size() && budget > 0) {
        Sequence * seq = running_[i];
        const int64_t n = std::min(seq->num_tokens() - seq->blocks.num_computed_tokens, budget);
        if (n <= 0) {
            ++i;
            continue;
        }
        bool self_preempted = false;
        while (!blocks_.allocate(seq->blocks, seq->blocks.num_computed_tokens + n)) {
            if (release_kept(nullptr)) continue;
            Sequence * victim = running_.back();  // newest
            running_.pop_back();
            preempt(victim);
            out.preempted.push_back(victim);
            if (victim == seq) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) break;  // nothing after it is left in running
        out.seqs.push_back(seq);
        out.num_scheduled_tokens.push_back(n);
        budget -= n;
        ++i;
    }
    for (size_t j = i; j < running_.size(); ++j) running_[j]->draft_token_ids.clear();  // not scheduled
    schedule_drafts(out, budget);

    while (!waiting_.empty() && out.preempted.empty() && budget > 0 &&
           static_cast<int64_t>(running_.size()) < max_batch_size_) {
        Sequence * seq = waiting_.front();
        if (blocks_.blocks_held(seq->num_tokens(), max_num_batched_tokens_) > blocks_.num_blocks()) {
            waiting_.pop_front();
            blocks_.free(seq->blocks);
            seq->status = SequenceStatus::finished;
            out.failed.emplace_back(seq, "its " + std::to_string(seq->num_tokens()) +
                                             " tokens need more KV blocks than the cache has (" +
                                             std::to_string(blocks_.num_blocks()) + " blocks of " +
                                             std::to_string(blocks_.block_size()) + ")");
            continue;
        }
        // a tentative admission: the prefix hit is written only once the blocks are had
        PrefixMatch prefix;
        int64_t num_computed = seq->blocks.num_computed_tokens;
        // admission from scratch: look in the prefix cache (unless the prompt's own rows are wanted)
        if (seq->blocks.block_ids.empty() && !seq->skip_reading_prefix_cache) {
            prefix = blocks_.match_prefix(seq->blocks.token_ids, seq->blocks.adapter_uid);
            num_computed = prefix.num_cached_tokens;
        }
        const int64_t n = std::min(seq->num_tokens() - num_computed, budget);
        bool ok = false;
        while (!(ok = blocks_.allocate(seq->blocks, num_computed + n, prefix.block_ids))) {
            if (!release_kept(seq)) break;
        }
        if (!ok) break;  // FIFO: the head waits for blocks, nobody overtakes it
        waiting_.pop_front();
        seq->blocks.num_computed_tokens = num_computed;
        if (!seq->is_admitted) {  // first admission of this turn: what the cache saved it
            seq->is_admitted = true;
            seq->num_cached_tokens = std::min(num_computed, seq->num_prompt_tokens);
        }
        seq->status = SequenceStatus::running;
        running_.push_back(seq);
        out.seqs.push_back(seq);
        out.num_scheduled_tokens.push_back(n);
        budget -= n;
    }
    return out;
}

// The drafts of the running sequences out schedules that catch up, oldest first: counted in the
// budget and given blocks, cut to what the budget leaves, and to the slots their blocks hold
// already when too few blocks are free (a draft, likely given back, never evicts a cached block
// nor preempts).
void Scheduler::schedule_drafts(SchedulerOutput & out, int64_t & budget) {
    for (size_t s = 0; s < out.seqs.size(); ++s) {
        Sequence * seq = out.seqs[s];
        std::vector<int32_t> & draft = seq->draft_token_ids;
        if (draft.empty()) continue;
        BlockSequence & b = seq->blocks;
        const int64_t end = b.num_computed_tokens + out.num_scheduled_tokens[s];
        int64_t n = end == b.num_tokens() ? std::min(static_cast<int64_t>(draft.size()), budget) : 0;
        if (n > 0 && !blocks_.allocate_free(b, end + n)) {
            n = std::min<int64_t>(n, static_cast<int64_t>(b.block_ids.size()) * blocks_.block_size() - end);
        }
        draft.resize(static_cast<size_t>(n));
        out.num_scheduled_tokens[s] += n;
        budget -= n;
    }
}

void Scheduler::update(const SchedulerOutput & out) {
    for (size_t i = 0; i < out.seqs.size(); ++i) {
        BlockSequence & b = out.seqs[i]->blocks;
        b.num_computed_tokens = std::min(b.num_computed_tokens + out.num_scheduled_tokens[i], b.num_tokens());
        blocks_.cache_full_blocks(b);
        blocks_.release_outside_window(b);
    }
}

void Scheduler::accept_draft(Sequence * seq, int64_t num_accepted) {
    BlockSequence & b = seq->blocks;
    num_accepted = std::clamp<int64_t>(num_accepted, 0, static_cast<int64_t>(seq->draft_token_ids.size()));
    b.num_computed_tokens = std::min(b.num_computed_tokens + num_accepted, b.num_tokens());
    seq->draft_token_ids.clear();
    blocks_.rollback(b, b.num_computed_tokens);  // the rejected drafts' K/V is never read again
    blocks_.cache_full_blocks(b);
    blocks_.release_outside_window(b);
}

void Scheduler::finish(Sequence * seq, bool keep) {
    switch (seq->status) {
        case SequenceStatus::running: running_.erase(std::find(running_.begin(), running_.end(), seq)); break;
        case SequenceStatus::waiting: waiting_.erase(std::find(waiting_.begin(), waiting_.end(), seq)); break;
        case SequenceStatus::idle: idle_.remove(seq); break;
        case SequenceStatus::finished: break;
    }
    if (keep) {
        seq->status = SequenceStatus::idle;
        idle_.push_back(seq);
    } else {
        blocks_.free(seq->blocks);
        seq->status = SequenceStatus::finished;
    }
}

void Scheduler::preempt(Sequence * seq) {
    seq->draft_token_ids.clear();
    blocks_.free(seq->blocks);
    seq->blocks.num_computed_tokens = 0;
    ++seq->num_preemptions;
    seq->status = SequenceStatus::waiting;
    waiting_.push_front(seq);
    ++num_preemptions_;
}

// Free the kept blocks of one sequence that is not running; false if none holds any. The least
// recently used idle session goes first, then a resumed session waiting behind `but` in the
// queue (newest first); either is recomputed when it runs.
bool Scheduler::release_kept(const Sequence * but) {
    Sequence * victim = nullptr;
    for (Sequence * s : idle_) {
        if (!s->blocks.block_ids.empty()) {
            victim = s;
            break;
        }
    }
    if (victim == nullptr) {
        for (auto it = waiting_.rbegin(); it != waiting_.rend(); ++it) {
            if (!(*it)->blocks.block_ids.empty() && *it != but) {
                victim = *it;
                break;
            }
        }
    }
    if (victim == nullptr) return false;
    blocks_.free(victim->blocks);
    victim->blocks.num_computed_tokens = 0;
    return true;
}

std::string Scheduler::check_invariants() const {
    std::vector<const Sequence *> seqs(running_.begin(), running_.end());
    seqs.insert(seqs.end(), waiting_.begin(), waiting_.end());
    seqs.insert(seqs.end(), idle_.begin(), idle_.end());
    std::vector<const BlockSequence *> held;
    for (const Sequence * seq : seqs) {
        const BlockSequence & b = seq->blocks;
        const std::string who = "session " + std::to_string(seq->session_id);
        if (!seq->draft_token_ids.empty()) return who + " keeps a draft between steps";
        if (b.num_computed_tokens > b.num_tokens()) {
            return who + " has " + std::to_string(b.num_computed_tokens) + " computed tokens of " +
                   std::to_string(b.num_tokens());
        }
        const int64_t need = blocks_.blocks_needed(b.num_computed_tokens);
        if (static_cast<int64_t>(b.block_ids.size()) != need) {
            return who + " holds " + std::to_string(b.block_ids.size()) + " blocks for its " +
                   std::to_string(b.num_computed_tokens) + " computed tokens, which need " + std::to_string(need);
        }
        if (static_cast<int64_t>(b.block_hashes.size()) > b.num_computed_tokens / blocks_.block_size()) {
            return who + " has prefix keys past its computed full blocks";
        }
        held.push_back(&b);
    }
    return blocks_.check_invariants(&held);
}

}  // namespace turbomind
