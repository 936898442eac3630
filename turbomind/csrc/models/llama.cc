#include "models/llama.h"
#include "models/mla.h"
#include "models/moe.h"
#include "models/views.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "cpu/gemm.h"
#include "cpu/gguf.h"
#include "cpu/kernels.h"
#include "cpu/lora.h"
#include "cpu/quant.h"

namespace turbomind {

namespace {

const TensorView * opt(const TensorView & t) { return t.data ? &t : nullptr; }

// Columns [n0, n0 + n) of y (rows keep y's stride), and of a bias.
TensorView columns(const TensorView & t, int64_t n0, int64_t n) {
    TensorView v = t;
    v.data = static_cast<uint8_t *>(t.data) + n0 * t.stride(t.ndim - 1) * dtype_size(t.dtype);
    v.shape[t.ndim - 1] = n;
    return v;
}

// x[:, perm] into thread-local scratch: [M, K] contiguous, x's dtype (any row stride in x).
TensorView gather_columns(const TensorView & x, const TensorView & perm) {
    static thread_local Scratch b_gather;
    const int64_t M = x.size(0), K = perm.size(0), ld = x.stride(0);
    const int32_t * p = perm.ptr<int32_t>();
    TensorView out = view(b_gather.get(M * K * dtype_size(x.dtype)), x.dtype, {M, K});
    auto gather = [&](auto * dst, const auto * src) {
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t k = 0; k < K; ++k) dst[m * K + k] = src[m * ld + p[k]];
        }
    };
    if (dtype_size(x.dtype) == 4) {
        gather(static_cast<uint32_t *>(out.data), static_cast<const uint32_t *>(x.data));
    } else {
        gather(static_cast<uint16_t *>(out.data), static_cast<const uint16_t *>(x.data));
    }
    return out;
}

void apply(const TensorView & x_in, const LinearWeights & w, const TensorView & y, bool int8_activations) {
    if (!w.parts.empty()) {
        int64_t n0 = 0;
        for (size_t i = 0; i < w.parts.size(); ++i) {
            apply(x_in, w.parts[i], columns(y, n0, w.part_rows[i]), int8_activations);
            n0 += w.part_rows[i];
        }
        return;
    }
    const TensorView x = w.perm.data ? gather_columns(x_in, w.perm) : x_in;
    if (!w.gguf.empty()) {
        for (const GgufPart & p : w.gguf) {
            const int64_t n = p.raw.size(0);
            const TensorView bias = w.bias.data ? columns(w.bias, p.n0, n) : TensorView();
            cpu::linear_gguf(x, p.raw, p.type, opt(bias), columns(y, p.n0, n), int8_activations);
        }
    } else if (w.quantized() && w.qweight.dtype == DType::i8 && w.scales.ndim == 1) {
        cpu::linear_w8a8(x, w.qweight, w.scales, opt(w.bias), y);
    } else if (w.quantized() && w.qweight.dtype == DType::i8 && w.qweight.ndim == 3) {
        cpu::linear_w8a16_packed(x, w.qweight, w.scales, opt(w.bias), y);
    } else if (w.quantized() && w.qweight.dtype == DType::i8 && int8_activations) {
        cpu::linear_w8a8_group(x, w.qweight, w.scales, opt(w.bias), y, w.group_size);
    } else if (w.quantized() && w.qweight.dtype == DType::i8) {
        cpu::linear_w8a16(x, w.qweight, w.scales, opt(w.bias), y, w.group_size);
    } else if (w.quantized() && w.qweight.ndim == 3 && int8_activations) {
        cpu::linear_w4a8_packed(x, w.qweight, w.scales, w.mins, opt(w.bias), y);
    } else if (w.quantized() && w.qweight.ndim == 3) {
        cpu::linear_w4a16_packed(x, w.qweight, w.scales, w.mins, opt(w.bias), y);
    } else if (w.quantized()) {
        cpu::linear_w4a16(x, w.qweight, w.scales, w.mins, opt(w.bias), y, w.group_size);
    } else if (w.packed.data) {
        cpu::linear_packed(x, w.packed, opt(w.bias), y);
    } else {
        cpu::linear(x, w.weight, opt(w.bias), y);
    }
}

// acc += d elementwise, each sum rounded to the dtype (the residual add of a layer without pre-norms).
void add_in_place(const TensorView & acc, const TensorView & d) {
    const int64_t n = acc.numel();
    for (int64_t i = 0; i < n; ++i) {
        store_f32(acc.data, i, acc.dtype, load_f32(acc.data, i, acc.dtype) + load_f32(d.data, i, d.dtype));
    }
}

}  // namespace

