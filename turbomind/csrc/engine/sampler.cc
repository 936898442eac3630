// Sampling of one row at a time; see sampler.h for the processing order and kept sets.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "cpu/argmax.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace turbomind {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
// a top_k above this selects with nth_element over an index array instead of a heap
constexpr int64_t kHeapTopK = 1024;

inline uint64_t mix64(uint64_t z) {  // splitmix64's finalizer
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

inline double uniform_of(uint64_t bits) { return (double) (bits >> 11) * 0x1.0p-53; }

// a better than b: higher value, then lower id (the order of every best-first list here)
struct Better {
    const float * x;
    bool operator()(int32_t a, int32_t b) const { return x[a] > x[b] || (x[a] == x[b] && a < b); }
};

// Per-thread buffers of one row; grown, never shrunk.
struct RowScratch {
    std::vector<float> work;    // [V] the processed logits (when the row needs processing)
    std::vector<float> probs;   // [V] unnormalized probabilities in vocab order
    std::vector<int32_t> ids;   // [V] candidate ids (best first after a top_k cut)
    std::vector<float> cand_w;  // [V] the candidates' weights, in the order of ids
};

RowScratch & row_scratch() {
    static thread_local RowScratch s;
    return s;
}

// The candidates a sampled row draws from: ids (null: the whole vocabulary in order) and
// unnormalized weights (0: cut), in the order the inverse-CDF walk takes them.
struct Candidates {
    const int32_t * ids = nullptr;
    const float * weights = nullptr;
    int64_t n = 0;
    int32_t id(int64_t j) const { return ids ? ids[j] : (int32_t) j; }
};

// Penalties and masks of one row into out (a copy of x).
void process_row(const float * x, int64_t V, const SamplingState & s, float * out) {
    std::copy(x, x + V, out);
    const SamplingParams & p = s.params;
    if (p.repetition_penalty != 1.0f) {
        // HF RepetitionPenaltyLogitsProcessor: negative logits multiplied, positive divided
        const float pen = p.repetition_penalty;
        for (int32_t t : s.seen_ids) {
            if (t < 0 || t >= V) continue;  // ids outside the vocab touch nothing
            const float v = out[t];
            out[t] = v < 0 ? v * pen : v / pen;
        }
    }
    if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
        for (const auto & [t, count] : s.output_counts) {
            if (t < 0 || t >= V) continue;
            out[t] = out[t] - ((float) count * p.frequency_penalty + p.presence_penalty);
        }
    }
    for (int32_t t : p.bad_token_ids) {
        if (t >= 0 && t < V) out[t] = kNegInf;
    }
    if (s.num_generated < p.min_new_tokens && !s.constrained) {
        for (int32_t t : p.stop_token_ids) {
            if (t >= 0 && t < V) out[t] = kNegInf;
        }
    }
}

// The k best ids of x, best first, into ids[0, k).
void top_k_ids(const float * x, int64_t V, int64_t k, RowScratch & sc) {
    const Better better{x};
    sc.ids.resize(std::max<int64_t>(V, k));
    int32_t * ids = sc.ids.data();
    if (k <= kHeapTopK) {
        // a heap of the k best so far, worst on top: most tokens lose against the top at once
        for (int64_t i = 0; i < k; ++i) ids[i] = (int32_t) i;
        std::make_heap(ids, ids + k, better);
        for (int64_t i = k; i < V; ++i) {
            if (better((int32_t) i, ids[0])) {
                std::pop_heap(ids, ids + k, better);
                ids[k - 1] = (int32_t) i;
                std::push_heap(ids, ids + k, better);
            }
        }
    } else {
        std::iota(ids, ids + V, 0);
        std::nth_element(ids, ids + k, ids + V, better);
    }
    std::sort(ids, ids + k, better);
}

// Cut a best-first weight list by top_p (a token stays while the weight of strictly better
// tokens is below top_p * total) and min_p (relative to the best); returns the kept length.
// total: the weight top_p is measured against (the whole row's, or the top-k set's).
int64_t cut_sorted(float * w, int64_t n, double total, float top_p, float min_p) {
    if (top_p < 1.0f) {
        const double limit = (double) top_p * total;
        double before = 0.0;
        for (int64_t j = 0; j < n; ++j) {
            if (j > 0 && before >= limit) {
                n = j;
                break;
            }
            before += w[j];
        }
    }
    if (min_p > 0.0f) {
        const float threshold = min_p * w[0];
        for (int64_t j = 1; j < n; ++j) {
            if (w[j] < threshold) w[j] = 0.0f;
        }
    }
    return n;
}

