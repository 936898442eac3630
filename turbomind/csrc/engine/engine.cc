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
      blocks_(config.num_blocks, config.block_size, config.enable_prefix_caching, config.window),
      scheduler_(blocks_, config.max_batch_size, config.max_num_batched_tokens),
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

std::vector<Output> Engine::take_outputs() {
    outputs_ready_.clear();  // before the outbox: a step landing in between signals again
    std::vector<Output> out;
    std::lock_guard<std::mutex> lock(mutex_);
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
            inbox_cv_.wait(lock, [this] { return !inbox_.empty() || closing_ || scheduler_.has_work(); });
            inbox.swap(inbox_);
            closing = closing_;
        }
        for (Message & m : inbox) handle(m);
        if (closing) {
            abort_all();
            return;
        }
        bool progressed = true;
        if (scheduler_.has_work()) {
            try {
                progressed = step();
            } catch (const std::exception & e) {
                // a failed step fails its requests; the loop goes on for everyone else
                std::vector<Sequence *> running = scheduler_.running();
                for (Sequence * seq : running) finish(of(seq), Finish::error, {}, {}, e.what());
            }
        }
        update_stats();
        if (!progressed) {  // nothing could run (the queue's head waits for blocks): wait for news
            std::unique_lock<std::mutex> lock(mutex_);
            inbox_cv_.wait_for(lock, std::chrono::milliseconds(10), [this] { return !inbox_.empty() || closing_; });
        }
    }
}

// close(): everything queued or running ends with abort; requests that arrived with close() too.
void Engine::abort_all() {
    std::vector<Sequence *> pending(scheduler_.running().begin(), scheduler_.running().end());
    pending.insert(pending.end(), scheduler_.waiting().begin(), scheduler_.waiting().end());
    for (Sequence * seq : pending) finish(of(seq), Finish::abort);
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
    outputs_ready_.notify();
}

void Engine::handle(Message & m) {
    if (m.kind == Message::add) {
        on_add(m.request);
        return;
    }
    auto it = seqs_.find(m.session_id);
    if (it == seqs_.end()) return;
    EngineSequence * seq = it->second.get();
    if (m.kind == Message::end) seq->sequence_end = true;
    if (seq->status == SequenceStatus::waiting || seq->status == SequenceStatus::running) {
        finish(seq, Finish::abort);
    } else if (m.kind == Message::end) {
        finish(seq, Finish::none);  // a kept session is dropped silently
    }
}

void Engine::on_add(Request & r) {
    const int64_t sid = r.session_id;
    auto it = seqs_.find(sid);
    EngineSequence * seq = it == seqs_.end() ? nullptr : it->second.get();
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
        auto fresh = std::make_unique<EngineSequence>();
        seq = fresh.get();
        seq->session_id = sid;
        seq->blocks.token_ids = std::move(r.token_ids);
        seq->num_prompt_tokens = seq->num_tokens();
        seqs_[sid] = std::move(fresh);
        scheduler_.add(seq);
    } else {  // the next turn of a kept session
        num_prompt_tokens_ += static_cast<int64_t>(r.token_ids.size());
        seq->start_turn(r.token_ids);
        scheduler_.resume(seq);
    }
    seq->max_new_tokens = r.max_new_tokens;
    seq->sampling = r.sampling;
    seq->sampling_state = std::make_unique<SamplingState>(seq->sampling, seq->blocks.token_ids.data(),
                                                          seq->num_tokens());
    seq->constraint = std::move(r.constraint);
    seq->sampling_state->constrained = seq->constraint != nullptr;
    seq->sequence_end = r.sequence_end;
    if (seq->max_new_tokens == 0) finish(seq, Finish::length);
}

// ---- one step -----------------------------------------------------------------------------------

// False when nothing could run (the queue's head waits for blocks).
bool Engine::step() {
    SchedulerOutput out = scheduler_.schedule();
    for (auto & [seq, why] : out.failed) {
        finish(of(seq), Finish::error, {}, {}, "session " + std::to_string(seq->session_id) + ": " + why);
    }
    if (out.empty()) return !out.failed.empty();
    const StepInputs & in = batch_.build(out, config_.block_size);
    if (!forward(in, out)) return true;
    scheduler_.update(out);
    sample(batch_.sampled());
    emit_tokens(batch_.sampled());
    return true;
}

// Runs the model into logits_; a failure fails the step's sequences (false).
bool Engine::forward(const StepInputs & in, const SchedulerOutput & out) {
    logits_.resize(static_cast<size_t>(in.num_logit_rows * model_->config().vocab_size));
    try {
        model_->forward(in, logits_.data());
    } catch (const std::exception & e) {
        for (Sequence * seq : out.seqs) finish(of(seq), Finish::error, {}, {}, e.what());
        return false;
    }
    return true;
}