void apply_linear(const TensorView & x, const LinearWeights & w, const TensorView & y, bool int8_activations) {
    apply(x, w, y, int8_activations);
}

LlamaModel::LlamaModel(const LlamaConfig & config, LlamaWeights weights, DType dtype, int64_t num_blocks,
                       int64_t block_size, int quant_policy)
    : config_(config), weights_(std::move(weights)), dtype_(dtype), num_blocks_(num_blocks), block_size_(block_size),
      quant_policy_(quant_policy) {
    if (quant_policy != 0 && quant_policy != 4 && quant_policy != 8) {
        throw std::invalid_argument("LlamaModel: quant_policy " + std::to_string(quant_policy) + " is not 0, 4 or 8");
    }
    if (quant_policy == 4 && config_.head_dim % 2) {
        throw std::invalid_argument("LlamaModel: quant_policy 4 needs an even head_dim");
    }
    // the per-layer settings: empty (every layer alike) or one entry a layer
    const std::pair<const char *, size_t> per_layer[] = {
        {"use_rope", config_.use_rope.size()}, {"local_rope", config_.local_rope.size()},
        {"windows", config_.windows.size()}};
    for (const auto & [name, n] : per_layer) {
        if (n != 0 && static_cast<int64_t>(n) != config_.num_layers) {
            throw std::invalid_argument(std::string("LlamaModel: ") + name + " has " + std::to_string(n) +
                                        " entries for " + std::to_string(config_.num_layers) + " layers");
        }
    }
    if (static_cast<int64_t>(weights_.layers.size()) != config_.num_layers) {
        throw std::invalid_argument("LlamaModel: " + std::to_string(weights_.layers.size()) + " layers of weights for " +
                                    std::to_string(config_.num_layers) + " layers");
    }
    if (config_.mla_cache_dim > 0 && quant_policy) {
        throw std::invalid_argument("LlamaModel: the latent KV cache (mla_cache_dim) is not quantized; quant_policy must be 0");
    }
    const size_t rows = static_cast<size_t>(num_blocks * block_size * config_.num_kv_heads);
    for (int64_t l = 0; l < config_.num_layers; ++l) {
        if (config_.mla_cache_dim > 0) {  // one latent row a token (mla.h), kept in k_cache_
            k_cache_.emplace_back(new uint8_t[num_blocks * block_size * config_.mla_cache_dim * dtype_size(dtype_)]);
            continue;
        }
        // new T[] without () leaves the pages untouched until a block is first written
        k_cache_.emplace_back(new uint8_t[rows * row_bytes()]);
        v_cache_.emplace_back(new uint8_t[rows * row_bytes()]);
        if (quant_policy_) {
            k_params_.emplace_back(new float[rows * 2]);
            v_params_.emplace_back(new float[rows * 2]);
        }
    }
}

// ---- LoRA adapters

void AdapterSlots::set(int32_t slot, std::shared_ptr<const LoraAdapterWeights> weights) {
    std::shared_ptr<const LoraAdapterWeights> old;  // let go after the lock: a step may still hold it
    std::lock_guard<std::mutex> lock(mutex_);
    if (slot >= static_cast<int32_t>(slots_.size())) slots_.resize(slot + 1);
    old = std::move(slots_[slot]);
    slots_[slot] = std::move(weights);
}

std::vector<std::shared_ptr<const LoraAdapterWeights>> AdapterSlots::snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return slots_;
}

