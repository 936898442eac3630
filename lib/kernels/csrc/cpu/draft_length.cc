#include "cpu/draft_length.h"

#include <algorithm>
#include <cmath>

namespace lmd::cpu {

namespace {

constexpr double kPriorRate = 0.7, kPriorWeight = 2.0;  // alpha before any evidence
constexpr double kAcceptanceDecay = 0.8;                // per decoding step: ~5 steps of memory
constexpr double kStepDecay = 0.95;                     // per observed step: ~20 steps in the fit
constexpr double kMinRowVariance = 0.1;                 // rows must have varied this much to fit b

}  // namespace

double DraftAcceptance::rate() const {
    return (accepted + kPriorRate * kPriorWeight) / (accepted + rejected + kPriorWeight);
}

void DraftAcceptance::decay() {
    accepted *= kAcceptanceDecay;
    rejected *= kAcceptanceDecay;
}

void DraftAcceptance::observe(int64_t drafted, int64_t num_accepted) {
    if (drafted <= 0) return;
    accepted += static_cast<double>(num_accepted);
    rejected += num_accepted < drafted ? 1.0 : 0.0;
}

void DraftLength::observe_step(int64_t rows, double seconds) {
    if (rows <= 0 || !(seconds > 0)) return;
    const double r = static_cast<double>(rows);
    w_ = kStepDecay * w_ + 1;
    sr_ = kStepDecay * sr_ + r;
    srr_ = kStepDecay * srr_ + r * r;
    st_ = kStepDecay * st_ + seconds;
    srt_ = kStepDecay * srt_ + r * seconds;
    const double mean_r = sr_ / w_, var_r = srr_ / w_ - mean_r * mean_r;
    if (var_r >= kMinRowVariance) {
        b_ = std::max(0.0, (srt_ / w_ - mean_r * st_ / w_) / var_r);
        a_ = std::max(0.0, st_ / w_ - b_ * mean_r);
    } else {  // one size of step so far: b as it was, a the rest of what it costs
        a_ = st_ / w_ - b_ * mean_r;
        if (a_ < 0) a_ = b_ = 0;
    }
}

int64_t DraftLength::length(const DraftAcceptance & acc, int64_t num_decoding, int64_t limit) const {
    const int64_t k_max = std::min(max_tokens_, limit);
    const double alpha = acc.rate();
    // the step's expected tokens and cost with this sequence's first k drafts: token k + 1 is
    // kept while it raises tokens / cost, i.e. while alpha^(k+1) cost >= b tokens
    double tokens = static_cast<double>(std::max<int64_t>(1, num_decoding)), cost = a_ + b_ * tokens;
    int64_t k = 0;
    for (double p = alpha; k < k_max && p * cost >= b_ * tokens; p *= alpha, ++k) {
        tokens += p;
        cost += b_;
    }
    return k;
}

}  // namespace lmd::cpu
