// TurboMind's engine: a request queue, a batching thread, the paged KV cache's blocks and the
// model, all in C++. Python posts requests and collects outputs; neither waits on the other
// while a step runs (the GIL is never held by the engine thread).
//
// Split as llama.cpp splits its context: the Scheduler (engine/scheduler.h) decides which
// sequences run and how many tokens each, the Batch (engine/batch.h) turns that into the model's
// inputs, LlamaModel runs them, and the engine itself owns the threads, the inbox and outbox,
// sampling and outputs. A step reads: (propose drafts ->) schedule -> build -> forward -> sample -> emit.
//
// Structured output: a request may carry a Constraint (its grammar, owned by the layer above:
// lmd.guided.TokenConstraint behind the binding). Each step the engine asks ConstraintOps for
// the bitmasks of all constrained rows at once, the sampler masks those rows after penalties,
// and after sampling ConstraintOps::accept gets all their tokens at once; the binding takes the
// GIL once for each of the two calls. Rows without a constraint cost nothing. The constraint
// lives in the sequence, so preemption does not replay it.
//
// Prompt logprobs (SamplingParams::prompt_logprobs): the batch adds the prompt rows of such a
// request to the step's logit rows, after the sampled ones, and the engine turns them into
// logprobs (Sampler::token_logprobs) as its prefill runs, chunk by chunk; the request skips
// reading the prefix cache until it has them all, and a recompute after preemption reads only the
// rows it has not. They go out with its first output. max_new_tokens 0 with them: prefill only,
// then Finish::length.
//
// Speculative decoding (EngineConfig::num_speculative_tokens > 0, n-gram prompt lookup: vLLM's
// `ngram`): before scheduling, each decoding sequence drafts up to that many tokens from its own
// context (lmd::cpu::ngram_propose), never past its max_new_tokens or session_len; the scheduler
// gives it its next token's row and one row per draft, and the forward pass runs them as a
// prefill chunk. Verification goes in rounds, every drafted sequence at once: round j samples the
// token t_j from row j with the request's state after t_0 .. t_{j-1} (penalties, grammar, seed),
// and t_j is handled as any generated token; the draft d_j is accepted and round j + 1 follows iff
// t_j == d_j. For greedy rows this is the output without speculation, token for token; for
// sampled rows it is rejection sampling against a one-hot draft (accepting d with probability p(d),
// else drawing from p without d, is drawing t ~ p and accepting iff t == d), so the distribution
// is the model's. The accepted drafts' K/V counts as computed; the rest is garbage that later
// tokens overwrite, and the blocks it took are given back (Scheduler::accept_draft). The step's
// tokens of a sequence go out in one output. With a draft model (vLLM's `draft_model`, LMDeploy's
// `draft_target`) the drafts come from it instead (DraftProposer, engine/draft.h: its own paged KV
// cache, a shadow per sequence, every drafting sequence in one forward pass per draft position);
// verification is the same.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cpu/draft_length.h"
#include "engine/batch.h"
#include "engine/block_manager.h"
#include "engine/draft.h"
#include "engine/notifier.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "models/llama.h"