void LlamaModel::set_adapter(int32_t slot, const LoraAdapterWeights & weights) {
    const LlamaConfig & c = config_;
    if (slot < 0) throw std::invalid_argument("set_adapter: slot " + std::to_string(slot) + " must be >= 0");
    if (static_cast<int64_t>(weights.layers.size()) != c.num_layers) {
        throw std::invalid_argument("the adapter has " + std::to_string(weights.layers.size()) + " layers; the model has " +
                                    std::to_string(c.num_layers));
    }
    const int64_t H = c.hidden_size, qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
    auto copy = std::make_shared<LoraAdapterWeights>();
    copy->layers.resize(weights.layers.size());
    // one matmul's pair, checked against [R, K] and [N, R], copied into memory of the adapter's own
    auto take = [&](int64_t l, const char * name, const cpu::LoraWeights & w, int64_t N, int64_t K, bool allowed,
                    cpu::LoraWeights & out) {
        if (!w.a.data && !w.b.data) return;
        const std::string where = "layer " + std::to_string(l) + " " + name + ": ";
        if (!allowed) throw std::invalid_argument(where + "this layer has no such dense matmul (experts or latent attention)");
        const TensorView & a = w.a, & b = w.b;
        if (!a.data || !b.data) throw std::invalid_argument(where + "A and B come together");
        auto dims = [](const TensorView & v) {
            std::string d = "[";
            for (int i = 0; i < v.ndim; ++i) d += (i ? ", " : "") + std::to_string(v.shape[i]);
            return d + "]";
        };
        if (a.ndim != 2 || b.ndim != 2 || a.size(1) != K || b.size(0) != N || b.size(1) != a.size(0)) {
            throw std::invalid_argument(where + "A " + dims(a) + " and B " + dims(b) + " do not fit [R, " +
                                        std::to_string(K) + "] and [" + std::to_string(N) + ", R]");
        }
        if (a.dtype != dtype_ || b.dtype != dtype_ || !a.contiguous() || !b.contiguous()) {
            throw std::invalid_argument(where + "A and B must be contiguous " + dtype_name(dtype_) + " (the model dtype)");
        }
        for (const TensorView * src : {&a, &b}) {
            const size_t bytes = static_cast<size_t>(src->numel()) * dtype_size(dtype_);
            copy->memory.emplace_back(new uint8_t[bytes]);
            std::memcpy(copy->memory.back().get(), src->data, bytes);
            TensorView & dst = src == &a ? out.a : out.b;
            dst = *src;
            dst.data = copy->memory.back().get();
        }
    };
    for (int64_t l = 0; l < c.num_layers; ++l) {
        const LlamaLayerWeights & lw = weights_.layers[l];
        const LoraLayerWeights & in = weights.layers[l];
        LoraLayerWeights & out = copy->layers[l];
        take(l, "qkv", in.qkv, qkv, H, !lw.mla, out.qkv);
        take(l, "o", in.o, H, c.num_heads * c.head_dim, !lw.mla, out.o);
        take(l, "gate_up", in.gate_up, 2 * c.intermediate_size, H, !lw.moe, out.gate_up);
        take(l, "down", in.down, H, c.intermediate_size, !lw.moe, out.down);
    }
    adapters_->set(slot, std::move(copy));
}

void LlamaModel::clear_adapter(int32_t slot) {
    if (slot >= 0) adapters_->set(slot, nullptr);
}

int64_t LlamaModel::row_bytes() const {
    const int64_t D = config_.head_dim;
    return quant_policy_ ? D * quant_policy_ / 8 : D * static_cast<int64_t>(dtype_size(dtype_));
}

int64_t LlamaModel::kv_bytes() const {
    if (config_.mla_cache_dim > 0) {
        return config_.num_layers * num_blocks_ * block_size_ * config_.mla_cache_dim * static_cast<int64_t>(dtype_size(dtype_));
    }
    const int64_t per_row = row_bytes() + (quant_policy_ ? 2 * sizeof(float) : 0);
    return 2 * config_.num_layers * num_blocks_ * block_size_ * config_.num_kv_heads * per_row;
}

void LlamaModel::forward(const StepInputs & in, float * logits) {
    const LlamaConfig & c = config_;
    const int64_t R = in.num_logit_rows;
    static thread_local Scratch b_out;
    TensorView hidden = view(b_out.get(R * c.hidden_size * sizeof(float)), DType::f32, {R, c.hidden_size});
    hidden_states(in, hidden.ptr<float>());
    if (in.num_tokens == 0 || R == 0) return;
    // the head, only for the rows whose logits are wanted
    TensorView out = view(logits, DType::f32, {R, c.vocab_size});
    apply(hidden, weights_.lm_head, out, c.int8_activations);
    if (c.logit_softcap > 0.f) {
        float * o = out.ptr<float>();
        for (int64_t i = 0; i < R * c.vocab_size; ++i) o[i] = c.logit_softcap * std::tanh(o[i] / c.logit_softcap);
    }
}

