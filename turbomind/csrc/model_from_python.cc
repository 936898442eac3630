// A LlamaModel from what turbomind/model.py hands over: its config dict and its tensors by name
// (lmd.weights.turbomind_layout's names), each checked against the shape and dtype the config implies
// and viewed in place (no copy); the Python objects whose memory the views borrow go to `owners`.
#include "model_from_python.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <string>

#include "core/py_tensor.h"
#include "cpu/gguf.h"
#include "cpu/quant.h"
#include "models/mla.h"
#include "models/moe.h"

namespace turbomind {

namespace {

DType parse_dtype(const std::string & s) {
    if (s == "float32") return DType::f32;
    if (s == "bfloat16") return DType::bf16;
    if (s == "float16") return DType::f16;
    fail("dtype " + s + " is not supported; use float32, bfloat16 or float16");
}

int64_t get_int(const py::dict & d, const char * key) {
    if (!d.contains(key)) fail(std::string("LlamaModel config: missing ") + key);
    return d[key].cast<int64_t>();
}

}  // namespace

std::shared_ptr<LlamaModel> model_from_python(const py::dict & cfg, const py::dict & tensors,
                                              const std::string & dtype_name_, int64_t num_blocks,
                                              int64_t block_size, int quant_policy, py::list & owners) {
    LlamaConfig c;
    c.hidden_size = get_int(cfg, "hidden_size");
    c.intermediate_size = get_int(cfg, "intermediate_size");
    c.num_layers = get_int(cfg, "num_layers");
    c.num_heads = get_int(cfg, "num_heads");
    c.num_kv_heads = get_int(cfg, "num_kv_heads");
    c.head_dim = get_int(cfg, "head_dim");
    c.vocab_size = get_int(cfg, "vocab_size");
    c.rms_norm_eps = cfg["rms_norm_eps"].cast<float>();
    c.qk_norm = cfg.contains("qk_norm") && cfg["qk_norm"].cast<bool>();
    c.qk_norm_all_heads = cfg.contains("qk_norm_all_heads") && cfg["qk_norm_all_heads"].cast<bool>();
    c.pre_norms = !cfg.contains("pre_norms") || cfg["pre_norms"].cast<bool>();
    if (cfg.contains("use_rope")) c.use_rope = cfg["use_rope"].cast<std::vector<bool>>();
    if (cfg.contains("windows")) c.windows = cfg["windows"].cast<std::vector<int64_t>>();
    for (int64_t w : c.windows) {
        if (w < 0) fail("windows: a layer's sliding window must be >= 0 (0: full attention), got " + std::to_string(w));
    }
    c.int8_activations = cfg.contains("int8_activations") && cfg["int8_activations"].cast<bool>();
    auto get_float = [&](const char * key) { return cfg.contains(key) ? cfg[key].cast<float>() : 0.f; };
    c.attn_scale = get_float("attn_scale");
    c.attn_softcap = get_float("attn_softcap");
    c.logit_softcap = get_float("logit_softcap");
    c.embed_scale = get_float("embed_scale");
    if (c.attn_scale < 0.f || c.attn_softcap < 0.f || c.logit_softcap < 0.f || c.embed_scale < 0.f) {
        fail("LlamaModel config: attn_scale, attn_softcap, logit_softcap and embed_scale must be >= 0 (0: none)");
    }
    c.gelu = cfg.contains("gelu") && cfg["gelu"].cast<bool>();
    if (cfg.contains("local_rope")) c.local_rope = cfg["local_rope"].cast<std::vector<bool>>();
    py::dict mla_cfg;  // DeepSeek-V2's latent attention (mla.h): kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    if (cfg.contains("mla")) {
        mla_cfg = cfg["mla"].cast<py::dict>();
        c.mla_cache_dim = get_int(mla_cfg, "kv_lora_rank") + get_int(mla_cfg, "qk_rope_head_dim");
        if (get_int(mla_cfg, "kv_lora_rank") < 1 || get_int(mla_cfg, "qk_rope_head_dim") != c.head_dim ||
            get_int(mla_cfg, "qk_nope_head_dim") < 1 || get_int(mla_cfg, "v_head_dim") < 1) {
            fail("LlamaModel config: mla needs kv_lora_rank, qk_nope_head_dim, v_head_dim >= 1 and qk_rope_head_dim "
                 "equal to head_dim (the rotary table's width)");
        }
    }
    if (num_blocks < 1 || block_size < 1) fail("num_blocks and block_size must be >= 1");
    const DType dt = parse_dtype(dtype_name_);
    const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
    const int64_t qkv = (c.num_heads + 2 * c.num_kv_heads) * D;