namespace turbomind {

enum class Finish : int8_t { none = 0, stop = 1, length = 2, abort = 3, error = 4 };

// A request's grammar; the engine only holds it and hands it to ConstraintOps. Destroyed on the
// engine thread (or the caller's, for a request that never started), never under the engine's mutex.
struct Constraint {
    virtual ~Constraint() = default;
    std::vector<int32_t> stop_token_ids;  // taking one of these completes the grammar
};

// What the engine asks of the constraints of one step's rows, all of them in one call.
// Failures are per row: errors[i] non-empty ends that request with Finish::error.
class ConstraintOps {
public:
    virtual ~ConstraintOps() = default;
    // bitmask: [n, num_words] int32, xgrammar's layout (bit t % 32 of word t / 32 set: token t
    // allowed); row i for cs[i]
    virtual void fill_bitmasks(Constraint * const * cs, int64_t n, int32_t * bitmask, int64_t num_words,
                               std::string * errors) = 0;
    // cs[i] takes tokens[i]; errors[i] says why it could not
    virtual void accept(Constraint * const * cs, const int32_t * tokens, int64_t n, std::string * errors) = 0;
};

struct Request {
    int64_t session_id = 0;
    std::vector<int32_t> token_ids;
    int64_t max_new_tokens = 512;
    SamplingParams sampling;
    bool sequence_start = true;
    bool sequence_end = true;
    std::unique_ptr<Constraint> constraint;  // structured output; null: none
    // a LoRA adapter (lmd.lora.AdapterSlot): the model's slot its rows run (-1: none) and the uid of
    // that load, which salts its prefix-cache keys. A kept session's later turns keep their first's.
    int32_t adapter_slot = -1;
    uint64_t adapter_uid = 0;
};

// New tokens of one request since its last output; finish is set on its last.
struct Output {
    int64_t session_id = 0;
    std::vector<int32_t> token_ids;
    std::vector<std::vector<TokenLogprob>> logprobs;  // one per new token when asked for
    // with has_prompt_logprobs (a request's first output, when asked for): prompt tokens 1.. each
    // {the token's, alternatives'} (token 0 has none: nothing predicts it)
    bool has_prompt_logprobs = false;
    std::vector<std::vector<TokenLogprob>> prompt_logprobs;
    Finish finish = Finish::none;
    int64_t num_prompt_tokens = 0;   // context before generation (a session's history included)
    int64_t num_cached_tokens = 0;   // of those, served from the prefix cache or the kept session
    int64_t num_context_tokens = 0;  // with finish: what a kept session now holds
    bool kept = false;               // with finish: the session stays for its next turn
    std::string error;
};

struct EngineConfig {
    int64_t max_batch_size = 128;
    int64_t max_num_batched_tokens = 4096;
    int64_t session_len = 4096;
    int32_t num_blocks = 0;
    int32_t block_size = 64;
    bool enable_prefix_caching = false;
    int64_t window = 0;         // > 0: every layer's sliding window (blocks before it are given back)
    uint64_t sampler_seed = 0;  // the stream of requests without a random_seed
    // speculative decoding: drafted tokens a step (0: off); by the draft model when the engine has
    // one, else by n-gram prompt lookup over the lengths prompt_lookup_max down to prompt_lookup_min
    int32_t num_speculative_tokens = 0;
    int32_t prompt_lookup_min = 1, prompt_lookup_max = 4;
    // cut each draft to the length that pays on this machine (cpu/draft_length.h); false: always
    // num_speculative_tokens where the proposer has them
    bool adaptive_draft_length = true;
};

struct EngineStats {
    int64_t num_running = 0, num_waiting = 0;
    int64_t num_total_blocks = 0, num_free_blocks = 0, num_cached_blocks = 0;
    int64_t num_prefix_hit_tokens = 0, num_prefix_query_tokens = 0;
    int64_t num_preemptions = 0, num_prompt_tokens = 0, num_generated_tokens = 0;
    // speculative decoding, all time: drafted sequences, drafted tokens, drafted tokens accepted
    int64_t spec_num_drafts = 0, spec_num_draft_tokens = 0, spec_num_accepted_tokens = 0;
    // the draft model's cache (0 without one): its blocks, those free, the sequences it shadows, and
    // the drafts it skipped for want of free blocks (all time)
    int64_t draft_num_total_blocks = 0, draft_num_free_blocks = 0, draft_num_shadows = 0, draft_num_skipped = 0;
};

class Engine {
public:
    // constraint_ops: serves requests that carry a Constraint (null: such requests are refused);
    // draft_model: speculative decoding drafts with it (its vocabulary the model's; the caller checks),
    // its whole KV cache the drafts' (null: n-gram prompt lookup)
    Engine(std::shared_ptr<LlamaModel> model, const EngineConfig & config,
           std::shared_ptr<ConstraintOps> constraint_ops = nullptr, std::shared_ptr<LlamaModel> draft_model = nullptr);
    ~Engine();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    // Thread-safe; never wait for a step. The Python side validates requests first.
    void add(Request request);
    void abort(int64_t session_id);
    void end(int64_t session_id);
    // Outputs in the order they were made; waits up to timeout_s for at least one. Empty after close.
    std::vector<Output> wait_outputs(double timeout_s);
    // Without waiting: the outputs so far (empty if none). outputs_fd() turns readable when there
    // are some (engine/notifier.h); an event loop watches it instead of a thread in wait_outputs.
    std::vector<Output> take_outputs();
    int outputs_fd() const { return outputs_ready_.fd(); }
    EngineStats stats() const;
    // Pending requests finish with abort; the thread stops. Idempotent.
    void close();
    bool closed() const;
    // Test hook: check the blocks' accounting after every step (Scheduler::check_invariants, and the
    // draft model's cache: DraftProposer::check_invariants);
    // blocks_error() is the first violation seen ("" if none).
    void set_check_blocks(bool on) { check_blocks_ = on; }
    std::string blocks_error() const;

private:
    // A sequence as the engine holds it: the scheduler's fields and what sampling and outputs need.
    struct EngineSequence : Sequence {
        int64_t max_new_tokens = 0;
        SamplingParams sampling;
        std::unique_ptr<SamplingState> sampling_state;
        std::unique_ptr<Constraint> constraint;  // this turn's grammar, or null
        bool sequence_end = true;
        // while sampling.prompt_logprobs >= 0 and not yet sent: the entries of prompt tokens 1.. read
        // so far (position p's row scores token p + 1, so the next position to read is the size)
        bool wants_prompt_logprobs = false;
        std::vector<std::vector<TokenLogprob>> prompt_logprobs;
        // within a step: its tokens so far and their logprobs (out together), and how many of its
        // draft (Sequence::draft_token_ids) they confirmed
        std::vector<int32_t> step_token_ids;
        std::vector<std::vector<TokenLogprob>> step_logprobs;
        int64_t num_accepted_drafts = 0;
        lmd::cpu::DraftAcceptance draft_acceptance;  // its recent drafts (adaptive_draft_length)
    };
    // every sequence the scheduler holds is one of the engine's
    static EngineSequence * of(Sequence * seq) { return static_cast<EngineSequence *>(seq); }