// top_p's kept set among ids[0, n) (a best-first prefix of the row, or all of it): the tokens
// whose better tokens weigh less than limit, i.e. the shortest best-first prefix whose weight
// reaches limit. Moves them to ids[0, kept), unordered, and returns kept. A quickselect on
// weight instead of a sort: expected O(n), the same set as sorting (order: Better).
int64_t select_top_p(int32_t * ids, int64_t n, const float * w, double limit) {
    const Better better{w};
    int64_t lo = 0, hi = n;  // the kept set ends inside [lo, hi); ids[0, lo) are kept
    double need = limit;     // the weight still to reach, beyond ids[0, lo)
    while (hi - lo > 32) {
        // median of three as the pivot, parked at hi - 1
        int32_t * a = ids + lo, * m = ids + lo + (hi - lo) / 2, * z = ids + hi - 1;
        if (better(*m, *a)) std::swap(*m, *a);
        if (better(*z, *a)) std::swap(*z, *a);
        if (better(*m, *z)) std::swap(*m, *z);  // now *z is the median
        const int32_t pivot = *z;
        int32_t * mid = std::partition(ids + lo, ids + hi - 1, [&](int32_t t) { return better(t, pivot); });
        std::swap(*mid, ids[hi - 1]);
        const int64_t p = mid - ids;
        double mass = 0.0;
        for (int64_t j = lo; j < p; ++j) mass += w[ids[j]];
        if (mass >= need) {  // the prefix reaches limit before the pivot
            hi = p;
            continue;
        }
        need -= mass + w[pivot];
        if (need <= 0.0) return p + 1;  // the pivot is the token that crosses limit
        lo = p + 1;
    }
    std::sort(ids + lo, ids + hi, better);
    for (int64_t j = lo; j < hi; ++j) {
        if (j > 0 && need <= 0.0) return j;
        need -= w[ids[j]];
    }
    return hi;
}

// The kept candidates of a sampled (non-greedy) row x (already processed, its best finite).
Candidates row_candidates(const float * x, int64_t V, const SamplingParams & p, RowScratch & sc) {
    const float inv_t = 1.0f / p.temperature;
    sc.cand_w.resize(V);
    float * cw = sc.cand_w.data();
    Candidates c;
    c.weights = cw;

    if (p.top_k > 0 && p.top_k < V) {
        // temperature keeps the order: cut first, then weigh only the candidates (over which the
        // top-k set is normalized)
        const int64_t k = p.top_k;
        top_k_ids(x, V, k, sc);
        const int32_t * ids = sc.ids.data();
        const float top = x[ids[0]];
        double total = 0.0;
        for (int64_t j = 0; j < k; ++j) {
            cw[j] = std::exp((x[ids[j]] - top) * inv_t);
            total += cw[j];
        }
        c.ids = ids;
        c.n = cut_sorted(cw, k, total, p.top_p, p.min_p);
        return c;
    }

    // the whole row's probabilities (top_p and min_p are measured against them)
    sc.probs.resize(V);
    float * w = sc.probs.data();
    const float top = x[lmd::cpu::argmax_row(x, V)];
    double total = 0.0;
    for (int64_t i = 0; i < V; ++i) {
        w[i] = std::exp((x[i] - top) * inv_t);  // the best token weighs exactly 1
        total += w[i];
    }
    if (p.top_p >= 1.0f && p.min_p <= 0.0f) {  // plain: the whole vocabulary, in vocab order
        c.weights = w;
        c.n = V;
        return c;
    }

    sc.ids.resize(V);
    int32_t * ids = sc.ids.data();
    int64_t n = 0;
    if (p.min_p > 0.0f) {
        // min_p's kept set (weight >= min_p * the best's 1) is a best-first prefix, and so is
        // top_p's: with both, the kept set is the shorter one
        for (int64_t i = 0; i < V; ++i) {
            if (w[i] >= p.min_p) ids[n++] = (int32_t) i;
        }
    } else {
        std::iota(ids, ids + V, 0);
        n = V;
    }
    if (p.top_p < 1.0f) n = select_top_p(ids, n, w, (double) p.top_p * total);
    for (int64_t j = 0; j < n; ++j) cw[j] = w[ids[j]];
    c.ids = ids;
    c.n = n;
    return c;
}

// Inverse-CDF draw: the first candidate whose cumulative weight exceeds u * total.
int32_t draw(const Candidates & c, double u) {
    double total = 0.0;
    for (int64_t j = 0; j < c.n; ++j) total += c.weights[j];
    const double target = u * total;
    double cum = 0.0;
    int64_t last = 0;  // the last candidate with weight: where u * total rounding up lands
    for (int64_t j = 0; j < c.n; ++j) {
        if (c.weights[j] <= 0.0f) continue;
        cum += c.weights[j];
        last = j;
        if (cum > target) return c.id(j);
    }
    return c.id(last);
}