    // one weight by name, checked against its expected shape and the model dtype
    auto take = [&](const std::string & name, std::initializer_list<int64_t> shape, bool required) {
        TensorView v;
        if (!tensors.contains(name) || tensors[py::str(name)].is_none()) {
            if (required) fail("LlamaModel: missing weight " + name);
            return v;
        }
        py::object obj = tensors[py::str(name)];
        v = view_of(obj, name.c_str());
        std::string want = "[";
        int i = 0;
        bool ok = v.ndim == static_cast<int>(shape.size());
        for (int64_t s : shape) {
            want += (i ? ", " : "") + std::to_string(s);
            ok = ok && v.shape[i] == s;
            ++i;
        }
        expect(ok && v.contiguous() && v.dtype == dt, name.c_str(), v,
               "expected a contiguous " + dtype_name_ + " " + want + "]");
        owners.append(obj);
        return v;
    };
    // a float matmul weight packed in panels, [ceil(N / 16), K, 16] (lib/kernels/csrc/cpu/gemm.h)
    auto is_packed = [&](const std::string & name) {
        return tensors.contains(name) && !tensors[py::str(name)].is_none() &&
               view_of(tensors[py::str(name)], name.c_str()).ndim == 3;
    };
    // a quantized tensor by name, checked against its dtype and shape
    auto raw = [&](const std::string & n, DType want, std::initializer_list<int64_t> shape) {
        if (!tensors.contains(n)) fail("LlamaModel: missing weight " + n);
        py::object obj = tensors[py::str(n)];
        TensorView v = view_of(obj, n.c_str());
        bool ok = v.ndim == static_cast<int>(shape.size()) && v.contiguous() && v.dtype == want;
        int i = 0;
        for (int64_t d : shape) ok = ok && v.shape[i++] == d;
        expect(ok, n.c_str(), v, std::string("expected a contiguous ") + dtype_name(want) + " quantized tensor");
        owners.append(obj);
        return v;
    };
    // a quantized matmul "<name>.qweight/.scales[/.mins]": W4A16 (mins there; or in panels,
    // lib/kernels/csrc/cpu/gemm.h), W8A16 (int8, scales [N, K/G]; or in panels) or W8A8 (int8, scales [N]), with the
    // group size G = K / scales.size(1) a multiple of 32 (of 16 for W8A16 in panels); "<name>.perm" (the matmul over x[:, perm]) and
    // "<name>_bias" optional
    auto quantized = [&](const std::string & name, int64_t N, int64_t K) {
        LinearWeights lw;
        const std::string sn = name + ".scales";
        if (!tensors.contains(sn)) fail("LlamaModel: missing weight " + sn);
        const TensorView s = view_of(tensors[py::str(sn)], sn.c_str());
        const bool w4 = tensors.contains(name + ".mins");
        if (!w4 && s.ndim == 1) {  // W8A8
            if (K > cpu::kW8A8MaxK) fail("LlamaModel: " + name + " has K = " + std::to_string(K) + ", more than W8A8 takes");
            lw.qweight = raw(name + ".qweight", DType::i8, {N, K});
            lw.scales = raw(sn, DType::f32, {N});
        } else {
            const int64_t groups = s.ndim >= 2 ? s.size(1) : 0;
            const int64_t g = groups > 0 && K % groups == 0 ? K / groups : 0;
            const int64_t multiple = !w4 && s.ndim == 3 ? 16 : 32;  // W8A16 panels take GGUF Q6_K's groups of 16
            if (g < multiple || g % multiple) {
                fail("LlamaModel: " + sn + " has " + std::to_string(groups) + " groups per row; K = " + std::to_string(K) +
                     " needs groups of a multiple of " + std::to_string(multiple));
            }
            if (w4 && s.ndim == 3) {  // W4A16 in panels 64 wide
                const int64_t P4 = (N + 63) / 64;
                lw.qweight = raw(name + ".qweight", DType::i32, {P4, K / 8, 64});
                // scales and mins in float16 where that loses nothing (lmd.turbomind.model.pack_matmuls)
                const DType st = s.dtype == DType::f16 ? DType::f16 : DType::f32;
                lw.mins = raw(name + ".mins", st, {P4, groups, 64});
                lw.scales = raw(sn, st, {P4, groups, 64});
            } else if (s.ndim == 3) {  // W8A16 in panels 16 wide
                const int64_t P = (N + 15) / 16;
                lw.qweight = raw(name + ".qweight", DType::i8, {P, K, 16});
                lw.scales = raw(sn, s.dtype == DType::f16 ? DType::f16 : DType::f32, {P, groups, 16});
            } else {
                lw.qweight = raw(name + ".qweight", w4 ? DType::u8 : DType::i8, {N, w4 ? K / 2 : K});
                if (w4) lw.mins = raw(name + ".mins", DType::f32, {N, groups});
                lw.scales = raw(sn, DType::f32, {N, groups});
            }
            lw.group_size = g;
        }
        if (tensors.contains(name + "_bias")) lw.bias = raw(name + "_bias", DType::f32, {N});
        if (tensors.contains(name + ".perm")) {
            lw.perm = raw(name + ".perm", DType::i32, {K});
            std::vector<bool> seen(static_cast<size_t>(K));
            for (int64_t k = 0; k < K; ++k) {
                const int32_t p = lw.perm.ptr<int32_t>()[k];
                if (p < 0 || p >= K || seen[p]) fail("LlamaModel: " + name + ".perm is not a permutation of 0.." + std::to_string(K - 1));
                seen[p] = true;
            }
        }
        return lw;
    };
    // a matmul's weights: "<name>" (float [N, K], or packed), "<name>.gguf.<i>" (GGUF blocks), quantized
    // ("<name>.qweight" ...), or quantized parts ("<name>.part.<i>.qweight" ..., their rows in "<name>.part_rows")
    auto linear = [&](const std::string & name, int64_t N, int64_t K) {
        LinearWeights lw;
        if (tensors.contains(name + ".gguf_types")) {  // GGUF blocks as stored, in runs of one type
            const std::string tn = name + ".gguf_types";
            const TensorView types = view_of(tensors[py::str(tn)], tn.c_str());
            expect(types.ndim == 1 && types.dtype == DType::i32 && types.contiguous() && types.size(0) > 0, tn.c_str(),
                   types, "expected a contiguous int32 [parts] tensor of ggml type ids");
            int64_t n0 = 0;
            for (int64_t i = 0; i < types.size(0); ++i) {
                const int type = types.ptr<int32_t>()[i];
                const std::string pn = name + ".gguf." + std::to_string(i);
                const int64_t row_bytes = cpu::gguf_row_bytes(type, K);
                if (!row_bytes) fail("LlamaModel: " + tn + " names ggml type " + std::to_string(type) + ", which the kernels do not run with K = " + std::to_string(K));
                if (!tensors.contains(pn)) fail("LlamaModel: missing weight " + pn);
                const TensorView part = view_of(tensors[py::str(pn)], pn.c_str());
                expect(part.ndim == 2 && part.size(1) == row_bytes, pn.c_str(), part,
                       "expected uint8 [rows, " + std::to_string(row_bytes) + "] GGUF blocks");
                lw.gguf.push_back({raw(pn, DType::u8, {part.size(0), row_bytes}), type, n0});
                n0 += part.size(0);
            }
            if (n0 != N) fail("LlamaModel: the parts of " + name + " hold " + std::to_string(n0) + " rows, not " + std::to_string(N));
            if (tensors.contains(name + "_bias")) lw.bias = raw(name + "_bias", DType::f32, {N});
        } else if (tensors.contains(name + ".part_rows")) {
            const std::string rn = name + ".part_rows";
            const TensorView rows = view_of(tensors[py::str(rn)], rn.c_str());
            expect(rows.ndim == 1 && rows.dtype == DType::i32 && rows.contiguous() && rows.size(0) > 0, rn.c_str(), rows,
                   "expected a contiguous int32 [parts] tensor of row counts");
            int64_t n0 = 0;
            for (int64_t i = 0; i < rows.size(0); ++i) {
                const int64_t n = rows.ptr<int32_t>()[i];
                if (n < 1 || n0 + n > N) fail("LlamaModel: " + rn + " does not split the " + std::to_string(N) + " rows of " + name);
                lw.parts.push_back(quantized(name + ".part." + std::to_string(i), n, K));
                lw.part_rows.push_back(n);
                n0 += n;
            }
            if (n0 != N) fail("LlamaModel: the parts of " + name + " hold " + std::to_string(n0) + " rows, not " + std::to_string(N));
        } else if (tensors.contains(name + ".qweight")) {
            lw = quantized(name, N, K);
        } else if (is_packed(name)) {
            lw.packed = take(name, {(N + 15) / 16, K, 16}, true);
            lw.bias = take(name + "_bias", {N}, false);
        } else {
            lw.weight = take(name, {N, K}, true);
            lw.bias = take(name + "_bias", {N}, false);
        }
        return lw;
    };
    // a stack of E float matmuls [E, N, K], or each in panels [E, ceil(N / 16), K, 16]: one LinearWeights
    // an expert, views into it; without the stack, each expert's own matmul "<name>.<e>" in any layout
    // linear() reads (quantized experts)
    auto experts = [&](const std::string & name, int64_t E, int64_t N, int64_t K) {
        std::vector<LinearWeights> out(static_cast<size_t>(E));
        if (!tensors.contains(name)) {
            for (int64_t e = 0; e < E; ++e) out[e] = linear(name + "." + std::to_string(e), N, K);
            return out;
        }
        const bool packed = view_of(tensors[py::str(name)], name.c_str()).ndim == 4;
        const TensorView all = packed ? take(name, {E, (N + 15) / 16, K, 16}, true) : take(name, {E, N, K}, true);
        for (int64_t e = 0; e < E; ++e) {
            TensorView v = all;
            v.data = static_cast<uint8_t *>(all.data) + e * all.stride(0) * dtype_size(all.dtype);
            v.ndim = all.ndim - 1;
            for (int d = 0; d < v.ndim; ++d) {
                v.shape[d] = all.shape[d + 1];
                v.strides[d] = all.strides[d + 1];
            }
            (packed ? out[e].packed : out[e].weight) = v;
        }
        return out;
    };
    // the rows of a stack of expert biases [E, N] (none there: none) as each expert's bias
    auto expert_biases = [&](std::vector<LinearWeights> & lws, const std::string & name, int64_t E, int64_t N) {
        if (!tensors.contains(name)) return;
        const TensorView all = take(name, {E, N}, true);
        for (int64_t e = 0; e < E; ++e) {
            TensorView v = all;
            v.data = static_cast<uint8_t *>(all.data) + e * N * dtype_size(all.dtype);
            v.ndim = 1;
            v.shape[0] = N;
            v.strides[0] = 1;
            lws[e].bias = v;
        }
    };
    // layer p's mixture of experts (moe.h) as config["moe"] describes it
    auto moe = [&](const std::string & p) {
        const py::dict m = cfg["moe"].cast<py::dict>();
        auto w = std::make_shared<MoeWeights>();
        const int64_t E = get_int(m, "num_experts"), EI = get_int(m, "intermediate_size");
        const int64_t S = get_int(m, "shared_intermediate_size");
        w->top_k = get_int(m, "top_k");
        if (E < 1 || w->top_k < 1 || w->top_k > E || EI < 1 || S < 0) {
            fail("LlamaModel config: moe needs num_experts >= 1, 1 <= top_k <= num_experts, intermediate_size >= 1 "
                 "and shared_intermediate_size >= 0");
        }
        w->intermediate_size = EI;
        w->norm_topk_prob = m["norm_topk_prob"].cast<bool>();
        w->round_weights = m["round_weights"].cast<bool>();
        w->router = linear(p + "router", E, H);  // with "router_bias" [E] where there is one (gpt-oss)
        w->gate_up = experts(p + "experts.gate_up", E, 2 * EI, H);
        w->down = experts(p + "experts.down", E, H, EI);
        // gpt-oss: biases [E, N] on each expert's matmuls, routing by a softmax over the top-k logits, and
        // the clamped SwiGLU
        expert_biases(w->gate_up, p + "experts.gate_up_bias", E, 2 * EI);
        expert_biases(w->down, p + "experts.down_bias", E, H);
        w->topk_softmax = m.contains("topk_softmax") && m["topk_softmax"].cast<bool>();
        w->swiglu_limit = m.contains("swiglu_limit") ? m["swiglu_limit"].cast<float>() : 0.f;
        w->swiglu_alpha = m.contains("swiglu_alpha") ? m["swiglu_alpha"].cast<float>() : 1.f;
        if (w->swiglu_limit < 0.f) fail("LlamaModel config: moe.swiglu_limit must be >= 0 (0: plain SwiGLU)");
        // DeepSeek-V2: grouped routing, scaled weights, shared experts without a gate
        w->routed_scaling_factor = m.contains("routed_scaling_factor") ? m["routed_scaling_factor"].cast<float>() : 1.f;
        w->num_groups = m.contains("num_groups") ? m["num_groups"].cast<int64_t>() : 1;
        w->topk_groups = m.contains("topk_groups") ? m["topk_groups"].cast<int64_t>() : 1;
        w->shared_gated = !m.contains("shared_gated") || m["shared_gated"].cast<bool>();
        if (w->num_groups < 1 || E % w->num_groups || w->topk_groups < 1 || w->topk_groups > w->num_groups ||
            w->top_k > w->topk_groups * (E / w->num_groups)) {
            fail("LlamaModel config: moe needs num_groups dividing num_experts, 1 <= topk_groups <= num_groups and "
                 "top_k within the experts of topk_groups groups");
        }
        w->shared_intermediate_size = S;
        if (S) {
            w->shared_gate_up = linear(p + "shared_gate_up", 2 * S, H);
            w->shared_down = linear(p + "shared_down", H, S);
            if (w->shared_gated) w->shared_gate = linear(p + "shared_gate", 1, H);
        }
        return std::shared_ptr<const MoeWeights>(w);
    };
    // layer p's latent attention (mla.h) as config["mla"] describes it
    auto mla = [&](const std::string & p) {
        auto w = std::make_shared<MlaWeights>();
        w->kv_lora_rank = get_int(mla_cfg, "kv_lora_rank");
        w->qk_nope_head_dim = get_int(mla_cfg, "qk_nope_head_dim");
        w->qk_rope_head_dim = get_int(mla_cfg, "qk_rope_head_dim");
        w->v_head_dim = get_int(mla_cfg, "v_head_dim");
        const int64_t Hq = c.num_heads, L = w->kv_lora_rank, q_rows = Hq * (w->qk_nope_head_dim + w->qk_rope_head_dim);
        const int64_t r = mla_cfg.contains("q_lora_rank") && !mla_cfg["q_lora_rank"].is_none() ? get_int(mla_cfg, "q_lora_rank") : 0;
        if (r) {
            w->q_a = linear(p + "mla.q_a", r, H);
            w->q_a_norm = take(p + "mla.q_a_norm", {r}, true);
        }
        w->q = linear(p + "mla.q", q_rows, r ? r : H);
        w->kv_a = linear(p + "mla.kv_a", w->cache_dim(), H);
        w->kv_a_norm = take(p + "mla.kv_a_norm", {L}, true);
        w->w_uk_t = take(p + "mla.w_uk_t", {Hq, L, w->qk_nope_head_dim}, true);
        w->w_uv = take(p + "mla.w_uv", {Hq, w->v_head_dim, L}, true);
        return std::shared_ptr<const MlaWeights>(w);
    };
    std::vector<bool> sparse(static_cast<size_t>(c.num_layers), false);
    if (cfg.contains("moe")) {
        sparse = cfg["moe"]["sparse_layers"].cast<std::vector<bool>>();
        if (static_cast<int64_t>(sparse.size()) != c.num_layers) {
            fail("LlamaModel config: moe.sparse_layers has " + std::to_string(sparse.size()) + " flags for " +
                 std::to_string(c.num_layers) + " layers");
        }
    }
    LlamaWeights w;
    w.embed = take("embed", {c.vocab_size, H}, !is_packed("lm_head"));  // none: tied, rows from lm_head's panels
    w.norm = take("norm", {H}, true);
    w.lm_head = linear("lm_head", c.vocab_size, H);
    {
        py::object obj = tensors["cos_sin"];
        w.cos_sin = view_of(obj, "cos_sin");
        expect(w.cos_sin.ndim == 2 && w.cos_sin.contiguous() && w.cos_sin.dtype == dt && w.cos_sin.size(1) <= D &&
               w.cos_sin.size(1) % 2 == 0, "cos_sin", w.cos_sin, "expected [max_position, rot] with even rot <= head_dim");
        owners.append(obj);
    }
    const bool any_local = std::find(c.local_rope.begin(), c.local_rope.end(), true) != c.local_rope.end();
    if (any_local) {
        w.cos_sin_local = take("cos_sin_local", {w.cos_sin.size(0), w.cos_sin.size(1)}, true);
    }
    for (int64_t l = 0; l < c.num_layers; ++l) {
        const std::string p = "layers." + std::to_string(l) + ".";
        LlamaLayerWeights lw;
        if (c.pre_norms) lw.input_norm = take(p + "input_norm", {H}, true);
        if (c.mla_cache_dim) {
            lw.mla = mla(p);
        } else {
            lw.qkv = linear(p + "qkv", qkv, H);
        }
        lw.q_norm = take(p + "q_norm", {c.qk_norm_all_heads ? c.num_heads * D : D}, c.qk_norm);
        lw.k_norm = take(p + "k_norm", {c.qk_norm_all_heads ? c.num_kv_heads * D : D}, c.qk_norm);
        lw.o = linear(p + "o", H, c.num_heads * (c.mla_cache_dim ? get_int(mla_cfg, "v_head_dim") : D));
        if (c.pre_norms) lw.post_norm = take(p + "post_norm", {H}, true);
        lw.attn_out_norm = take(p + "attn_out_norm", {H}, false);
        lw.mlp_out_norm = take(p + "mlp_out_norm", {H}, false);
        if (tensors.contains(p + "sinks")) lw.sinks = raw(p + "sinks", DType::f32, {c.num_heads});
        if (sparse[l]) {
            lw.moe = moe(p);
        } else {
            lw.gate_up = linear(p + "gate_up", 2 * I, H);
            lw.down = linear(p + "down", H, I);
        }
        w.layers.push_back(lw);
    }
    if (quant_policy != 0 && quant_policy != 4 && quant_policy != 8) {
        fail("LlamaModel: quant_policy = " + std::to_string(quant_policy) + " is not 0 (no KV quantization), "
             "8 (int8 KV) or 4 (int4 KV)");
    }
    return std::make_shared<LlamaModel>(c, std::move(w), dt, num_blocks, block_size, quant_policy);
}

}  // namespace turbomind