void LlamaModel::hidden_states(const StepInputs & in, float * hidden) {
    const LlamaConfig & c = config_;
    const int64_t T = in.num_tokens, H = c.hidden_size, D = c.head_dim;
    const int64_t q_size = c.num_heads * D, qkv_size = (c.num_heads + 2 * c.num_kv_heads) * D;
    const int64_t I2 = 2 * c.intermediate_size;
    const size_t es = dtype_size(dtype_);
    const float eps = c.rms_norm_eps;
    const float scale = c.attn_scale > 0.f ? c.attn_scale : 1.0f / std::sqrt(static_cast<float>(D));
    if (T == 0) return;

    static thread_local Scratch b_res, b_x, b_qkv, b_q, b_attn, b_delta, b_gu, b_act;
    TensorView residual = view(b_res.get(T * H * es), dtype_, {T, H});
    TensorView x = view(b_x.get(T * H * es), dtype_, {T, H});
    TensorView qkv = view(b_qkv.get(T * qkv_size * es), dtype_, {T, qkv_size});
    TensorView q = view(b_q.get(T * q_size * es), dtype_, {T, c.num_heads, D});
    TensorView attn = view(b_attn.get(T * q_size * es), dtype_, {T, c.num_heads, D});
    TensorView attn2d = view(attn.data, dtype_, {T, q_size});
    TensorView delta = view(b_delta.get(T * H * es), dtype_, {T, H});
    TensorView gu = view(b_gu.get(T * I2 * es), dtype_, {T, I2});
    TensorView act = view(b_act.get(T * c.intermediate_size * es), dtype_, {T, c.intermediate_size});

    TensorView pos = view(const_cast<int64_t *>(in.positions), DType::i64, {T});
    TensorView slots = view(const_cast<int64_t *>(in.slots), DType::i64, {T});
    TensorView tables = view(const_cast<int32_t *>(in.block_tables), DType::i32, {in.num_seqs, in.max_blocks});
    TensorView row_seqs = view(const_cast<int32_t *>(in.row_seqs), DType::i32, {T});
    TensorView lens = view(const_cast<int32_t *>(in.row_lens), DType::i32, {T});

    // embedding rows (a tied embedding is read out of the packed lm_head's panels)
    const auto * embed = static_cast<const uint8_t *>(weights_.embed.data);
    for (int64_t t = 0; t < T; ++t) {
        void * row = static_cast<uint8_t *>(residual.data) + t * H * es;
        if (embed) {
            std::memcpy(row, embed + in.token_ids[t] * H * es, H * es);
        } else {
            cpu::packed_row(weights_.lm_head.packed, in.token_ids[t], row);
        }
    }
    if (c.embed_scale > 0.f) {  // HF multiplies by the scale rounded to the model dtype
        float rounded = 0.f;
        store_f32(&rounded, 0, dtype_, c.embed_scale);
        const float s = load_f32(&rounded, 0, dtype_);
        for (int64_t i = 0; i < T * H; ++i) store_f32(residual.data, i, dtype_, load_f32(residual.data, i, dtype_) * s);
    }
    // LoRA: the adapters of this step's rows, fixed for the whole step (AdapterSlots); y += its
    // rows' (x Aᵀ) Bᵀ after a matmul, x as the matmul was handed it
    std::vector<std::shared_ptr<const LoraAdapterWeights>> adapters;
    if (in.row_adapters) adapters = adapters_->snapshot();
    static thread_local std::vector<cpu::LoraWeights> lora_slots;
    auto lora = [&](int64_t l, cpu::LoraWeights LoraLayerWeights::*matmul, const TensorView & x, const TensorView & y) {
        if (adapters.empty()) return;
        lora_slots.assign(adapters.size(), cpu::LoraWeights{});
        bool any = false;
        for (size_t s = 0; s < adapters.size(); ++s) {
            if (!adapters[s]) continue;
            lora_slots[s] = adapters[s]->layers[l].*matmul;
            any = any || lora_slots[s].a.data != nullptr;
        }
        if (any) cpu::lora_apply(x, y, in.row_adapters, lora_slots.data(), static_cast<int64_t>(lora_slots.size()));
    };
    const int64_t cache_shape[4] = {num_blocks_, block_size_, c.num_kv_heads, D};
    for (int64_t l = 0; l < c.num_layers; ++l) {
        const LlamaLayerWeights & w = weights_.layers[l];
        const DType cache_dtype = quant_policy_ ? DType::u8 : dtype_;
        const int64_t row = quant_policy_ ? row_bytes() : D;
        TensorView kc = view(k_cache_[l].get(), cache_dtype, {cache_shape[0], cache_shape[1], cache_shape[2], row});
        TensorView vc = view(v_cache_.empty() ? nullptr : v_cache_[l].get(), cache_dtype,  // none: latent (mla.h)
                             {cache_shape[0], cache_shape[1], cache_shape[2], row});
        cpu::KVQuant kvq;
        if (quant_policy_) {
            kvq.bits = quant_policy_;
            kvq.k_params = view(k_params_[l].get(), DType::f32, {cache_shape[0], cache_shape[1], cache_shape[2], 2});
            kvq.v_params = view(v_params_[l].get(), DType::f32, {cache_shape[0], cache_shape[1], cache_shape[2], 2});
        }
        const cpu::KVQuant * kv_quant = quant_policy_ ? &kvq : nullptr;
        if (!w.input_norm.data) {  // no pre-norm (OLMo 2): the attention reads the residual stream itself
            if (l > 0) add_in_place(residual, delta);
        } else if (l == 0) {
            cpu::rms_norm(residual, w.input_norm, eps, x, nullptr);
        } else {
            cpu::rms_norm(delta, w.input_norm, eps, x, &residual);
        }
        if (w.mla) {  // DeepSeek-V2's latent attention (mla.h): one cache row a token, o_proj included
            const TensorView cache = view(k_cache_[l].get(), dtype_, {num_blocks_, block_size_, 1, c.mla_cache_dim});
            mla_attention(*w.mla, w.o, c.num_heads, eps, scale, w.input_norm.data ? x : residual, pos, weights_.cos_sin,
                          cache, slots, tables, row_seqs, lens, delta, c.int8_activations);
        } else {
            const TensorView & attn_in = w.input_norm.data ? x : residual;
            apply(attn_in, w.qkv, qkv, c.int8_activations);
            lora(l, &LoraLayerWeights::qkv, attn_in, qkv);
            if (c.qk_norm) {  // in place, token by token: rows of [heads, D] (or of all heads at once) inside qkv
                const int64_t q_rows = c.qk_norm_all_heads ? 1 : c.num_heads;
                const int64_t k_rows = c.qk_norm_all_heads ? 1 : c.num_kv_heads;
                for (int64_t t = 0; t < T; ++t) {
                    auto * row = static_cast<uint8_t *>(qkv.data) + t * qkv_size * es;
                    TensorView qh = view(row, dtype_, {q_rows, c.num_heads * D / q_rows});
                    TensorView kh = view(row + q_size * es, dtype_, {k_rows, c.num_kv_heads * D / k_rows});
                    cpu::rms_norm(qh, w.q_norm, eps, qh, nullptr);
                    cpu::rms_norm(kh, w.k_norm, eps, kh, nullptr);
                }
            }
            // a NoPE layer reads a table of no rotary dims: every dim of q and k passes through
            const bool rope = c.use_rope.empty() || c.use_rope[l];
            const bool local = !c.local_rope.empty() && c.local_rope[l];
            const TensorView & table = local ? weights_.cos_sin_local : weights_.cos_sin;
            const TensorView cos_sin = rope ? table : columns(table, 0, 0);
            cpu::rope_fill_kv(qkv, pos, cos_sin, kc, vc, slots, q, c.num_heads, c.num_kv_heads, kv_quant);
            const int64_t window = c.windows.empty() ? 0 : c.windows[l];
            cpu::paged_decode_attention(q, kc, vc, tables, row_seqs, lens, scale, attn, kv_quant, false, window,
                                        c.attn_softcap, w.sinks.data ? w.sinks.ptr<float>() : nullptr);
            apply(attn2d, w.o, delta, c.int8_activations);
            lora(l, &LoraLayerWeights::o, attn2d, delta);
        }
        if (w.attn_out_norm.data) cpu::rms_norm(delta, w.attn_out_norm, eps, delta, nullptr);
        if (w.post_norm.data) {
            cpu::rms_norm(delta, w.post_norm, eps, x, &residual);
        } else {  // no pre-norm (OLMo 2): the MLP reads the residual stream itself
            add_in_place(residual, delta);
        }
        const TensorView & mlp_in = w.post_norm.data ? x : residual;
        if (w.moe) {
            moe_forward(*w.moe, mlp_in, delta, c.int8_activations);
        } else {
            apply(mlp_in, w.gate_up, gu, c.int8_activations);
            lora(l, &LoraLayerWeights::gate_up, mlp_in, gu);
            if (c.gelu) {
                cpu::gelu_tanh_and_mul(gu, act);
            } else {
                cpu::silu_and_mul(gu, act);
            }
            apply(act, w.down, delta, c.int8_activations);
            lora(l, &LoraLayerWeights::down, act, delta);
        }
        if (w.mlp_out_norm.data) cpu::rms_norm(delta, w.mlp_out_norm, eps, delta, nullptr);
    }
    // the final norm, only for the rows whose logits (or hidden states) are wanted
    const int64_t R = in.num_logit_rows;
    if (R == 0) return;
    cpu::rms_norm(delta, weights_.norm, eps, x, &residual);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t row = in.logit_rows[r];
        for (int64_t i = 0; i < H; ++i) hidden[r * H + i] = load_f32(x.data, row * H + i, dtype_);
    }
}

}  // namespace turbomind