// The row after penalties, masks and its bitmask (null: none); raw itself when nothing applies.
const float * processed_row(const float * raw, int64_t V, const SamplingState & s, const int32_t * bitmask,
                            RowScratch & sc) {
    if (!s.needs_processing() && !bitmask) return raw;
    sc.work.resize(V);
    process_row(raw, V, s, sc.work.data());
    if (bitmask) apply_token_bitmask(sc.work.data(), V, bitmask);
    return sc.work.data();
}

// One row's token; u: its uniform (unused when greedy).
int32_t sample_row(const float * raw, int64_t V, const SamplingState & s, const int32_t * bitmask, double u,
                   RowScratch & sc) {
    const float * x = processed_row(raw, V, s, bitmask, sc);
    const int32_t best = lmd::cpu::argmax_row(x, V);
    // every token masked (or NaN): nothing to draw from, take the argmax's pick
    if (s.greedy || !(x[best] > kNegInf)) return best;
    return draw(row_candidates(x, V, s.params, sc), u);
}

// log_softmax of the raw row: the chosen token's, then the k best alternatives (chosen skipped)
void row_logprobs(const float * raw, int64_t V, int32_t chosen, int64_t k, RowScratch & sc,
                  std::vector<TokenLogprob> & out) {
    const float top = raw[lmd::cpu::argmax_row(raw, V)];
    double sum = 0.0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp((double) raw[i] - top);
    const double lse = (double) top + std::log(sum);
    out.clear();
    out.push_back({chosen, (float) (raw[chosen] - lse)});
    k = std::min(k, V);
    if (k <= 0) return;
    top_k_ids(raw, V, k, sc);
    for (int64_t j = 0; j < k; ++j) {
        const int32_t t = sc.ids[j];
        if (t != chosen) out.push_back({t, (float) (raw[t] - lse)});
    }
}

}  // namespace

// ---- params and state

std::string sampling_params_check(const SamplingParams & p) {
    auto bad = [](const char * field, double v, const char * rule) {
        return std::string(field) + ": must be " + rule + ", got " + std::to_string(v);
    };
    // written so that NaN fails every range
    if (!(p.min_new_tokens >= 0)) return bad("min_new_tokens", p.min_new_tokens, ">= 0");
    if (!(p.temperature >= 0.0f && p.temperature <= 100.0f)) return bad("temperature", p.temperature, "in [0, 100]");
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return bad("top_p", p.top_p, "in (0, 1]");
    if (!(p.top_k >= 0)) return bad("top_k", p.top_k, ">= 0");
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return bad("min_p", p.min_p, "in [0, 1]");
    if (!(p.repetition_penalty > 0.0f && std::isfinite(p.repetition_penalty))) {
        return bad("repetition_penalty", p.repetition_penalty, "> 0 and finite");
    }
    if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f)) {
        return bad("presence_penalty", p.presence_penalty, "in [-2, 2]");
    }
    if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
        return bad("frequency_penalty", p.frequency_penalty, "in [-2, 2]");
    }
    if (!(p.prompt_logprobs >= -1 && p.prompt_logprobs <= 20)) {
        return bad("prompt_logprobs", p.prompt_logprobs, "in [0, 20] (or none)");
    }
    if (!(p.logprobs >= -1 && p.logprobs <= 20)) return bad("logprobs", p.logprobs, "in [0, 20] (or none)");
    return "";
}

bool sampling_params_is_greedy(const SamplingParams & p) {
    return p.greedy || p.temperature == 0.0f || p.top_k == 1;
}

SamplingState::SamplingState(const SamplingParams & p, const int32_t * prompt_token_ids, int64_t num_prompt_tokens)
    : params(p), greedy(sampling_params_is_greedy(p)) {
    for (int64_t i = 0; i < num_prompt_tokens; ++i) {
        if (seen.insert(prompt_token_ids[i]).second) seen_ids.push_back(prompt_token_ids[i]);
    }
}

void SamplingState::append(int32_t token_id) {
    ++num_generated;
    ++output_counts[token_id];
    if (seen.insert(token_id).second) seen_ids.push_back(token_id);
}

bool SamplingState::needs_processing() const {
    const SamplingParams & p = params;
    return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f ||
           !p.bad_token_ids.empty() || (num_generated < p.min_new_tokens && !p.stop_token_ids.empty() && !constrained);
}

