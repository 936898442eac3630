#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>

namespace turbomind {

Engine::Engine(std::shared_ptr<LlamaModel> model, const EngineConfig & config,
               std::shared_ptr<ConstraintOps> constraint_ops)
    : model_(std::move(model)),
      config_(config),
      constraint_ops_(std::move(constraint_ops)),
      blocks_(config.num_blocks, config.block_size, config.enable_prefix_caching),
      sampler_(config.sampler_seed) {
    update_stats();
    thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { close(); }

// ---- the callers' side --------------------------------------------------------------------------

void Engine::add(Request request) {
    if (request.constraint && !constraint_ops_) {
        throw std::invalid_argument("this engine was built without constraint ops: no structured output");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) throw std::runtime_error("the engine is closed");
    inbox_.push_back(Message{Message::add, std::move(request), 0});
    inbox_cv_.notify_one();
}

void Engine::abort(int64_t session_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) return;  // close() aborts everything
    inbox_.push_back(Message{Message::abort, {}, session_id});
    inbox_cv_.notify_one();
}

void Engine::end(int64_t session_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) return;
    inbox_.push_back(Message{Message::end, {}, session_id});
    inbox_cv_.notify_one();
}

std::vector<Output> Engine::wait_outputs(double timeout_s) {
    std::unique_lock<std::mutex> lock(mutex_);
    outbox_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return !outbox_.empty() || stopped_; });
    std::vector<Output> out;
    out.swap(outbox_);
    return out;
}

EngineStats Engine::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
}

void Engine::close() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (closing_ && !thread_.joinable()) return;
        closing_ = true;
        inbox_cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
}

bool Engine::closed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stopped_;
}

// ---- the engine thread --------------------------------------------------------------------------

void Engine::loop() {
    for (;;) {
        std::vector<Message> inbox;
        bool closing;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            inbox_cv_.wait(lock, [this] { return !inbox_.empty() || closing_ || !waiting_.empty() || !running_.empty(); });
            inbox.swap(inbox_);
            closing = closing_;
        }
        for (Message & m : inbox) handle(m);
        if (closing) {
            // everything queued or running ends with abort; requests that arrived with close() too
            std::vector<Sequence *> pending(running_.begin(), running_.end());
            pending.insert(pending.end(), waiting_.begin(), waiting_.end());
            for (Sequence * seq : pending) finish(seq, Finish::abort);
            update_stats();
            std::vector<Message> late;  // destroyed after the lock is let go: a Constraint's destructor takes the GIL
            std::lock_guard<std::mutex> lock(mutex_);
            for (Message & m : inbox_) {
                if (m.kind == Message::add) {
                    Output o;
                    o.session_id = m.request.session_id;
                    o.finish = Finish::abort;
                    outbox_.push_back(std::move(o));
                }
            }
            late.swap(inbox_);
            stopped_ = true;
            outbox_cv_.notify_all();
            return;
        }
        bool progressed = true;
        if (!waiting_.empty() || !running_.empty()) {
            try {
                progressed = step();
            } catch (const std::exception & e) {
                // a failed step fails its requests; the loop goes on for everyone else
                std::vector<Sequence *> pending(running_.begin(), running_.end());
                for (Sequence * seq : pending) finish(seq, Finish::error, {}, {}, e.what());
            }
        }
        update_stats();
        if (!progressed) {  // nothing could run (the queue's head waits for blocks): wait for news
            std::unique_lock<std::mutex> lock(mutex_);
            inbox_cv_.wait_for(lock, std::chrono::milliseconds(10), [this] { return !inbox_.empty() || closing_; });
        }
    }
}

void Engine::handle(Message & m) {
    if (m.kind == Message::add) {
        on_add(m.request);
        return;
    }
    auto it = seqs_.find(m.session_id);
    if (it == seqs_.end()) return;
    Sequence * seq = it->second.get();
    if (m.kind == Message::end) seq->sequence_end = true;
    if (seq->status == Status::waiting || seq->status == Status::running) {
        finish(seq, Finish::abort);
    } else if (m.kind == Message::end) {
        finish(seq, Finish::none);  // a kept session is dropped silently
    }
}