    struct Message {
        enum Kind { add, abort, end } kind;
        Request request;
        int64_t session_id;
    };

    void loop();
    void handle(Message & m);
    void on_add(Request & r);
    void abort_all();

    // one step and its phases
    bool step();
    bool forward(const StepInputs & in, const SchedulerOutput & out);
    void propose_drafts();
    void verify(const std::vector<Sequence *> & sampled);
    void sample(const std::vector<Sequence *> & rows, const float * logits);
    void emit_tokens(const std::vector<Sequence *> & rows);
    void commit_draft(EngineSequence * seq);
    void emit_step_tokens(EngineSequence * seq);
    void read_prompt_logprobs(const SchedulerOutput & out);
    void take_prompt_logprobs(EngineSequence * seq, Output & o);

    void finish(EngineSequence * seq, Finish reason, std::vector<int32_t> tokens = {},
                std::vector<std::vector<TokenLogprob>> lps = {}, std::string error = {});
    void emit(Output out);
    void update_stats();

    std::shared_ptr<LlamaModel> model_;
    EngineConfig config_;
    std::shared_ptr<ConstraintOps> constraint_ops_;
    BlockManager blocks_;
    Scheduler scheduler_;
    Batch batch_;
    Sampler sampler_;
    std::unique_ptr<DraftProposer> drafter_;  // null: drafts by prompt lookup
    lmd::cpu::DraftLength draft_length_;      // the draft lengths that pay (adaptive_draft_length)

    // engine thread only
    std::unordered_map<int64_t, std::unique_ptr<EngineSequence>> seqs_;
    int64_t num_prompt_tokens_ = 0, num_generated_tokens_ = 0;
    int64_t spec_num_drafts_ = 0, spec_num_draft_tokens_ = 0, spec_num_accepted_tokens_ = 0;
    std::vector<float> logits_;  // [sampled rows, then prompt rows, then draft rows, vocab] of the step
    std::vector<SeqRows> seq_rows_;  // per scheduled sequence of the step: what the batch reads of its rows
    // per sampled row of the step: its token, logprobs, whether it ends the turn, what failed
    std::vector<int32_t> sampled_ids_;
    std::vector<std::vector<TokenLogprob>> sampled_logprobs_;
    std::vector<uint8_t> stops_;
    std::vector<uint8_t> going_;  // the row's token joined its context and its turn goes on
    std::vector<float> draft_logits_;  // [rows, vocab]: a verification round's rows, gathered
    std::vector<std::string> row_errors_;
    std::vector<int32_t> bitmask_;  // [constrained rows, ceil(vocab / 32)] of the step
    std::vector<Output> pending_;  // outputs of this iteration, published by update_stats()

    // shared with callers
    mutable std::mutex mutex_;
    std::condition_variable inbox_cv_, outbox_cv_;
    Notifier outputs_ready_;  // signalled with outbox_cv_
    std::vector<Message> inbox_;
    std::vector<Output> outbox_;
    bool closing_ = false, stopped_ = false;
    EngineStats stats_;
    std::atomic<bool> check_blocks_{false};
    std::string blocks_error_;
    std::thread thread_;
};

}  // namespace turbomind