void apply_token_bitmask(float * x, int64_t vocab, const int32_t * bitmask) {
    const int64_t words = (vocab + 31) / 32;
    for (int64_t w = 0; w < words; ++w) {
        const uint32_t bits = (uint32_t) bitmask[w];
        if (bits == 0xFFFFFFFFu) continue;  // a grammar allows few tokens or most: whole words at once
        const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
        if (bits == 0) {
            std::fill(x + base, x + base + n, kNegInf);
            continue;
        }
        for (int64_t j = 0; j < n; ++j) {
            if (!((bits >> j) & 1u)) x[base + j] = kNegInf;
        }
    }
}

// ---- the sampler

Sampler::Sampler(uint64_t stream_seed) : stream_state_(mix64(stream_seed)) {}

double Sampler::next_uniform() {
    stream_state_ += kGolden;
    return uniform_of(mix64(stream_state_));
}

double Sampler::seeded_uniform(uint64_t seed, uint64_t num_generated) {
    // the (num_generated + 1)-th value of a splitmix64 stream that starts at mix64(seed)
    return uniform_of(mix64(mix64(seed) + (num_generated + 1) * kGolden));
}

// Threads for rows of a step's logits: the kernels' pool (cpu/parallel.h), never OpenMP's, whose
// workers spin after each region on the cores the kernels' threads run on; one below ~32k logits.
static int row_threads(int64_t rows, int64_t vocab) {
    return rows > 1 && rows * vocab >= (1 << 15) ? lmd::cpu::num_threads() : 1;
}

void Sampler::sample(const float * logits, int64_t batch, int64_t vocab, int64_t row_stride,
                     const SamplingState * const * states, int32_t * token_ids,
                     std::vector<std::vector<TokenLogprob>> * logprobs, const int32_t * const * bitmasks) {
    // one uniform per sampled row, drawn before the rows run so the stream's order is row order
    std::vector<double> u(batch, 0.0);
    for (int64_t i = 0; i < batch; ++i) {
        const SamplingState & s = *states[i];
        if (s.greedy) continue;
        u[i] = s.params.has_seed ? seeded_uniform(s.params.random_seed, (uint64_t) s.num_generated) : next_uniform();
    }
    if (logprobs) logprobs->assign(batch, {});
    lmd::cpu::parallel_pieces(row_threads(batch, vocab), batch, [&](int64_t i, int) {
        RowScratch & sc = row_scratch();
        const float * raw = logits + i * row_stride;
        const SamplingState & s = *states[i];
        token_ids[i] = sample_row(raw, vocab, s, bitmasks ? bitmasks[i] : nullptr, u[i], sc);
        if (logprobs && s.params.logprobs >= 0) {
            row_logprobs(raw, vocab, token_ids[i], s.params.logprobs, sc, (*logprobs)[i]);
        }
    });
}

void Sampler::token_logprobs(const float * logits, int64_t n, int64_t vocab, int64_t row_stride,
                             const int32_t * tokens, int64_t k, std::vector<TokenLogprob> * out) {
    lmd::cpu::parallel_pieces(row_threads(n, vocab), n, [&](int64_t i, int) {
        row_logprobs(logits + i * row_stride, vocab, tokens[i], k, row_scratch(), out[i]);
    });
}

void Sampler::process_logits(const float * logits, int64_t batch, int64_t vocab, int64_t row_stride,
                             const SamplingState * const * states, float * out, const int32_t * const * bitmasks) {
    for (int64_t i = 0; i < batch; ++i) {
        process_row(logits + i * row_stride, vocab, *states[i], out + i * vocab);
        if (bitmasks && bitmasks[i]) apply_token_bitmask(out + i * vocab, vocab, bitmasks[i]);
    }
}

void Sampler::distribution(const float * logits, int64_t batch, int64_t vocab, int64_t row_stride,
                           const SamplingState * const * states, float * out) {
    RowScratch & sc = row_scratch();
    for (int64_t i = 0; i < batch; ++i) {
        float * o = out + i * vocab;
        std::fill(o, o + vocab, 0.0f);
        const SamplingState & s = *states[i];
        const float * x = processed_row(logits + i * row_stride, vocab, s, nullptr, sc);
        const int32_t best = lmd::cpu::argmax_row(x, vocab);
        if (s.greedy || !(x[best] > kNegInf)) {
            o[best] = 1.0f;
            continue;
        }
        const Candidates c = row_candidates(x, vocab, s.params, sc);
        double total = 0.0;
        for (int64_t j = 0; j < c.n; ++j) total += c.weights[j];
        for (int64_t j = 0; j < c.n; ++j) o[c.id(j)] = (float) (c.weights[j] / total);
    }
}

}  // namespace turbomind
