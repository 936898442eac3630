// lmd.turbomind._turbomind.LlamaModel and Engine: the C++ model with its paged KV cache
// (which tests may also drive one step at a time), and the engine whose thread runs it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>

#include "core/py_tensor.h"
#include "engine/engine.h"
#include "cpu/gguf.h"
#include "cpu/quant.h"
#include "models/llama.h"
#include "models/mla.h"
#include "models/moe.h"

namespace turbomind {

SamplingParams sampling_params_from_python(py::handle obj);  // engine_bindings.cc

namespace {

DType parse_dtype(const std::string & s) {
    if (s == "float32") return DType::f32;
    if (s == "bfloat16") return DType::bf16;
    if (s == "float16") return DType::f16;
    fail("dtype " + s + " is not supported; use float32, bfloat16 or float16");
}

// The model plus the Python objects that keep its weights' memory alive.
struct PyLlamaModel {
    std::shared_ptr<LlamaModel> model;
    py::list owners;
};

int64_t get_int(const py::dict & d, const char * key) {
    if (!d.contains(key)) fail(std::string("LlamaModel config: missing ") + key);
    return d[key].cast<int64_t>();
}

PyLlamaModel * make_model(const py::dict & cfg, const py::dict & tensors, const std::string & dtype_name_,
                          int64_t num_blocks, int64_t block_size, int quant_policy) {
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
    auto result = std::make_unique<PyLlamaModel>();
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
        result->owners.append(obj);
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
        result->owners.append(obj);
        return v;
    };
    // a quantized matmul "<name>.qweight/.scales[/.mins]": W4A16 (mins there; or in panels,
    // lib/kernels/csrc/cpu/gemm.h), W8A16 (int8, scales [N, K/G]) or W8A8 (int8, scales [N]), with the
    // group size G = K / scales.size(1) a multiple of 32; "<name>.perm" (the matmul over x[:, perm]) and
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
            if (g < 32 || g % 32) fail("LlamaModel: " + sn + " has " + std::to_string(groups) + " groups per row; K = " + std::to_string(K) + " needs groups of a multiple of 32");
            if (w4 && s.ndim == 3) {  // W4A16 in panels 64 wide
                const int64_t P4 = (N + 63) / 64;
                lw.qweight = raw(name + ".qweight", DType::i32, {P4, K / 8, 64});
                // scales and mins in float16 where that loses nothing (lmd.turbomind.model.pack_matmuls)
                const DType st = s.dtype == DType::f16 ? DType::f16 : DType::f32;
                lw.mins = raw(name + ".mins", st, {P4, groups, 64});
                lw.scales = raw(sn, st, {P4, groups, 64});
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
    // an expert, views into it
    auto experts = [&](const std::string & name, int64_t E, int64_t N, int64_t K) {
        if (!tensors.contains(name)) fail("LlamaModel: missing weight " + name);
        const bool packed = view_of(tensors[py::str(name)], name.c_str()).ndim == 4;
        const TensorView all = packed ? take(name, {E, (N + 15) / 16, K, 16}, true) : take(name, {E, N, K}, true);
        std::vector<LinearWeights> out(static_cast<size_t>(E));
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
        result->owners.append(obj);
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
    result->model = std::make_shared<LlamaModel>(c, std::move(w), dt, num_blocks, block_size, quant_policy);
    return result.release();
}

void forward(PyLlamaModel & self, py::handle ids_h, py::handle pos_h, py::handle slots_h, py::handle tables_h,
             py::handle lens_h, py::handle rows_h, py::handle logits_h) {
    const LlamaModel & m = *self.model;
    const TensorView ids = view_of(ids_h, "token_ids"), pos = view_of(pos_h, "positions");
    const TensorView slots = view_of(slots_h, "slots"), tables = view_of(tables_h, "row_tables");
    const TensorView lens = view_of(lens_h, "row_lens"), rows = view_of(rows_h, "logit_rows");
    const TensorView logits = view_of(logits_h, "logits");
    const int64_t T = ids.numel();
    auto vec = [&](const TensorView & v, const char * name, DType dt, int64_t n) {
        expect(v.ndim == 1 && v.contiguous() && v.dtype == dt && v.size(0) == n, name, v,
               std::string("expected a contiguous ") + dtype_name(dt) + " [" + std::to_string(n) + "]");
    };
    vec(ids, "token_ids", DType::i64, T);
    vec(pos, "positions", DType::i64, T);
    vec(slots, "slots", DType::i64, T);
    vec(lens, "row_lens", DType::i32, T);
    const int64_t R = rows.numel();
    vec(rows, "logit_rows", DType::i64, R);
    expect(tables.ndim == 2 && tables.contiguous() && tables.dtype == DType::i32 && tables.size(0) == T, "row_tables",
           tables, "expected a contiguous int32 [T, max_blocks]");
    expect(logits.ndim == 2 && logits.contiguous() && logits.dtype == DType::f32 && logits.size(0) == R &&
           logits.size(1) == m.config().vocab_size, "logits", logits, "expected a contiguous float32 [R, vocab]");
    const int64_t num_slots = m.num_blocks() * m.block_size(), max_blocks = tables.size(1);
    for (int64_t t = 0; t < T; ++t) {  // bad ids and tables are errors, never wild reads or writes
        const int64_t id = ids.ptr<int64_t>()[t], s = slots.ptr<int64_t>()[t];
        const int32_t n = lens.ptr<int32_t>()[t];
        if (id < 0 || id >= m.config().vocab_size) fail("token_ids[" + std::to_string(t) + "] = " + std::to_string(id) + " is outside the vocabulary");
        if (s < 0 || s >= num_slots) fail("slots[" + std::to_string(t) + "] = " + std::to_string(s) + " is not a cache slot");
        if (n < 1 || (n + m.block_size() - 1) / m.block_size() > max_blocks) fail("row_lens[" + std::to_string(t) + "] = " + std::to_string(n) + " does not fit row_tables");
        for (int64_t b = 0; b < (n + m.block_size() - 1) / m.block_size(); ++b) {
            const int32_t blk = tables.ptr<int32_t>()[t * max_blocks + b];
            if (blk < 0 || blk >= m.num_blocks()) fail("row_tables[" + std::to_string(t) + ", " + std::to_string(b) + "] = " + std::to_string(blk) + " is not a block");
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t row = rows.ptr<int64_t>()[r];
        if (row < 0 || row >= T) fail("logit_rows[" + std::to_string(r) + "] = " + std::to_string(row) + " is not a row of the step");
    }
    // each row its own table here (a sequence of one row): the engine's batch gives one per sequence
    std::vector<int32_t> row_seqs(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) row_seqs[t] = static_cast<int32_t>(t);
    StepInputs in;
    in.token_ids = ids.ptr<int64_t>();
    in.positions = pos.ptr<int64_t>();
    in.slots = slots.ptr<int64_t>();
    in.row_seqs = row_seqs.data();
    in.row_lens = lens.ptr<int32_t>();
    in.block_tables = tables.ptr<int32_t>();
    in.logit_rows = rows.ptr<int64_t>();
    in.num_tokens = T;
    in.num_seqs = T;
    in.max_blocks = max_blocks;
    in.num_logit_rows = R;
    py::gil_scoped_release release;
    self.model->forward(in, logits.ptr<float>());
}

// A request's lmd.guided.TokenConstraint, held by the engine. Dropped with the GIL, from whichever
// thread lets it go (the engine thread never holds its mutex then: see Constraint).
struct PyConstraint : Constraint {
    py::object obj;
    ~PyConstraint() override {
        if (!obj) return;
        py::gil_scoped_acquire gil;
        obj = py::object();
    }
};

std::string python_error(const std::exception & e, const char * what) {
    return std::string("the response_format grammar failed in ") + what + ": " + e.what();
}

// The engine thread's calls into the constraints: the GIL once per call, for every row of a step.
struct PyConstraintOps : ConstraintOps {
    void fill_bitmasks(Constraint * const * cs, int64_t n, int32_t * bitmask, int64_t num_words,
                       std::string * errors) override {
        py::gil_scoped_acquire gil;
        // a view of the engine's buffer for this call only: [n, num_words] int32
        py::capsule borrowed(bitmask, [](void *) {});
        py::array_t<int32_t> view({n, num_words}, {num_words * (int64_t) sizeof(int32_t), (int64_t) sizeof(int32_t)},
                                  bitmask, borrowed);
        for (int64_t i = 0; i < n; ++i) {
            try {
                static_cast<PyConstraint *>(cs[i])->obj.attr("fill_bitmask")(view, i);
            } catch (const std::exception & e) {  // py::error_already_set included: the GIL is held here
                errors[i] = python_error(e, "fill_bitmask");
            }
        }
    }

    void accept(Constraint * const * cs, const int32_t * tokens, int64_t n, std::string * errors) override {
        py::gil_scoped_acquire gil;
        for (int64_t i = 0; i < n; ++i) {
            try {
                if (!static_cast<PyConstraint *>(cs[i])->obj.attr("accept")(tokens[i]).cast<bool>()) {
                    errors[i] = "token " + std::to_string(tokens[i]) + " breaks the response_format grammar";
                }
            } catch (const std::exception & e) {
                errors[i] = python_error(e, "accept");
            }
        }
    }
};

// The engine plus the model object it runs (which keeps the weights alive).
struct PyEngine {
    py::object model;
    std::unique_ptr<Engine> engine;
    ~PyEngine() {
        // the engine thread may be waiting for the GIL (a constrained step, or a constraint dropped)
        py::gil_scoped_release release;
        engine.reset();
    }
};

const char * finish_name(Finish f) {
    switch (f) {
        case Finish::stop: return "stop";
        case Finish::length: return "length";
        case Finish::abort: return "abort";
        case Finish::error: return "error";
        case Finish::none: break;
    }
    return nullptr;
}

// Outputs as the Python side reads them: tuples (session_id, token_ids, logprobs, finish_reason,
// num_prompt_tokens, num_cached_tokens, num_context_tokens, kept, error), oldest first.
py::list output_tuples(std::vector<Output> & outs) {
    py::list result;
    for (Output & o : outs) {
        py::object lps = py::none();
        if (!o.logprobs.empty()) {
            py::list per_token;
            for (auto & alts : o.logprobs) {
                py::dict d;
                for (const TokenLogprob & t : alts) d[py::int_(t.token_id)] = t.logprob;
                per_token.append(d);
            }
            lps = per_token;
        }
        const char * fin = finish_name(o.finish);
        result.append(py::make_tuple(o.session_id, py::tuple(py::cast(o.token_ids)), lps,
                                     fin ? py::object(py::str(fin)) : py::object(py::none()),
                                     o.num_prompt_tokens, o.num_cached_tokens, o.num_context_tokens,
                                     o.kept, o.error.empty() ? py::object(py::none()) : py::object(py::str(o.error))));
    }
    return result;
}

}  // namespace

void bind_models(py::module_ & m) {
    py::class_<PyLlamaModel>(m, "LlamaModel",
                             "A decoder model of any family lmd runs (ModelConfig.family) and its paged KV cache, in C++.")
        .def(py::init(&make_model), py::arg("config"), py::arg("tensors"), py::arg("dtype"), py::arg("num_blocks"),
             py::arg("block_size"), py::arg("quant_policy") = 0,
             "config: hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size, "
             "rms_norm_eps, qk_norm, qk_norm_all_heads (q_norm [Hq D], k_norm [Hk D]), pre_norms (default true; false: no "
             "input_norm nor post_norm), use_rope (a flag per layer; default: all), windows (a sliding window per "
             "layer, 0: full; default: all full), moe (a mixture of experts: num_experts, top_k, intermediate_size, "
             "norm_topk_prob, round_weights, shared_intermediate_size, sparse_layers, topk_softmax, swiglu_limit, "
             "swiglu_alpha, routed_scaling_factor, num_groups, topk_groups, shared_gated; a sparse layer reads "
             "layers.{i}.{router, router_bias, experts.gate_up [E, 2I, H], experts.down [E, H, I] (each expert may come packed, "
             "[E, ceil(N / 16), K, 16]), experts.gate_up_bias [E, 2I], experts.down_bias [E, H], shared_gate_up, "
             "shared_down, shared_gate} in place of gate_up, down), mla (DeepSeek-V2's latent attention: q_lora_rank, "
             "kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim; a layer reads layers.{i}.mla.{q_a, q_a_norm, q, "
             "kv_a, kv_a_norm, w_uk_t [Hq, L, nope], w_uv [Hq, v, L]} in place of qkv, and o is [H, Hq v]). tensors: name -> DLPack capsule or HostTensor (embed, norm, "
             "lm_head, cos_sin, layers.{i}.{input_norm, qkv, qkv_bias, q_norm, k_norm, o, o_bias, post_norm, "
             "gate_up, gate_up_bias, down, down_bias, sinks (float32 [Hq])}); a float matmul [N, K] may come packed, [ceil(N / 16), K, 16] "
             "(ops.pack_linear), or as <name>.qweight/.scales[/.mins] (W4A16, W8A16, W8A8: lmd.turbomind.quant; <name>.perm: over x[:, perm]), "
             "or in parts <name>.part.<i>.* (rows: <name>.part_rows); without embed, the embedding is the "
             "packed lm_head (tied).")
        .def("forward", &forward, py::arg("token_ids"), py::arg("positions"), py::arg("slots"), py::arg("row_tables"),
             py::arg("row_lens"), py::arg("logit_rows"), py::arg("logits"),
             "Run one step: every row's K/V into its slot, attention over row_lens[t] tokens of row_tables[t]; "
             "logits[R, vocab] (float32) for logit_rows.")
        .def_property_readonly("num_blocks", [](const PyLlamaModel & s) { return s.model->num_blocks(); })
        .def_property_readonly("block_size", [](const PyLlamaModel & s) { return s.model->block_size(); })
        .def_property_readonly("kv_bytes", [](const PyLlamaModel & s) { return s.model->kv_bytes(); })
        .def_property_readonly("quant_policy", [](const PyLlamaModel & s) { return s.model->quant_policy(); });

    py::class_<PyEngine>(m, "Engine", "TurboMind's batching engine: a C++ thread running a LlamaModel.")
        .def(py::init([](py::object model, int64_t max_batch_size, int64_t max_num_batched_tokens, int64_t session_len,
                         bool enable_prefix_caching, uint64_t sampler_seed, int64_t window) {
                 PyLlamaModel & pm = model.cast<PyLlamaModel &>();
                 if (max_batch_size < 1 || max_num_batched_tokens < 1 || session_len < 2 || window < 0) {
                     fail("Engine: max_batch_size and max_num_batched_tokens must be >= 1, session_len >= 2, "
                          "window >= 0");
                 }
                 EngineConfig c;
                 c.max_batch_size = max_batch_size;
                 c.max_num_batched_tokens = max_num_batched_tokens;
                 c.session_len = session_len;
                 c.num_blocks = static_cast<int32_t>(pm.model->num_blocks());
                 c.block_size = static_cast<int32_t>(pm.model->block_size());
                 c.enable_prefix_caching = enable_prefix_caching;
                 c.sampler_seed = sampler_seed;
                 c.window = window;
                 auto e = new PyEngine{model, nullptr};
                 e->engine = std::make_unique<Engine>(pm.model, c, std::make_shared<PyConstraintOps>());
                 return e;
             }),
             py::arg("model"), py::arg("max_batch_size"), py::arg("max_num_batched_tokens"), py::arg("session_len"),
             py::arg("enable_prefix_caching"), py::arg("sampler_seed"), py::arg("window") = 0)
        .def("add", [](PyEngine & self, int64_t session_id, std::vector<int32_t> token_ids, int64_t max_new_tokens,
                       py::handle sampling, bool sequence_start, bool sequence_end, py::object constraint) {
                 Request r;
                 if (!constraint.is_none()) {
                     const int64_t vocab = self.model.cast<PyLlamaModel &>().model->config().vocab_size;
                     if (!py::hasattr(constraint, "fill_bitmask") || !py::hasattr(constraint, "accept")) {
                         fail("constraint: expected an lmd.guided.TokenConstraint (fill_bitmask, accept)");
                     }
                     if (constraint.attr("num_words").cast<int64_t>() != (vocab + 31) / 32) {
                         fail("constraint: built for another vocabulary size than the model's " + std::to_string(vocab));
                     }
                     auto c = std::make_unique<PyConstraint>();
                     for (py::handle t : constraint.attr("stop_token_ids")) c->stop_token_ids.push_back(t.cast<int32_t>());
                     c->obj = constraint;
                     r.constraint = std::move(c);
                 }
                 r.session_id = session_id;
                 r.token_ids = std::move(token_ids);
                 r.max_new_tokens = max_new_tokens;
                 r.sampling = sampling_params_from_python(sampling);
                 r.sequence_start = sequence_start;
                 r.sequence_end = sequence_end;
                 self.engine->add(std::move(r));
             },
             py::arg("session_id"), py::arg("token_ids"), py::arg("max_new_tokens"), py::arg("sampling"),
             py::arg("sequence_start") = true, py::arg("sequence_end") = true, py::arg("constraint") = py::none(),
             "constraint: None, or the request's lmd.guided.TokenConstraint (structured output)")
        .def("abort", [](PyEngine & self, int64_t sid) { self.engine->abort(sid); }, py::arg("session_id"))
        .def("end", [](PyEngine & self, int64_t sid) { self.engine->end(sid); }, py::arg("session_id"))
        .def("wait_outputs", [](PyEngine & self, double timeout_s) {
                 std::vector<Output> outs;
                 {
                     py::gil_scoped_release release;
                     outs = self.engine->wait_outputs(timeout_s);
                 }
                 return output_tuples(outs);
             },
             py::arg("timeout_s"),
             "Outputs since the last call, oldest first, as tuples (session_id, token_ids, logprobs, finish_reason, "
             "num_prompt_tokens, num_cached_tokens, num_context_tokens, kept, error); waits up to timeout_s for one.")
        .def("take_outputs", [](PyEngine & self) {
                 std::vector<Output> outs = self.engine->take_outputs();
                 return output_tuples(outs);
             },
             "wait_outputs without waiting: the outputs so far (maybe none); clears outputs_fd")
        .def_property_readonly("outputs_fd", [](PyEngine & self) { return self.engine->outputs_fd(); },
                               "an eventfd, readable once outputs wait (loop.add_reader); take_outputs clears it")
        .def("stats", [](PyEngine & self) {
                 EngineStats s = self.engine->stats();
                 py::dict d;
                 d["num_running"] = s.num_running;
                 d["num_waiting"] = s.num_waiting;
                 d["num_total_blocks"] = s.num_total_blocks;
                 d["num_free_blocks"] = s.num_free_blocks;
                 d["num_cached_blocks"] = s.num_cached_blocks;
                 d["num_prefix_hit_tokens"] = s.num_prefix_hit_tokens;
                 d["num_prefix_query_tokens"] = s.num_prefix_query_tokens;
                 d["num_preemptions"] = s.num_preemptions;
                 d["num_prompt_tokens"] = s.num_prompt_tokens;
                 d["num_generated_tokens"] = s.num_generated_tokens;
                 return d;
             })
        .def("close", [](PyEngine & self) {
                 py::gil_scoped_release release;
                 self.engine->close();
             })
        .def_property_readonly("closed", [](PyEngine & self) { return self.engine->closed(); });
}

}  // namespace turbomind