void Engine::on_add(Request & r) {
    const int64_t sid = r.session_id;
    auto it = seqs_.find(sid);
    Sequence * seq = it == seqs_.end() ? nullptr : it->second.get();
    if (r.sequence_start || seq == nullptr) {
        if (seq != nullptr) finish(seq, Finish::none);  // a new session under a kept id replaces it
        if (!r.sequence_start) {  // ended between validation and now
            Output o;
            o.session_id = sid;
            o.finish = Finish::error;
            o.error = "session " + std::to_string(sid) + " was ended";
            emit(std::move(o));
            return;
        }
        num_prompt_tokens_ += static_cast<int64_t>(r.token_ids.size());
        auto fresh = std::make_unique<Sequence>();
        seq = fresh.get();
        seq->session_id = sid;
        seq->blocks.token_ids = std::move(r.token_ids);
        seqs_[sid] = std::move(fresh);
    } else {  // the next turn of a kept session
        idle_.remove(seq);
        num_prompt_tokens_ += static_cast<int64_t>(r.token_ids.size());
        seq->blocks.token_ids.insert(seq->blocks.token_ids.end(), r.token_ids.begin(), r.token_ids.end());
    }
    seq->num_prompt_tokens = seq->blocks.num_tokens();
    seq->num_cached_tokens = 0;
    seq->is_admitted = false;
    seq->max_new_tokens = r.max_new_tokens;
    seq->sampling = r.sampling;
    seq->sampling_state = std::make_unique<SamplingState>(seq->sampling, seq->blocks.token_ids.data(),
                                                          seq->blocks.num_tokens());
    seq->constraint = std::move(r.constraint);
    seq->sampling_state->constrained = seq->constraint != nullptr;
    seq->sequence_end = r.sequence_end;
    seq->status = Status::waiting;
    waiting_.push_back(seq);
    if (seq->max_new_tokens == 0) finish(seq, Finish::length);
}

// ---- scheduling ---------------------------------------------------------------------------------

Engine::Scheduled Engine::schedule() {
    Scheduled out;
    int64_t budget = config_.max_num_batched_tokens;
    bool preempted = false;

    size_t i = 0;
    while (i < running_.size() && budget > 0) {
        Sequence * seq = running_[i];
        const int64_t n = std::min(seq->blocks.num_tokens() - seq->blocks.num_computed_tokens, budget);
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
            preempted = true;
            if (victim == seq) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) break;  // nothing after it is left in running
        out.seqs.push_back(seq);
        out.counts.push_back(n);
        budget -= n;
        ++i;
    }

    while (!waiting_.empty() && !preempted && budget > 0 &&
           static_cast<int64_t>(running_.size()) < config_.max_batch_size) {
        Sequence * seq = waiting_.front();
        if (blocks_.blocks_needed(seq->blocks.num_tokens()) > blocks_.num_blocks()) {
            waiting_.pop_front();
            blocks_.free(seq->blocks);
            seq->status = Status::finished;
            out.failed.emplace_back(seq, "its " + std::to_string(seq->blocks.num_tokens()) +
                                             " tokens need more KV blocks than the cache has (" +
                                             std::to_string(blocks_.num_blocks()) + " blocks of " +
                                             std::to_string(blocks_.block_size()) + ")");
            continue;
        }
        PrefixMatch prefix;
        if (seq->blocks.block_ids.empty()) {  // admission from scratch: look in the prefix cache
            prefix = blocks_.match_prefix(seq->blocks.token_ids);
            seq->blocks.num_computed_tokens = prefix.num_cached_tokens;
        }
        const int64_t n = std::min(seq->blocks.num_tokens() - seq->blocks.num_computed_tokens, budget);
        bool ok = false;
        while (!(ok = blocks_.allocate(seq->blocks, seq->blocks.num_computed_tokens + n, prefix.block_ids))) {
            if (!release_kept(seq)) break;
        }
        if (!ok) {
            if (seq->blocks.block_ids.empty()) seq->blocks.num_computed_tokens = 0;
            break;  // FIFO: the head waits for blocks, nobody overtakes it
        }
        waiting_.pop_front();
        if (!seq->is_admitted) {  // first admission of this turn: what the cache saved it
            seq->is_admitted = true;
            seq->num_cached_tokens = std::min(seq->blocks.num_computed_tokens, seq->num_prompt_tokens);
        }
        seq->status = Status::running;
        running_.push_back(seq);
        out.seqs.push_back(seq);
        out.counts.push_back(n);
        budget -= n;
    }
    return out;
}

void Engine::preempt(Sequence * seq) {
    blocks_.free(seq->blocks);
    seq->blocks.num_computed_tokens = 0;
    seq->status = Status::waiting;
    waiting_.push_front(seq);
    ++num_preemptions_;
}

