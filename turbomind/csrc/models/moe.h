// A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): the MLP of a LlamaModel's sparse layers.
//
// Routing as transformers computes it: router logits x · routerᵀ in float32, softmax in float32, the
// top k (the larger probability first, the lower expert id on a tie), renormalised to sum 1 with
// `norm_topk_prob` (Mixtral always, Qwen by its config) and, with `round_weights` (Qwen), rounded to
// the model dtype. The experts run as grouped matmuls: the rows routed to each expert are gathered
// (in token order), and each expert that has rows runs one gate_up matmul, silu_and_mul and one down
// matmul over all of them. Each token's output is then sum_j weight_j · expert_j(x) in float32, over
// its k experts in top-k order, plus Qwen2-MoE's shared expert scaled by sigmoid(x · shared_gateᵀ),
// rounded once to the model dtype: a row's result never depends on the other rows of the step.
// DeepSeek-V2: the top k within the best groups (`num_groups`, `topk_groups`), their weights times
// `routed_scaling_factor`, and shared experts added ungated (`shared_gated` false).
// gpt-oss (`topk_softmax`): the router has a bias, the top k logits are picked first and softmaxed over
// those k; each expert's matmuls carry biases (LinearWeights::bias) and its activation is the clamped
// SwiGLU: gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate).
#pragma once

#include <vector>

#include "models/llama.h"

namespace turbomind {

struct MoeWeights {
    int64_t top_k = 0;
    int64_t intermediate_size = 0;  // each expert's I
    bool norm_topk_prob = false;
    bool round_weights = false;     // the routing weights rounded to the model dtype (Qwen)
    bool topk_softmax = false;      // top-k of the logits, then softmax over them (gpt-oss)
    float swiglu_limit = 0.f;       // > 0: gpt-oss's clamped SwiGLU at this limit; 0: silu(gate) * up
    float swiglu_alpha = 1.f;
    // DeepSeek-V2: the routing weights times routed_scaling_factor; with num_groups > 1 the top k come from
    // the topk_groups groups (of E / num_groups consecutive experts) whose best probability is highest
    float routed_scaling_factor = 1.f;
    int64_t num_groups = 1;
    int64_t topk_groups = 1;
    bool shared_gated = true;       // the shared expert scaled by sigmoid(x · shared_gateᵀ); false: added as is
    LinearWeights router;           // [E, H]
    std::vector<LinearWeights> gate_up;  // per expert [2 I, H]: its gate rows, then its up rows
    std::vector<LinearWeights> down;     // per expert [H, I]
    int64_t shared_intermediate_size = 0;  // 0: no shared expert
    LinearWeights shared_gate_up;   // [2 S, H]
    LinearWeights shared_down;      // [H, S]
    LinearWeights shared_gate;      // [1, H]
    int64_t num_experts() const { return static_cast<int64_t>(gate_up.size()); }
};

// out[T, H] = the MLP of w over x[T, H] (both contiguous, the model dtype).
void moe_forward(const MoeWeights & w, const TensorView & x, const TensorView & out, bool int8_activations);

// llama.cc's matmul: y = x · wᵀ (+ bias) for weights in any of LinearWeights' layouts.
void apply_linear(const TensorView & x, const LinearWeights & w, const TensorView & y, bool int8_activations);

}  // namespace turbomind