// Each row's next token from its logits (rows[i]: row i of logits_), and what that token means
// for it: stops_[i] (a stop token ends the turn), row_errors_[i] (its grammar failed). The
// constrained rows' grammars are asked for bitmasks before and take their tokens after, each
// time in one call for all of them.
void Engine::sample(const std::vector<Sequence *> & rows) {
    const size_t n = rows.size();
    const int64_t vocab = model_->config().vocab_size;
    row_errors_.assign(n, std::string());
    stops_.assign(n, 0);
    sampled_ids_.resize(n);
    if (n == 0) return;
    std::vector<const SamplingState *> states;
    for (Sequence * seq : rows) states.push_back(of(seq)->sampling_state.get());

    std::vector<size_t> con_rows;  // rows with a constraint
    for (size_t i = 0; i < n; ++i) {
        if (of(rows[i])->constraint) con_rows.push_back(i);
    }
    std::vector<const int32_t *> masks;  // per row: its bitmask or null
    if (!con_rows.empty()) {
        const int64_t words = (vocab + 31) / 32;
        std::vector<Constraint *> cs;
        for (size_t i : con_rows) cs.push_back(of(rows[i])->constraint.get());
        std::vector<std::string> errors(cs.size());
        bitmask_.assign(cs.size() * words, -1);  // a row that fails stays all-allowed
        constraint_ops_->fill_bitmasks(cs.data(), static_cast<int64_t>(cs.size()), bitmask_.data(), words,
                                       errors.data());
        masks.assign(n, nullptr);
        for (size_t j = 0; j < con_rows.size(); ++j) {
            masks[con_rows[j]] = bitmask_.data() + j * words;
            row_errors_[con_rows[j]] = std::move(errors[j]);
        }
    }
    sampler_.sample(logits_.data(), static_cast<int64_t>(n), vocab, vocab, states.data(), sampled_ids_.data(),
                    &sampled_logprobs_, masks.empty() ? nullptr : masks.data());

    std::vector<Constraint *> accepting;
    std::vector<int32_t> accepted_ids;
    std::vector<size_t> accepted_rows;
    for (size_t i = 0; i < n; ++i) {
        EngineSequence * seq = of(rows[i]);
        const SamplingParams & sp = seq->sampling;
        const int32_t token = sampled_ids_[i];
        const bool is_stop = std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), token) != sp.stop_token_ids.end();
        // a grammar, not min_new_tokens, decides where a constrained answer ends
        stops_[i] = is_stop && (seq->num_generated_tokens() >= sp.min_new_tokens || seq->constraint);
        if (seq->constraint && !stops_[i] && row_errors_[i].empty()) {
            accepting.push_back(seq->constraint.get());
            accepted_ids.push_back(token);
            accepted_rows.push_back(i);
        }
    }
    if (!accepting.empty()) {
        std::vector<std::string> errors(accepting.size());
        constraint_ops_->accept(accepting.data(), accepted_ids.data(), static_cast<int64_t>(accepting.size()),
                                errors.data());
        for (size_t j = 0; j < accepted_rows.size(); ++j) row_errors_[accepted_rows[j]] = std::move(errors[j]);
    }
}

// Each sampled row's token joins its context and goes out, or ends its turn.
void Engine::emit_tokens(const std::vector<Sequence *> & rows) {
    for (size_t i = 0; i < rows.size(); ++i) {
        EngineSequence * seq = of(rows[i]);
        const SamplingParams & sp = seq->sampling;
        const int32_t token = sampled_ids_[i];
        if (stops_[i]) {
            finish(seq, Finish::stop);  // the stop token is neither output nor kept in the session
            continue;
        }
        if (!row_errors_[i].empty()) {
            finish(seq, Finish::error, {}, {}, "session " + std::to_string(seq->session_id) + ": " + row_errors_[i]);
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
        if (seq->num_generated_tokens() >= seq->max_new_tokens || seq->num_tokens() >= config_.session_len) {
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
}

// Ends seq's turn (reason none: a kept session dropped silently); an interactive session stays
// kept, idle, with its blocks until the scheduler needs them.
void Engine::finish(EngineSequence * seq, Finish reason, std::vector<int32_t> tokens,
                    std::vector<std::vector<TokenLogprob>> lps, std::string error) {
    const bool keep = !seq->sequence_end && (reason == Finish::stop || reason == Finish::length || reason == Finish::abort);
    scheduler_.finish(seq, keep);
    const int64_t sid = seq->session_id;
    Output o;
    o.session_id = sid;
    o.token_ids = std::move(tokens);
    o.logprobs = std::move(lps);
    o.finish = reason;
    o.num_prompt_tokens = seq->num_prompt_tokens;
    o.num_cached_tokens = seq->num_cached_tokens;
    o.num_context_tokens = seq->num_tokens();
    o.kept = keep;
    o.error = std::move(error);
    if (!keep) seqs_.erase(sid);  // seq is gone from here on
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
        outputs_ready_.notify();
    }
    stats_.num_running = static_cast<int64_t>(scheduler_.running().size());
    stats_.num_waiting = static_cast<int64_t>(scheduler_.waiting().size());
    stats_.num_total_blocks = blocks_.num_blocks();
    stats_.num_free_blocks = blocks_.num_free_blocks();
    stats_.num_cached_blocks = blocks_.num_cached_blocks();
    stats_.num_prefix_hit_tokens = blocks_.num_prefix_hit_tokens();
    stats_.num_prefix_query_tokens = blocks_.num_prefix_query_tokens();
    stats_.num_preemptions = scheduler_.num_preemptions();
    stats_.num_prompt_tokens = num_prompt_tokens_;
    stats_.num_generated_tokens = num_generated_tokens_;
}

}  // namespace turbomind