bool Engine::release_kept(Sequence * but) {
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

void Engine::dequeue(Sequence * seq) {
    switch (seq->status) {
        case Status::running: running_.erase(std::find(running_.begin(), running_.end(), seq)); break;
        case Status::waiting: waiting_.erase(std::find(waiting_.begin(), waiting_.end(), seq)); break;
        case Status::idle: idle_.remove(seq); break;
        case Status::finished: break;
    }
}

// ---- one step -----------------------------------------------------------------------------------

bool Engine::step() {
    Scheduled s = schedule();
    for (auto & [seq, why] : s.failed) finish(seq, Finish::error, {}, {}, "session " + std::to_string(seq->session_id) + ": " + why);
    if (s.seqs.empty()) return !s.failed.empty();

    const int64_t bs = config_.block_size;
    std::vector<int64_t> ids, positions, slots, logit_rows;
    std::vector<int32_t> lens;
    std::vector<Sequence *> sampled;
    int64_t max_blocks = 0;
    for (size_t i = 0; i < s.seqs.size(); ++i) {
        max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(s.seqs[i]->blocks.block_ids.size()));
    }
    std::vector<int32_t> tables;
    for (size_t i = 0; i < s.seqs.size(); ++i) {
        Sequence * seq = s.seqs[i];
        const BlockSequence & b = seq->blocks;
        const int64_t start = b.num_computed_tokens, end = start + s.counts[i];
        for (int64_t pos = start; pos < end; ++pos) {
            ids.push_back(b.token_ids[pos]);
            positions.push_back(pos);
            slots.push_back(static_cast<int64_t>(b.block_ids[pos / bs]) * bs + pos % bs);
            lens.push_back(static_cast<int32_t>(pos + 1));
            tables.insert(tables.end(), b.block_ids.begin(), b.block_ids.end());
            tables.resize(tables.size() + (max_blocks - b.block_ids.size()), 0);
        }
        if (end == b.num_tokens()) {  // caught up: its next token is sampled from this row
            logit_rows.push_back(static_cast<int64_t>(ids.size()) - 1);
            sampled.push_back(seq);
        }
    }
    StepInputs in;
    in.token_ids = ids.data();
    in.positions = positions.data();
    in.slots = slots.data();
    in.row_tables = tables.data();
    in.row_lens = lens.data();
    in.logit_rows = logit_rows.data();
    in.num_tokens = static_cast<int64_t>(ids.size());
    in.max_blocks = max_blocks;
    in.num_logit_rows = static_cast<int64_t>(logit_rows.size());
    const int64_t vocab = model_->config().vocab_size;
    logits_.resize(static_cast<size_t>(in.num_logit_rows * vocab));
    try {
        model_->forward(in, logits_.data());
    } catch (const std::exception & e) {
        for (Sequence * seq : s.seqs) finish(seq, Finish::error, {}, {}, e.what());
        return true;
    }
    for (size_t i = 0; i < s.seqs.size(); ++i) {  // their tokens are in the cache now
        s.seqs[i]->blocks.num_computed_tokens += s.counts[i];
        blocks_.cache_full_blocks(s.seqs[i]->blocks);
    }
    if (sampled.empty()) return true;
    std::vector<const SamplingState *> states;
    for (Sequence * seq : sampled) states.push_back(seq->sampling_state.get());
    const int64_t batch = static_cast<int64_t>(sampled.size());

    // structured output: the constrained rows' bitmasks, one call for all of them
    std::vector<size_t> con_rows;  // rows of sampled with a constraint
    for (size_t i = 0; i < sampled.size(); ++i) {
        if (sampled[i]->constraint) con_rows.push_back(i);
    }
    std::vector<const int32_t *> masks;  // per row: its bitmask or null
    std::vector<std::string> con_errors(sampled.size());
    if (!con_rows.empty()) {
        const int64_t words = (vocab + 31) / 32;
        std::vector<Constraint *> cs;
        for (size_t i : con_rows) cs.push_back(sampled[i]->constraint.get());
        std::vector<std::string> errors(cs.size());
        bitmask_.assign(cs.size() * words, -1);  // a row that fails stays all-allowed
        constraint_ops_->fill_bitmasks(cs.data(), static_cast<int64_t>(cs.size()), bitmask_.data(), words,
                                       errors.data());
        masks.assign(sampled.size(), nullptr);
        for (size_t j = 0; j < con_rows.size(); ++j) {
            masks[con_rows[j]] = bitmask_.data() + j * words;
            con_errors[con_rows[j]] = std::move(errors[j]);
        }
    }
    sampled_ids_.resize(sampled.size());
    sampler_.sample(logits_.data(), batch, vocab, vocab, states.data(), sampled_ids_.data(), &sampled_logprobs_,
                    masks.empty() ? nullptr : masks.data());

    // what ends each row, and the constrained rows' tokens to accept (again one call)
    std::vector<uint8_t> stops(sampled.size(), 0);
    std::vector<Constraint *> accepting;
    std::vector<int32_t> accepted_ids;
    std::vector<size_t> accepted_rows;
    for (size_t i = 0; i < sampled.size(); ++i) {
        Sequence * seq = sampled[i];
        const SamplingParams & sp = seq->sampling;
        const int32_t token = sampled_ids_[i];
        const bool is_stop = std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), token) != sp.stop_token_ids.end();
        // a grammar, not min_new_tokens, decides where a constrained answer ends
        stops[i] = is_stop && (seq->num_generated() >= sp.min_new_tokens || seq->constraint);
        if (seq->constraint && !stops[i] && con_errors[i].empty()) {
            accepting.push_back(seq->constraint.get());
            accepted_ids.push_back(token);
            accepted_rows.push_back(i);
        }
    }
    if (!accepting.empty()) {
        std::vector<std::string> errors(accepting.size());
        constraint_ops_->accept(accepting.data(), accepted_ids.data(), static_cast<int64_t>(accepting.size()),
                                errors.data());
        for (size_t j = 0; j < accepted_rows.size(); ++j) con_errors[accepted_rows[j]] = std::move(errors[j]);
    }

    for (size_t i = 0; i < sampled.size(); ++i) {
        Sequence * seq = sampled[i];
        const SamplingParams & sp = seq->sampling;
        const int32_t token = sampled_ids_[i];
        if (stops[i]) {
            finish(seq, Finish::stop);  // the stop token is neither output nor kept in the session
            continue;
        }
        if (!con_errors[i].empty()) {
            finish(seq, Finish::error, {}, {}, "session " + std::to_string(seq->session_id) + ": " + con_errors[i]);
            continue;
        }
        if (seq->constraint) {
            const std::vector<int32_t> & ends = seq->constraint->stop_token_ids;
            if (std::find(ends.begin(), ends.end(), token) != ends.end()) {
                finish(seq, Finish::stop);  // the grammar is complete (a stop token the request ignores)
                continue;
            }
        }
        seq->blocks.token_ids.push_back(token);
        seq->sampling_state->append(token);
        ++num_generated_tokens_;
        std::vector<std::vector<TokenLogprob>> lps;
        if (sp.logprobs >= 0) lps.push_back(std::move(sampled_logprobs_[i]));
        if (seq->num_generated() >= seq->max_new_tokens || seq->blocks.num_tokens() >= config_.session_len) {
            finish(seq, Finish::length, {token}, std::move(lps));
            continue;
        }
        Output o;
        o.session_id = seq->session_id;
        o.token_ids = {token};
        o.logprobs = std::move(lps);
        o.num_prompt_tokens = seq->num_prompt_tokens;
        o.num_cached_tokens = seq->num_cached_tokens;
        emit(std::move(o));
    }
    return true;
}

