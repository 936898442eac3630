// The sampler: one step's logits in, one token (and optional logprobs) per request out.
// The C++ twin of pytorch_backend/sampler.py: same processing order, same kept sets, same
// logprobs; the random numbers differ (a counter-based hash here, torch generators there).
//
// Processing order, as HF generate applies it:
//   repetition_penalty (prompt + generated ids) -> presence / frequency penalty (generated ids,
//   OpenAI semantics) -> bad_token_ids to -inf -> stop_token_ids to -inf while
//   num_generated < min_new_tokens (not under a constraint) -> a structured-output bitmask's
//   cleared tokens to -inf -> greedy: argmax (ties: lowest id)
//   -> else temperature -> top_k -> top_p -> min_p -> one inverse-CDF draw
//
// Kept sets (filter_sorted in the Python version): top_k keeps the k best and renormalizes over
// them; top_p keeps a token while the mass of strictly better tokens is below top_p; min_p keeps
// tokens with probability >= min_p * the best's. The best token is always kept. A row without
// top_k but with top_p / min_p takes its probabilities over the whole vocabulary.
//
// Logprobs are log_softmax of the raw logits, before any processing (vLLM's default): the chosen
// token's, then the top-k alternatives best first (the chosen one not repeated). A constrained
// row's logprobs are the model's, not the grammar's.
//
// Reproducibility: every sampled row takes exactly one uniform u per step. A seeded row's u is a
// counter-based hash of (random_seed, num_generated), so it samples the same tokens whatever else
// is in the batch, in whatever row order, and across preemption (num_generated survives). Rows
// without a seed draw from the sampler's own stream, in row order.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace turbomind {

// lmd.engine.SamplingParams, the fields the sampler reads
struct SamplingParams {
    int32_t min_new_tokens = 0;
    bool greedy = true;
    float temperature = 1.0f;      // [0, 100]; 0: greedy
    float top_p = 1.0f;            // (0, 1]; 1: no cut
    int32_t top_k = 0;             // >= 0; 0: no cut; 1: greedy
    float min_p = 0.0f;            // [0, 1]; 0: no cut
    float repetition_penalty = 1.0f;  // > 0; 1: none
    float presence_penalty = 0.0f;    // [-2, 2]
    float frequency_penalty = 0.0f;   // [-2, 2]
    bool has_seed = false;
    uint64_t random_seed = 0;
    std::vector<int32_t> stop_token_ids;  // masked until min_new_tokens are generated
    std::vector<int32_t> bad_token_ids;   // always masked
    int32_t logprobs = -1;                // -1: none; k in [0, 20]: the chosen token's and k alternatives'
    // -1: none; k in [0, 20]: each prompt token's and k alternatives' (read by the engine from the
    // prefill's rows, with token_logprobs below; the sampler itself never looks at it)
    int32_t prompt_logprobs = -1;
};

// "" when p is valid, else "<field>: <what is wrong>" (the binding raises it as ValueError).
std::string sampling_params_check(const SamplingParams & p);

// Sampling reduces to argmax: no sampling asked, zero temperature, or top_k 1.
bool sampling_params_is_greedy(const SamplingParams & p);

// Per-request mutable sampling state; lives as long as the request (preemption included).
// The sampler only reads it; the engine calls append() with each token the request keeps.
struct SamplingState {
    SamplingParams params;
    bool greedy = true;
    bool constrained = false;  // a grammar decides where the text ends: stop ids are never held back
    int32_t num_generated = 0;
    std::unordered_map<int32_t, int32_t> output_counts;  // token id -> times generated
    std::vector<int32_t> seen_ids;                       // prompt + generated, each once, first-seen order
    std::unordered_set<int32_t> seen;

    SamplingState(const SamplingParams & p, const int32_t * prompt_token_ids, int64_t num_prompt_tokens);

    void append(int32_t token_id);

    // whether any penalty or mask touches this row's logits this step
    bool needs_processing() const;
};

// Set to -inf every x[t] (t < vocab) whose bit is clear in bitmask (xgrammar's layout: bit t % 32
// of word t / 32; ceil(vocab / 32) words).
void apply_token_bitmask(float * x, int64_t vocab, const int32_t * bitmask);

struct TokenLogprob {
    int32_t token_id;
    float logprob;
};

class Sampler {
public:
    // stream_seed: the stream rows without random_seed draw from
    explicit Sampler(uint64_t stream_seed);

    // logits: [batch, vocab] float32, row i at logits + i * row_stride, never modified;
    // states[i] for row i. Writes token_ids[batch]. logprobs (may be null) is resized to batch;
    // row i is filled when states[i]->params.logprobs >= 0, else left empty. bitmasks (may be
    // null): per row, null or its structured-output bitmask (apply_token_bitmask), applied after
    // penalties and masks. Rows run in parallel (on the kernels' thread pool) when the batch is big enough. Not
    // thread-safe (the engine thread owns it).
    void sample(const float * logits, int64_t batch, int64_t vocab, int64_t row_stride,
                const SamplingState * const * states, int32_t * token_ids,
                std::vector<std::vector<TokenLogprob>> * logprobs, const int32_t * const * bitmasks = nullptr);

    // Logprobs of given tokens: out[i] = {tokens[i]'s, then the k best alternatives (tokens[i] not
    // repeated)}, log_softmax of the raw row i (at logits + i * row_stride), the arithmetic of the
    // sampled tokens' logprobs. The engine's prompt logprobs; rows run in parallel (the kernels' pool).
    static void token_logprobs(const float * logits, int64_t n, int64_t vocab, int64_t row_stride,
                               const int32_t * tokens, int64_t k, std::vector<TokenLogprob> * out);

    // ---- for tests and debugging (not the hot path)

    // the logits after penalties and masks: out [batch, vocab]
    static void process_logits(const float * logits, int64_t batch, int64_t vocab, int64_t row_stride,
                               const SamplingState * const * states, float * out,
                               const int32_t * const * bitmasks = nullptr);
    // the distribution a sampled row draws from, in vocab order (normalized; cut tokens 0):
    // out [batch, vocab]; a greedy row gets a one-hot at its argmax
    static void distribution(const float * logits, int64_t batch, int64_t vocab, int64_t row_stride,
                             const SamplingState * const * states, float * out);
    // a seeded row's uniform in [0, 1) for its draw after num_generated tokens
    static double seeded_uniform(uint64_t seed, uint64_t num_generated);

private:
    double next_uniform();
    uint64_t stream_state_;
};

}  // namespace turbomind
