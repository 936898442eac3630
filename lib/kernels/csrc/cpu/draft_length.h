// How many drafted tokens speculative decoding should verify, per sequence and step.
//
// A verification step of R rows costs what the forward pass costs at R rows, and that depends on the
// machine and the weights: with float weights the matmuls read every weight once for all rows, so 5 rows
// cost about what 1 costs; with exact W4A16 weights on a CPU each weight is converted per row tile and
// 5 rows cost ~2x one (README, "Speculative decoding at batch 1"). A fixed draft length either leaves
// speed unused or, where drafts are often rejected, makes decoding slower than without drafts. Both
// engines therefore cut each draft to the length that pays, from two estimates kept as they run:
//
// - the step's cost: the wall time of decode-only steps fitted as t = a + b R over their rows R
//   (least squares, older steps weighing less): b is what one more row costs, a the rest;
// - each sequence's acceptance rate alpha: drafted token j is accepted with probability alpha^j (the
//   first j - 1 accepted), estimated from the tokens it accepted and the drafts it saw rejected lately.
//
// A step of B decoding sequences makes B tokens in a + b B without drafts. A sequence's draft of k
// tokens adds b k to that and is expected to add alpha + ... + alpha^k tokens; k is the one that
// gives the step the most tokens per second. Token j raises that rate iff alpha^j >= b T / C, with
// T and C the step's expected tokens and cost with the first j - 1 (for j = 1: alpha >= b B /
// (a + b B)); the rate is then past its peak, so the first token that fails ends the draft. So a
// sequence copying its prompt drafts the most, one writing new text drafts one or two, and a large
// batch (where the step is compute-bound) few or none. (Each sequence decides as if the others
// drafted nothing: exact at batch 1, slightly generous above.) Until the fit has seen steps of
// different sizes b is taken as 0 (every draft pays); an acceptance rate decays towards its prior
// while a sequence does not draft, so a sequence that stopped drafting tries again after a few steps.
#pragma once

#include <cstdint>

namespace lmd::cpu {

// One sequence's recent drafts: tokens accepted and drafts with a rejection, both decaying.
struct DraftAcceptance {
    double accepted = 0, rejected = 0;

    // alpha: the chance the next drafted token is accepted (a prior of 0.7 worth two drafts)
    double rate() const;
    // every decoding step, drafted or not: older evidence counts less
    void decay();
    // a verified draft of `drafted` tokens of which the first `accepted` were accepted
    void observe(int64_t drafted, int64_t accepted);
};

class DraftLength {
  public:
    explicit DraftLength(int64_t max_tokens) : max_tokens_(max_tokens) {}

    // a step in which every row was a decoding sequence's token or one of its drafts: R rows, `seconds`
    void observe_step(int64_t rows, double seconds);
    // the k <= min(max_tokens, limit) that gives a step of `num_decoding` sequences the most expected
    // tokens per second (0: no draft)
    int64_t length(const DraftAcceptance & acc, int64_t num_decoding, int64_t limit) const;
    // the fit so far: a (seconds), b (seconds per row); b is 0 until rows varied
    double step_seconds() const { return a_; }
    double row_seconds() const { return b_; }

  private:
    int64_t max_tokens_;
    double w_ = 0, sr_ = 0, srr_ = 0, st_ = 0, srt_ = 0;  // the decayed sums of the fit
    double a_ = 0, b_ = 0;
};

}  // namespace lmd::cpu
