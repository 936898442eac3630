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
#include "model_from_python.h"
#include "models/llama.h"

namespace turbomind {

SamplingParams sampling_params_from_python(py::handle obj);  // engine_bindings.cc

namespace {

// The model plus the Python objects that keep its weights' memory alive.
struct PyLlamaModel {
    std::shared_ptr<LlamaModel> model;
    py::list owners;
};

PyLlamaModel * make_model(const py::dict & cfg, const py::dict & tensors, const std::string & dtype,
                          int64_t num_blocks, int64_t block_size, int quant_policy) {
    auto result = std::make_unique<PyLlamaModel>();
    result->model = model_from_python(cfg, tensors, dtype, num_blocks, block_size, quant_policy, result->owners);
    return result.release();
}

// One step into out: logits [R, vocab] or, with hidden, the final norm's output [R, hidden_size]
// (LlamaModel::hidden_states).
void forward(PyLlamaModel & self, py::handle ids_h, py::handle pos_h, py::handle slots_h, py::handle tables_h,
             py::handle lens_h, py::handle rows_h, py::handle out_h, bool hidden, py::handle adapters_h) {
    const LlamaModel & m = *self.model;
    const TensorView ids = view_of(ids_h, "token_ids"), pos = view_of(pos_h, "positions");
    const TensorView slots = view_of(slots_h, "slots"), tables = view_of(tables_h, "row_tables");
    const TensorView lens = view_of(lens_h, "row_lens"), rows = view_of(rows_h, "logit_rows");
    const char * out_name = hidden ? "hidden" : "logits";
    const TensorView out = view_of(out_h, out_name);
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
    expect(out.ndim == 2 && out.contiguous() && out.dtype == DType::f32 && out.size(0) == R &&
           out.size(1) == (hidden ? m.config().hidden_size : m.config().vocab_size), out_name, out,
           hidden ? "expected a contiguous float32 [R, hidden_size]" : "expected a contiguous float32 [R, vocab]");
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
    const int32_t * row_adapters = nullptr;  // a row's slot names an adapter loaded (set_adapter) or -1
    if (!adapters_h.is_none()) {
        const TensorView ra = view_of(adapters_h, "row_adapters");
        vec(ra, "row_adapters", DType::i32, T);
        row_adapters = ra.ptr<int32_t>();
        for (int64_t t = 0; t < T; ++t) {
            if (row_adapters[t] < -1) fail("row_adapters[" + std::to_string(t) + "] = " + std::to_string(row_adapters[t]) + " is not a slot (-1: none)");
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
    in.row_adapters = row_adapters;
    py::gil_scoped_release release;
    if (hidden) {
        self.model->hidden_states(in, out.ptr<float>());
    } else {
        self.model->forward(in, out.ptr<float>());
    }
}

// layers: per layer a dict {'qkv' | 'o' | 'gate_up' | 'down': (A, B)} of DLPack capsules or HostTensors,
// viewed here and copied by LlamaModel::set_adapter (which checks them).
void set_adapter(PyLlamaModel & self, int32_t slot, const py::sequence & layers) {
    LoraAdapterWeights w;
    for (py::handle layer : layers) {
        const py::dict d = py::reinterpret_borrow<py::dict>(layer);
        LoraLayerWeights lw;
        const std::pair<const char *, cpu::LoraWeights LoraLayerWeights::*> names[] = {
            {"qkv", &LoraLayerWeights::qkv}, {"o", &LoraLayerWeights::o},
            {"gate_up", &LoraLayerWeights::gate_up}, {"down", &LoraLayerWeights::down}};
        for (const auto & [name, field] : names) {
            if (!d.contains(name)) continue;
            const py::tuple ab = d[name].cast<py::tuple>();
            if (ab.size() != 2) fail(std::string("set_adapter: ") + name + " must be a pair (A, B)");
            lw.*field = {view_of(ab[0], "A"), view_of(ab[1], "B")};
        }
        for (auto item : d) {
            const std::string key = item.first.cast<std::string>();
            if (key != "qkv" && key != "o" && key != "gate_up" && key != "down") {
                fail("set_adapter: " + key + " is not a matmul LoRA adapts (qkv, o, gate_up, down)");
            }
        }
        w.layers.push_back(lw);
    }
    py::gil_scoped_release release;  // the copy, and the wait for a step's snapshot
    self.model->set_adapter(slot, w);
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
    py::object draft_model;  // None, or the LlamaModel that drafts (its weights' owners kept alive)
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

py::dict logprob_dict(const std::vector<TokenLogprob> & alts) {
    py::dict d;
    for (const TokenLogprob & t : alts) d[py::int_(t.token_id)] = t.logprob;
    return d;
}

// Outputs as the Python side reads them: tuples (session_id, token_ids, logprobs, finish_reason,
// num_prompt_tokens, num_cached_tokens, num_context_tokens, kept, error, prompt_logprobs), oldest
// first; prompt_logprobs None, or [None, {token: logprob, ...}, ...] one per prompt token.
py::list output_tuples(std::vector<Output> & outs) {
    py::list result;
    for (Output & o : outs) {
        py::object lps = py::none();
        if (!o.logprobs.empty()) {
            py::list per_token;
            for (auto & alts : o.logprobs) per_token.append(logprob_dict(alts));
            lps = per_token;
        }
        py::object prompt_lps = py::none();
        if (o.has_prompt_logprobs) {
            py::list per_token;
            per_token.append(py::none());
            for (auto & alts : o.prompt_logprobs) per_token.append(logprob_dict(alts));
            prompt_lps = per_token;
        }
        const char * fin = finish_name(o.finish);
        result.append(py::make_tuple(o.session_id, py::tuple(py::cast(o.token_ids)), lps,
                                     fin ? py::object(py::str(fin)) : py::object(py::none()),
                                     o.num_prompt_tokens, o.num_cached_tokens, o.num_context_tokens,
                                     o.kept, o.error.empty() ? py::object(py::none()) : py::object(py::str(o.error)),
                                     prompt_lps));
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
        .def("forward",
             [](PyLlamaModel & self, py::handle ids, py::handle pos, py::handle slots, py::handle tables, py::handle lens,
                py::handle rows, py::handle logits, py::handle adapters) {
                 forward(self, ids, pos, slots, tables, lens, rows, logits, false, adapters);
             },
             py::arg("token_ids"), py::arg("positions"), py::arg("slots"), py::arg("row_tables"),
             py::arg("row_lens"), py::arg("logit_rows"), py::arg("logits"), py::arg("row_adapters") = py::none(),
             "Run one step: every row's K/V into its slot, attention over row_lens[t] tokens of row_tables[t]; "
             "logits[R, vocab] (float32) for logit_rows. row_adapters: None, or int32 [T], the LoRA adapter slot "
             "each row runs (-1: none; set_adapter).")
        .def("hidden_states",
             [](PyLlamaModel & self, py::handle ids, py::handle pos, py::handle slots, py::handle tables, py::handle lens,
                py::handle rows, py::handle hidden, py::handle adapters) {
                 forward(self, ids, pos, slots, tables, lens, rows, hidden, true, adapters);
             },
             py::arg("token_ids"), py::arg("positions"), py::arg("slots"), py::arg("row_tables"),
             py::arg("row_lens"), py::arg("logit_rows"), py::arg("hidden"), py::arg("row_adapters") = py::none(),
             "forward without the head: hidden[R, hidden_size] (float32), the final norm's output for logit_rows "
             "(what an embedder pools).")
        .def("set_adapter", &set_adapter, py::arg("slot"), py::arg("layers"),
             "Serve a LoRA adapter in slot (>= 0): layers, one dict a layer {'qkv' | 'o' | 'gate_up' | 'down': (A [R, K], "
             "B [N, R])} in the model dtype, the scale folded into B; copied (the caller may drop its tensors). "
             "ValueError naming what does not fit the model. Safe while an engine runs this model.")
        .def("clear_adapter", [](PyLlamaModel & self, int32_t slot) { self.model->clear_adapter(slot); },
             py::arg("slot"), "Empty slot: rows naming it run the base model.")
        .def("share_adapters", [](PyLlamaModel & self, const PyLlamaModel & other) { self.model->share_adapters(*other.model); },
             py::arg("other"), "Serve other's adapter slots, now and as they change (a twin over the same weights).")
        .def_property_readonly("num_blocks", [](const PyLlamaModel & s) { return s.model->num_blocks(); })
        .def_property_readonly("block_size", [](const PyLlamaModel & s) { return s.model->block_size(); })
        .def_property_readonly("kv_bytes", [](const PyLlamaModel & s) { return s.model->kv_bytes(); })
        .def_property_readonly("quant_policy", [](const PyLlamaModel & s) { return s.model->quant_policy(); });

    py::class_<PyEngine>(m, "Engine", "TurboMind's batching engine: a C++ thread running a LlamaModel.")
        .def(py::init([](py::object model, int64_t max_batch_size, int64_t max_num_batched_tokens, int64_t session_len,
                         bool enable_prefix_caching, uint64_t sampler_seed, int64_t window, int32_t num_speculative_tokens,
                         int32_t prompt_lookup_min, int32_t prompt_lookup_max, py::object draft_model,
                         bool adaptive_draft_length) {
                 PyLlamaModel & pm = model.cast<PyLlamaModel &>();
                 std::shared_ptr<LlamaModel> draft;
                 if (!draft_model.is_none()) {
                     if (!py::isinstance<PyLlamaModel>(draft_model)) fail("Engine: draft_model must be a LlamaModel or None");
                     draft = draft_model.cast<PyLlamaModel &>().model;
                     if (draft->config().vocab_size != pm.model->config().vocab_size) {
                         fail("Engine: draft_model's vocabulary has " + std::to_string(draft->config().vocab_size) +
                              " tokens, the model's " + std::to_string(pm.model->config().vocab_size) +
                              "; a draft model shares the tokenizer");
                     }
                     if (num_speculative_tokens < 1) fail("Engine: a draft_model needs num_speculative_tokens >= 1");
                 }
                 if (max_batch_size < 1 || max_num_batched_tokens < 1 || session_len < 2 || window < 0) {
                     fail("Engine: max_batch_size and max_num_batched_tokens must be >= 1, session_len >= 2, "
                          "window >= 0");
                 }
                 if (num_speculative_tokens < 0 || prompt_lookup_min < 1 || prompt_lookup_max < prompt_lookup_min) {
                     fail("Engine: num_speculative_tokens must be >= 0 and 1 <= prompt_lookup_min <= prompt_lookup_max, "
                          "got " + std::to_string(num_speculative_tokens) + ", " + std::to_string(prompt_lookup_min) +
                          ", " + std::to_string(prompt_lookup_max));
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
                 c.num_speculative_tokens = num_speculative_tokens;
                 c.prompt_lookup_min = prompt_lookup_min;
                 c.prompt_lookup_max = prompt_lookup_max;
                 c.adaptive_draft_length = adaptive_draft_length;
                 auto e = new PyEngine{model, draft_model, nullptr};
                 e->engine = std::make_unique<Engine>(pm.model, c, std::make_shared<PyConstraintOps>(), draft);
                 return e;
             }),
             py::arg("model"), py::arg("max_batch_size"), py::arg("max_num_batched_tokens"), py::arg("session_len"),
             py::arg("enable_prefix_caching"), py::arg("sampler_seed"), py::arg("window") = 0,
             py::arg("num_speculative_tokens") = 0, py::arg("prompt_lookup_min") = 1, py::arg("prompt_lookup_max") = 4,
             py::arg("draft_model") = py::none(), py::arg("adaptive_draft_length") = true,
             "num_speculative_tokens > 0: speculative decoding, each decoding sequence drafts up to that many tokens "
             "a step by n-gram prompt lookup (prompt_lookup_max down to prompt_lookup_min tokens matched), or, with "
             "draft_model (a LlamaModel of the same vocabulary, its KV cache the drafts' alone), by its greedy "
             "continuation; with adaptive_draft_length, each draft only as long as pays (lmd.kernels.ops.DraftLength)")
        .def("add", [](PyEngine & self, int64_t session_id, std::vector<int32_t> token_ids, int64_t max_new_tokens,
                       py::handle sampling, bool sequence_start, bool sequence_end, py::object constraint,
                       int32_t adapter_slot, uint64_t adapter_uid) {
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
                 if (adapter_slot < -1) fail("adapter_slot must be a slot (>= 0) or -1 (none), got " + std::to_string(adapter_slot));
                 r.adapter_slot = adapter_slot;
                 r.adapter_uid = adapter_slot >= 0 ? adapter_uid : 0;
                 self.engine->add(std::move(r));
             },
             py::arg("session_id"), py::arg("token_ids"), py::arg("max_new_tokens"), py::arg("sampling"),
             py::arg("sequence_start") = true, py::arg("sequence_end") = true, py::arg("constraint") = py::none(),
             py::arg("adapter_slot") = -1, py::arg("adapter_uid") = 0,
             "constraint: None, or the request's lmd.guided.TokenConstraint (structured output); adapter_slot: the "
             "LoRA adapter its rows run (LlamaModel.set_adapter; -1: none), adapter_uid: that load's uid (salts its "
             "prefix-cache keys)")
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
             "num_prompt_tokens, num_cached_tokens, num_context_tokens, kept, error, prompt_logprobs); waits up to "
             "timeout_s for one.")
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
                 d["spec_num_drafts"] = s.spec_num_drafts;
                 d["spec_num_draft_tokens"] = s.spec_num_draft_tokens;
                 d["spec_num_accepted_tokens"] = s.spec_num_accepted_tokens;
                 return d;
             })
        .def("draft_stats", [](PyEngine & self) {
                 EngineStats s = self.engine->stats();
                 py::dict d;
                 d["num_total_blocks"] = s.draft_num_total_blocks;
                 d["num_free_blocks"] = s.draft_num_free_blocks;
                 d["num_shadows"] = s.draft_num_shadows;
                 d["num_skipped"] = s.draft_num_skipped;
                 return d;
             },
             "the draft model's KV cache (all 0 without one): its blocks, those free, the sequences it shadows, "
             "and the drafts skipped for want of free blocks")
        .def("set_check_blocks", [](PyEngine & self, bool on) { self.engine->set_check_blocks(on); }, py::arg("on"),
             "test hook: check the KV blocks' accounting after every step (blocks_error holds the first violation)")
        .def_property_readonly("blocks_error", [](PyEngine & self) -> py::object {
                 std::string err = self.engine->blocks_error();
                 return err.empty() ? py::object(py::none()) : py::object(py::str(err));
             }, "None, or the first broken block accounting seen since set_check_blocks(True)")
        .def("close", [](PyEngine & self) {
                 py::gil_scoped_release release;
                 self.engine->close();
             })
        .def_property_readonly("closed", [](PyEngine & self) { return self.engine->closed(); });
}

}  // namespace turbomind