void Engine::finish(Sequence * seq, Finish reason, std::vector<int32_t> tokens,
                    std::vector<std::vector<TokenLogprob>> lps, std::string error) {
    const bool keep = !seq->sequence_end && (reason == Finish::stop || reason == Finish::length || reason == Finish::abort);
    dequeue(seq);
    const int64_t sid = seq->session_id;
    Output o;
    o.session_id = sid;
    o.token_ids = std::move(tokens);
    o.logprobs = std::move(lps);
    o.finish = reason;
    o.num_prompt_tokens = seq->num_prompt_tokens;
    o.num_cached_tokens = seq->num_cached_tokens;
    o.num_context_tokens = seq->blocks.num_tokens();
    o.kept = keep;
    o.error = std::move(error);
    if (keep) {
        seq->status = Status::idle;
        idle_.push_back(seq);
    } else {
        blocks_.free(seq->blocks);
        seq->status = Status::finished;
        seqs_.erase(sid);  // seq is gone from here on
    }
    if (reason != Finish::none) emit(std::move(o));
}

// Outputs of an iteration are published with its stats (update_stats), so a caller that saw
// a request's final output sees the blocks it returned.
void Engine::emit(Output out) { pending_.push_back(std::move(out)); }

void Engine::update_stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pending_.empty()) {
        for (Output & o : pending_) outbox_.push_back(std::move(o));
        pending_.clear();
        outbox_cv_.notify_all();
    }
    stats_.num_running = static_cast<int64_t>(running_.size());
    stats_.num_waiting = static_cast<int64_t>(waiting_.size());
    stats_.num_total_blocks = blocks_.num_blocks();
    stats_.num_free_blocks = blocks_.num_free_blocks();
    stats_.num_cached_blocks = blocks_.num_cached_blocks();
    stats_.num_prefix_hit_tokens = blocks_.num_prefix_hit_tokens();
    stats_.num_prefix_query_tokens = blocks_.num_prefix_query_tokens();
    stats_.num_preemptions = num_preemptions_;
    stats_.num_prompt_tokens = num_prompt_tokens_;
    stats_.num_generated_tokens = num_generated_tokens_;
}

}  // namespace turbomind
