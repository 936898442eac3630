// The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, Gemma 2/3, OLMo 2, GLM, GLM-4; DeepSeek-V2's
// latent attention through mla.h) in C++ over a paged KV cache that the model owns. One forward pass runs the tokens of any mix of sequences: each token row
// says which cache slot its K/V goes to, which sequence's blocks it reads and how many tokens
// it sees.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "core/tensor.h"
#include "cpu/lora.h"

namespace turbomind {

// The kernel library (lib/kernels/csrc) lives in namespace lmd: its tensors and kernels are
// TurboMind's vocabulary, so they are named here without the prefix.
using namespace lmd;

struct LlamaConfig {
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;
    int64_t num_layers = 0;
    int64_t num_heads = 0;
    int64_t num_kv_heads = 0;
    int64_t head_dim = 0;
    int64_t vocab_size = 0;
    float rms_norm_eps = 1e-6f;
    bool qk_norm = false;  // Qwen3: RMSNorm over each head of q and k before RoPE
    bool qk_norm_all_heads = false;  // OLMo 2: qk_norm over all of q's (k's) heads at once, q_norm [Hq D]
    bool pre_norms = true;  // RMSNorm on the attention's and the MLP's inputs (OLMo 2: none, they read the residual)
    std::vector<bool> use_rope;  // per layer: q and k rotated (SmolLM3's NoPE layers: false); empty: all
    // per layer: its sliding window (a query reads its last `window` tokens), 0: full attention;
    // empty: every layer full
    std::vector<int64_t> windows;
    // Gemma's switches (0 / false / empty: Llama's): q · k scaled by attn_scale (0: 1 / sqrt(head_dim)),
    // scores and final logits soft-capped, tanh(s / cap) * cap; embeddings times embed_scale rounded to
    // the model dtype; GeGLU in place of SwiGLU; per layer, RoPE by LlamaWeights::cos_sin_local
    float attn_scale = 0.f;
    float attn_softcap = 0.f;
    float logit_softcap = 0.f;
    float embed_scale = 0.f;
    bool gelu = false;
    std::vector<bool> local_rope;
    // W4A16 and W8A16 matmuls take x quantized to int8 per 32 k (W4A8 of lib/kernels/csrc/cpu/gemm.h,
    // W8A8 by groups of quant.h): llama.cpp's Q4 / Q8_0 x Q8 arithmetic, no longer float-exact
    bool int8_activations = false;
    // > 0: DeepSeek-V2's latent attention (mla.h) on every layer, whose cache holds one row of this many
    // elements a token (no V cache)
    int64_t mla_cache_dim = 0;
};

// Views of the weights, fused as the kernels want them; the Python side keeps the
// memory alive for the model's lifetime. Optional tensors have data == nullptr.

// One matmul's weights (layouts in lib/kernels/csrc/cpu/quant.h and gemm.h): float [N, K] in the model
// dtype, or the same packed in panels [ceil(N / 16), K, 16] (`packed`: what turbomind/model.py
// hands over); W4A16 (qweight uint8 [N, K/2], scales and mins float32 [N, K/G], or the same
// in panels 64 wide: int32 [P4, K/8, 64], float32 [P4, K/G, 64]); W8A16
// (qweight int8 [N, K], scales float32 [N, K/G], or in panels 16 wide: int8 [P, K, 16],
// float32 or float16 [P, K/G, 16]); or W8A8 (qweight int8 [N, K], scales
// float32 [N], activations quantized per token); or GGUF blocks as stored, in parts of one block
// type each (`gguf`); or W4A16 parts (`parts`). G is per matmul: K / scales.size(1). Bias
// [N]: the model dtype for float weights, float32 for quantized ones; or none.
// A W4A16 matmul may read its input permuted (`perm`, int32 [K]): y = x[:, perm] · w'ᵀ, the weight's k
// stored in perm's order (GPTQ act-order: its groups are then runs of G consecutive k).
// GGUF blocks as the file stores them (lib/kernels/csrc/cpu/gguf.h): rows [n0, n0 + raw.size(0)) of
// the matmul, of one ggml block type.
struct GgufPart {
    TensorView raw;  // uint8 [rows, K / QK * B]
    int type = 0;
    int64_t n0 = 0;
};

struct LinearWeights {
    std::vector<GgufPart> gguf;  // when not empty: the matmul, in runs of one block type each
    // when not empty: the matmul in parts, part i the next part_rows[i] columns of the output with a
    // bias of its own (fused parts over differently permuted x: GPTQ act-order q, k, v)
    std::vector<LinearWeights> parts;
    std::vector<int64_t> part_rows;
    TensorView weight;
    TensorView packed;
    TensorView qweight, scales, mins;
    TensorView perm;  // int32 [K], a permutation of 0..K-1, or none
    int64_t group_size = 0;
    TensorView bias;
    bool quantized() const { return qweight.data != nullptr || !gguf.empty() || !parts.empty(); }
};

struct MoeWeights;  // moe.h
struct MlaWeights;  // mla.h

struct LlamaLayerWeights {
    TensorView input_norm;   // [H], or none (LlamaConfig::pre_norms false)
    LinearWeights qkv;       // [(Hq + 2 Hk) D, H]
    TensorView q_norm;       // [D]; [Hq D] with LlamaConfig::qk_norm_all_heads
    TensorView k_norm;       // [D]; [Hk D] likewise
    LinearWeights o;         // [H, Hq D]
    TensorView post_norm;    // [H] before the MLP, or none (LlamaConfig::pre_norms false)
    TensorView attn_out_norm;  // [H] on the attention's output (Gemma), or none
    TensorView mlp_out_norm;   // [H] on the MLP's output (Gemma), or none
    LinearWeights gate_up;   // [2 I, H]
    LinearWeights down;      // [H, I]
    std::shared_ptr<const MoeWeights> moe;  // a sparse layer's experts in place of gate_up / down (moe.h)
    std::shared_ptr<const MlaWeights> mla;  // latent attention in place of qkv (mla.h; o is then [H, Hq v])
    TensorView sinks;        // float32 [Hq]: each head's sink logit in its softmax (gpt-oss), or none
};

struct LlamaWeights {
    TensorView embed;        // [V, H]; none when tied to a packed lm_head (rows come from its panels)
    TensorView norm;         // [H]
    LinearWeights lm_head;   // [V, H] (the embedding when tied and not quantized)
    TensorView cos_sin;      // [max_position, rot] = cat(cos, sin), the model dtype
    TensorView cos_sin_local;  // the same for LlamaConfig::local_rope layers (Gemma 3's sliding ones), or none
    std::vector<LlamaLayerWeights> layers;
};

// A LoRA adapter (lmd/lora.py), per layer the (A, B) of each fused matmul it adapts: a [R, K] and
// b [N, R] in the model dtype, the scale folded into b; a.data == nullptr where it adapts none. Added
// to the matmul's output for the rows that run it (cpu::lora_apply), after any bias, on the matmul's
// input as the layer hands it over (before a GPTQ permutation of x). Dense layers only: a mixture
// of experts' MLP and latent attention have none.
struct LoraLayerWeights {
    cpu::LoraWeights qkv, o, gate_up, down;
};

struct LoraAdapterWeights {
    std::vector<LoraLayerWeights> layers;  // one per layer
    std::vector<std::unique_ptr<uint8_t[]>> memory;  // what the views point into (LlamaModel::set_adapter's copies)
};

// The adapters a model serves, by slot (lmd.lora.AdapterSlot.slot: small ints, reused after an
// unload). Shared by a model and its twins (LlamaModel::share_adapters). Loading or unloading swaps
// a slot's pointer under the mutex from any thread; a step takes the mutex once, for a snapshot of
// the pointers, and the weights it reads stay alive with its snapshot until the step ends.
class AdapterSlots {
public:
    void set(int32_t slot, std::shared_ptr<const LoraAdapterWeights> weights);  // null: empty the slot
    std::vector<std::shared_ptr<const LoraAdapterWeights>> snapshot() const;

private:
    mutable std::mutex mutex_;
    std::vector<std::shared_ptr<const LoraAdapterWeights>> slots_;
};

// What one forward pass runs: T token rows of S sequences, R rows of which want logits. A
// sequence's block table is given once, however many of its rows the step runs (a prefill chunk
// and decodes mix freely).
struct StepInputs {
    const int64_t * token_ids = nullptr;     // [T]
    const int64_t * positions = nullptr;     // [T]
    const int64_t * slots = nullptr;         // [T] block * block_size + offset where the row's K/V goes
    const int32_t * row_seqs = nullptr;      // [T] the sequence of each row: its row of block_tables
    const int32_t * row_lens = nullptr;      // [T] tokens each row attends to (itself included)
    const int32_t * block_tables = nullptr;  // [S, max_blocks] each sequence's blocks, in order
    const int64_t * logit_rows = nullptr;    // [R] rows whose logits are wanted
    // [T] the LoRA adapter slot each row runs (-1: the base model); nullptr when no row has one
    const int32_t * row_adapters = nullptr;
    int64_t num_tokens = 0;
    int64_t num_seqs = 0;
    int64_t max_blocks = 0;
    int64_t num_logit_rows = 0;
};

class LlamaModel {
public:
    // quant_policy: 0 keeps K/V in the model dtype; 8 / 4 quantizes them per token and head
    // (kernels.h, KVQuant).
    LlamaModel(const LlamaConfig & config, LlamaWeights weights, DType dtype, int64_t num_blocks,
               int64_t block_size, int quant_policy = 0);

