#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>

#include "cpu/ngram.h"

namespace turbomind {

Engine::Engine(std::shared_ptr<LlamaModel> model, const EngineConfig & config,
               std::shared_ptr<ConstraintOps> constraint_ops, std::shared_ptr<LlamaModel> draft_model)
    : model_(std::move(model)),
      config_(config),
      constraint_ops_(std::move(constraint_ops)),
      blocks_(config.num_blocks, config.block_size, config.enable_prefix_caching, config.window),
      scheduler_(blocks_, config.max_batch_size, config.max_num_batched_tokens),
      sampler_(config.sampler_seed),
      draft_length_(std::max(1, config.num_speculative_tokens)) {
    if (draft_model) {
        if (draft_model->config().vocab_size != model_->config().vocab_size) {
            throw std::invalid_argument("Engine: the draft model's vocabulary has " +
                                        std::to_string(draft_model->config().vocab_size) + " tokens, the model's " +
                                        std::to_string(model_->config().vocab_size));
        }
        drafter_ = std::make_unique<DraftProposer>(std::move(draft_model), config.max_num_batched_tokens);
    }
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

std::string Engine::blocks_error() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return blocks_error_;
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
            if (check_blocks_ && blocks_error_.empty()) {
                std::string err = scheduler_.check_invariants();
                if (err.empty() && drafter_) err = drafter_->check_invariants();
                std::lock_guard<std::mutex> lock(mutex_);
                blocks_error_ = std::move(err);
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
        seq->adapter_slot = r.adapter_slot;
        seq->blocks.adapter_uid = r.adapter_uid;
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
    // prompt logprobs are read from the request's own prefill: no prefix hit for it
    seq->wants_prompt_logprobs = seq->sampling.prompt_logprobs >= 0;
    seq->skip_reading_prefix_cache = seq->wants_prompt_logprobs;
    seq->prompt_logprobs.clear();
    // with prompt logprobs it is prefilled first (step)
    if (seq->max_new_tokens == 0 && !seq->wants_prompt_logprobs) finish(seq, Finish::length);
}

// ---- one step -----------------------------------------------------------------------------------

// False when nothing could run (the queue's head waits for blocks).
bool Engine::step() {
    const auto start = std::chrono::steady_clock::now();
    propose_drafts();
    SchedulerOutput out = scheduler_.schedule();
    for (auto & [seq, why] : out.failed) {
        finish(of(seq), Finish::error, {}, {}, "session " + std::to_string(seq->session_id) + ": " + why);
    }
    if (out.empty()) return !out.failed.empty();
    // a decode-only step (every row a sequence's next token or one of its drafts) teaches the draft
    // lengths what a row costs: its rows counted here, as scheduled (a sequence may finish, and go, within it)
    int64_t decode_rows = 0;
    for (Sequence * seq : out.seqs) {  // the drafts as scheduled
        spec_num_drafts_ += !seq->draft_token_ids.empty();
        spec_num_draft_tokens_ += static_cast<int64_t>(seq->draft_token_ids.size());
        decode_rows += 1 + static_cast<int64_t>(seq->draft_token_ids.size());
    }
    seq_rows_.resize(out.seqs.size());
    for (size_t i = 0; i < out.seqs.size(); ++i) {
        const EngineSequence * seq = of(out.seqs[i]);
        seq_rows_[i].samples = seq->max_new_tokens > 0;
        seq_rows_[i].prompt_logprobs_from = seq->wants_prompt_logprobs ? (int64_t) seq->prompt_logprobs.size() : -1;
    }
    const StepInputs & in = batch_.build(out, config_.block_size, &seq_rows_);
    const bool decode_only = decode_rows == in.num_tokens;
    if (!forward(in, out)) return true;
    scheduler_.update(out);
    read_prompt_logprobs(out);
    for (Sequence * s : out.seqs) {  // a prefill-only request is done once its prompt is in
        EngineSequence * seq = of(s);
        if (seq->max_new_tokens == 0 && seq->blocks.num_computed_tokens == seq->num_tokens()) {
            finish(seq, Finish::length);
        }
    }
    verify(batch_.sampled());
    if (config_.num_speculative_tokens > 0 && decode_only) {
        draft_length_.observe_step(decode_rows,
                                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return true;
}

// Before scheduling (speculative decoding): each decoding sequence's draft, no longer than its
// limits leave (all of it accepted, it ends exactly at a limit): prompt lookup in its own context, or
// the draft model's greedy continuation, every drafting sequence at once (draft.h).
void Engine::propose_drafts() {
    if (config_.num_speculative_tokens <= 0) return;
    if (drafter_) drafter_->retain(scheduler_.running());
    std::vector<DraftRequest> requests;
    int64_t num_decoding = 0;
    for (Sequence * s : scheduler_.running()) num_decoding += s->num_tokens() - s->blocks.num_computed_tokens == 1;
    for (Sequence * s : scheduler_.running()) {
        EngineSequence * seq = of(s);
        const int64_t n = seq->num_tokens();
        if (n - seq->blocks.num_computed_tokens != 1) continue;  // still prefilling
        int64_t k = std::min({static_cast<int64_t>(config_.num_speculative_tokens),
                              seq->max_new_tokens - seq->num_generated_tokens() - 1, config_.session_len - n - 1});
        if (config_.adaptive_draft_length) {
            seq->draft_acceptance.decay();
            k = draft_length_.length(seq->draft_acceptance, num_decoding, k);
        }
        if (k <= 0) continue;
        if (drafter_) {
            requests.push_back({seq->session_id, &seq->blocks.token_ids, k, &seq->draft_token_ids});
            continue;
        }
        seq->draft_token_ids = lmd::cpu::ngram_propose(seq->blocks.token_ids.data(), n, config_.prompt_lookup_min,
                                                       config_.prompt_lookup_max, static_cast<int>(k));
    }
    if (!requests.empty()) drafter_->propose(requests);
}

// The sampled sequences' tokens, in rounds: round 0 takes each one's next token from its first
// row (batch order: the first rows of logits_); round j the token after draft j - 1, from that
// draft's row, for those whose tokens so far were their drafts. A round samples all its rows in
// one call (the grammars asked once). Then each sequence commits its draft and its step's tokens
// go out together.
void Engine::verify(const std::vector<Sequence *> & sampled) {
    const int64_t vocab = model_->config().vocab_size;
    std::vector<Sequence *> rows(sampled), next, settled;
    std::vector<int64_t> draft_rows(batch_.draft_rows()), next_draft_rows;  // per row: its first draft's row
    const float * logits = logits_.data();
    for (size_t j = 0; !rows.empty(); ++j) {
        sample(rows, logits);
        emit_tokens(rows);
        next.clear();
        next_draft_rows.clear();
        for (size_t i = 0; i < rows.size(); ++i) {
            if (!going_[i]) continue;  // its turn ended (finish): it is gone
            EngineSequence * seq = of(rows[i]);
            const std::vector<int32_t> & draft = seq->draft_token_ids;
            if (j < draft.size() && sampled_ids_[i] == draft[j]) {
                ++seq->num_accepted_drafts;
                next.push_back(seq);
                next_draft_rows.push_back(draft_rows[i]);
            } else {
                settled.push_back(seq);
            }
        }
        rows.swap(next);
        draft_rows.swap(next_draft_rows);
        draft_logits_.resize(rows.size() * vocab);
        for (size_t i = 0; i < rows.size(); ++i) {  // round j + 1 reads the row after draft j
            const float * row = logits_.data() + (draft_rows[i] + static_cast<int64_t>(j)) * vocab;
            std::copy(row, row + vocab, draft_logits_.data() + i * vocab);
        }
        logits = draft_logits_.data();
    }
    for (Sequence * s : settled) {
        EngineSequence * seq = of(s);
        commit_draft(seq);
        emit_step_tokens(seq);
    }
}

// A drafted sequence's accepted drafts count as computed, the blocks of the rest go back.
void Engine::commit_draft(EngineSequence * seq) {
    if (seq->draft_token_ids.empty()) return;
    seq->draft_acceptance.observe(static_cast<int64_t>(seq->draft_token_ids.size()), seq->num_accepted_drafts);
    spec_num_accepted_tokens_ += seq->num_accepted_drafts;
    scheduler_.accept_draft(seq, seq->num_accepted_drafts);
    seq->num_accepted_drafts = 0;
}

// A sequence's tokens of this step in one output (with its prompt logprobs, the first time).
void Engine::emit_step_tokens(EngineSequence * seq) {
    if (seq->step_token_ids.empty()) return;
    Output o;
    o.session_id = seq->session_id;
    o.token_ids = std::move(seq->step_token_ids);
    o.logprobs = std::move(seq->step_logprobs);
    seq->step_token_ids.clear();
    seq->step_logprobs.clear();
    o.num_prompt_tokens = seq->num_prompt_tokens;
    o.num_cached_tokens = seq->num_cached_tokens;
    take_prompt_logprobs(seq, o);
    emit(std::move(o));
}

// The step's prompt rows (after the sampled rows in logits_) into their sequences' prompt logprobs.
void Engine::read_prompt_logprobs(const SchedulerOutput & out) {
    const int64_t vocab = model_->config().vocab_size;
    std::vector<int32_t> tokens;
    for (const PromptRows & pr : batch_.prompt_rows()) {
        EngineSequence * seq = of(out.seqs[pr.seq]);
        std::vector<std::vector<TokenLogprob>> & lps = seq->prompt_logprobs;
        if (pr.first_position != (int64_t) lps.size()) {  // a bug: fails the step (loop)
            throw std::logic_error("session " + std::to_string(seq->session_id) + ": prompt rows " +
                                   std::to_string(lps.size()) + ".." + std::to_string(pr.first_position) +
                                   " were never computed (a prefix hit on a request that wants prompt logprobs?)");
        }
        const int32_t * next = seq->blocks.token_ids.data() + pr.first_position + 1;
        tokens.assign(next, next + pr.num_rows);
        lps.resize(lps.size() + pr.num_rows);
        Sampler::token_logprobs(logits_.data() + pr.first_logit_row * vocab, pr.num_rows, vocab, vocab, tokens.data(),
                                seq->sampling.prompt_logprobs, lps.data() + pr.first_position);
        if ((int64_t) lps.size() == seq->num_prompt_tokens - 1) {
            seq->skip_reading_prefix_cache = false;  // all read: the cache may serve a recompute again
        }
    }
}

// The prompt logprobs go out once, with the request's first output after they are all read.
void Engine::take_prompt_logprobs(EngineSequence * seq, Output & o) {
    if (!seq->wants_prompt_logprobs || (int64_t) seq->prompt_logprobs.size() < seq->num_prompt_tokens - 1) return;
    o.has_prompt_logprobs = true;
    o.prompt_logprobs = std::move(seq->prompt_logprobs);
    seq->prompt_logprobs.clear();
    seq->wants_prompt_logprobs = false;
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

// Each row's next token from its logits (rows[i]: row i of logits), and what that token means
// for it: stops_[i] (a stop token ends the turn), row_errors_[i] (its grammar failed). The
// constrained rows' grammars are asked for bitmasks before and take their tokens after, each
// time in one call for all of them.
void Engine::sample(const std::vector<Sequence *> & rows, const float * logits) {
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
    sampler_.sample(logits, static_cast<int64_t>(n), vocab, vocab, states.data(), sampled_ids_.data(),
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

// Each sampled row's token joins its context (going_[i]; out with the step's other tokens,
// emit_step_tokens), or ends its turn.
void Engine::emit_tokens(const std::vector<Sequence *> & rows) {
    going_.assign(rows.size(), 0);
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
        seq->step_token_ids.push_back(token);
        if (sp.logprobs >= 0) seq->step_logprobs.push_back(std::move(sampled_logprobs_[i]));
        if (seq->num_generated_tokens() >= seq->max_new_tokens || seq->num_tokens() >= config_.session_len) {
            finish(seq, Finish::length);
            continue;
        }
        going_[i] = 1;
    }
}

// Ends seq's turn (reason none: a kept session dropped silently); an interactive session stays
// kept, idle, with its blocks until the scheduler needs them.
void Engine::finish(EngineSequence * seq, Finish reason, std::vector<int32_t> tokens,
                    std::vector<std::vector<TokenLogprob>> lps, std::string error) {
    const bool keep = !seq->sequence_end && (reason == Finish::stop || reason == Finish::length || reason == Finish::abort);
    commit_draft(seq);  // a kept session keeps what its accepted drafts computed
    scheduler_.finish(seq, keep);
    if (drafter_) drafter_->release(seq->session_id);  // a kept session's next turn catches up afresh
    const int64_t sid = seq->session_id;
    Output o;
    o.session_id = sid;
    o.token_ids = std::move(seq->step_token_ids);  // this step's tokens before it ended
    o.token_ids.insert(o.token_ids.end(), tokens.begin(), tokens.end());
    o.logprobs = std::move(seq->step_logprobs);
    for (auto & lp : lps) o.logprobs.push_back(std::move(lp));
    o.finish = reason;
    o.num_prompt_tokens = seq->num_prompt_tokens;
    o.num_cached_tokens = seq->num_cached_tokens;
    o.num_context_tokens = seq->num_tokens();
    o.kept = keep;
    o.error = std::move(error);
    take_prompt_logprobs(seq, o);
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
    stats_.spec_num_drafts = spec_num_drafts_;
    stats_.spec_num_draft_tokens = spec_num_draft_tokens_;
    stats_.spec_num_accepted_tokens = spec_num_accepted_tokens_;
    if (drafter_) {
        stats_.draft_num_total_blocks = drafter_->blocks().num_blocks();
        stats_.draft_num_free_blocks = drafter_->blocks().num_free_blocks();
        stats_.draft_num_shadows = drafter_->num_shadows();
        stats_.draft_num_skipped = drafter_->num_skipped();
    }
}

}  // namespace turbomind