    // logits: [R, V] float32, written.
    void forward(const StepInputs & in, float * logits);
    // The same pass without the head: hidden [R, H] float32, written with the final norm's output
    // for the logit rows (what an embedder pools).
    void hidden_states(const StepInputs & in, float * hidden);

    const LlamaConfig & config() const { return config_; }
    DType dtype() const { return dtype_; }
    int64_t num_blocks() const { return num_blocks_; }
    int64_t block_size() const { return block_size_; }
    int quant_policy() const { return quant_policy_; }
    int64_t kv_bytes() const;

    // LoRA adapters (AdapterSlots): `weights` (views, checked against the model's layers, shapes and
    // dtype; std::invalid_argument naming what does not fit) copied into slot `slot`, which rows of
    // StepInputs::row_adapters then run; any thread, while steps run.
    void set_adapter(int32_t slot, const LoraAdapterWeights & weights);
    void clear_adapter(int32_t slot);
    // From now on this model serves other's adapters (a twin over the same weights, turbomind/model.py).
    void share_adapters(const LlamaModel & other) { adapters_ = other.adapters_; }

private:
    LlamaConfig config_;
    LlamaWeights weights_;
    DType dtype_;
    int64_t num_blocks_;
    int64_t block_size_;
    int quant_policy_;
    // per layer K and V: [num_blocks, block_size, Hk, D] in the model dtype, or uint8
    // [num_blocks, block_size, Hk, D * bits / 8] codes with float32 (scale, zero) pairs in
    // k_params_ / v_params_ [num_blocks, block_size, Hk, 2]; never zeroed: the kernels read
    // only slots that were written
    std::vector<std::unique_ptr<uint8_t[]>> k_cache_, v_cache_;
    std::vector<std::unique_ptr<float[]>> k_params_, v_params_;
    int64_t row_bytes() const;  // bytes of one (token, head) row of K or V
    std::shared_ptr<AdapterSlots> adapters_ = std::make_shared<AdapterSlots>();
};

}  // namespace turbomind
