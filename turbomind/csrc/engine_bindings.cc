// lmd.turbomind._turbomind.engine_parts: the C++ engine's block manager, scheduler and sampler,
// bound for tests (the engine thread calls them from C++). Names and return shapes follow the
// Python versions in pytorch_backend/: match_prefix -> (block_ids, num_cached_tokens), a
// sequence's status as SequenceStatus's value ('waiting', ...), logprobs as
// [(token_id, logprob), ...] with the chosen token first. Wrong arguments raise ValueError
// naming the field; broken accounting raises AssertionError, like the Python asserts.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/block_manager.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"

namespace py = pybind11;

namespace turbomind {
namespace {

[[noreturn]] void fail(const std::string & msg) { throw py::value_error(msg); }

// broken accounting: AssertionError, like the Python block manager's asserts
[[noreturn]] void assert_fail(const std::string & msg) {
    PyErr_SetString(PyExc_AssertionError, msg.c_str());
    throw py::error_already_set();
}

// ---- block manager

void check_block_ids(const BlockManager & bm, const std::vector<int32_t> & ids, const char * name) {
    for (int32_t b : ids) {
        if (b < 0 || b >= bm.num_blocks()) {
            fail(std::string(name) + ": block id " + std::to_string(b) + " is out of range [0, " +
                 std::to_string(bm.num_blocks()) + ")");
        }
    }
}

void bind_block_manager(py::module_ & m) {
    py::class_<BlockSequence>(m, "BlockSequence",
                              "What the block manager reads and writes of a sequence (token ids, computed "
                              "tokens, block ids, hash chain).")
        .def(py::init([](std::vector<int32_t> token_ids) {
                 BlockSequence s;
                 s.token_ids = std::move(token_ids);
                 return s;
             }),
             py::arg("token_ids") = std::vector<int32_t>())
        .def_readwrite("token_ids", &BlockSequence::token_ids)
        .def_readwrite("num_computed_tokens", &BlockSequence::num_computed_tokens)
        .def_readwrite("block_ids", &BlockSequence::block_ids, "writable only for tests (a forged double free)")
        .def_readonly("block_hashes", &BlockSequence::block_hashes)
        .def_readwrite("adapter_uid", &BlockSequence::adapter_uid, "the LoRA adapter load whose chain its keys start (0: none)")
        .def_property_readonly("num_tokens", &BlockSequence::num_tokens)
        .def("append_token", [](BlockSequence & s, int32_t t) { s.token_ids.push_back(t); });

    py::class_<BlockManager>(m, "BlockManager")
        .def(py::init([](int32_t num_blocks, int32_t block_size, bool enable_prefix_caching, int64_t window) {
                 if (num_blocks < 1 || block_size < 1 || window < 0) {
                     fail("BlockManager needs num_blocks >= 1, block_size >= 1 and window >= 0, got " +
                          std::to_string(num_blocks) + ", " + std::to_string(block_size) + ", " +
                          std::to_string(window));
                 }
                 return new BlockManager(num_blocks, block_size, enable_prefix_caching, window);
             }),
             py::arg("num_blocks"), py::arg("block_size"), py::arg("enable_prefix_caching") = false,
             py::arg("window") = 0)
        .def_property_readonly("window", &BlockManager::window)
        .def_property_readonly("num_blocks", &BlockManager::num_blocks)
        .def_property_readonly("block_size", &BlockManager::block_size)
        .def_property_readonly("enable_prefix_caching", &BlockManager::enable_prefix_caching)
        .def_property_readonly("num_free_blocks", &BlockManager::num_free_blocks)
        .def_property_readonly("num_cached_blocks", &BlockManager::num_cached_blocks)
        .def_property_readonly("num_used_blocks", &BlockManager::num_used_blocks)
        .def_property_readonly("num_available_blocks", &BlockManager::num_available_blocks)
        .def_property_readonly("num_prefix_hit_tokens", &BlockManager::num_prefix_hit_tokens)
        .def_property_readonly("num_prefix_query_tokens", &BlockManager::num_prefix_query_tokens)
        .def("blocks_needed", &BlockManager::blocks_needed, py::arg("num_tokens"))
        .def("match_prefix",
             [](const BlockManager & bm, const std::vector<int32_t> & token_ids, uint64_t salt) {
                 PrefixMatch hit = bm.match_prefix(token_ids, salt);
                 return py::make_tuple(hit.block_ids, hit.num_cached_tokens);
             },
             py::arg("token_ids"), py::arg("salt") = 0, "salt: the sequence's adapter_uid")
        .def("allocate",
             [](BlockManager & bm, BlockSequence & seq, int64_t num_tokens, const std::vector<int32_t> & prefix) {
                 if (num_tokens < 0) fail("allocate: num_tokens must be >= 0, got " + std::to_string(num_tokens));
                 check_block_ids(bm, prefix, "allocate: prefix_block_ids");
                 if (!prefix.empty()) {
                     if (!seq.block_ids.empty()) fail("allocate: a prefix is only taken by a sequence without blocks");
                     for (int32_t b : prefix) {
                         if (!bm.is_registered(b)) fail("allocate: prefix block " + std::to_string(b) + " is not cached");
                     }
                 }
                 return bm.allocate(seq, num_tokens, prefix);
             },
             py::arg("seq"), py::arg("num_tokens"), py::arg("prefix_block_ids") = std::vector<int32_t>())
        .def("free",
             [](BlockManager & bm, BlockSequence & seq) {
                 if (!bm.free(seq)) assert_fail("free: the sequence holds a block more often than it is referenced");
             },
             py::arg("seq"))
        .def("cache_full_blocks", &BlockManager::cache_full_blocks, py::arg("seq"))
        .def("rollback",
             [](BlockManager & bm, BlockSequence & seq, int64_t num_tokens) {
                 if (num_tokens < 0) fail("rollback: num_tokens must be >= 0, got " + std::to_string(num_tokens));
                 bm.rollback(seq, num_tokens);
             },
             py::arg("seq"), py::arg("num_tokens"), "give back the blocks past those num_tokens tokens need")
        .def("release_outside_window", &BlockManager::release_outside_window, py::arg("seq"))
        .def("check_invariants",
             [](const BlockManager & bm, py::object seqs) {
                 std::string err;
                 if (seqs.is_none()) {
                     err = bm.check_invariants();
                 } else {
                     std::vector<const BlockSequence *> v;
                     for (py::handle h : seqs) v.push_back(&h.cast<const BlockSequence &>());
                     err = bm.check_invariants(&v);
                 }
                 if (!err.empty()) assert_fail(err);
             },
             py::arg("seqs") = py::none())
        .def("ref_count", &BlockManager::ref_count, py::arg("block"))
        .def("free_block_ids", &BlockManager::free_block_ids, "free blocks, next to be taken first")
        .def("cached_block_ids", &BlockManager::cached_block_ids, "cached blocks, next to be evicted first")
        .def("set_key_mask", &BlockManager::set_key_mask, py::arg("mask"),
             "test hook: and every prefix key with mask (0 forces every key equal)");
    m.def("block_key", [](uint64_t parent, const std::vector<int32_t> & tokens) {
        return block_key(parent, tokens.data(), (int64_t) tokens.size());
    }, py::arg("parent"), py::arg("token_ids"));
    m.attr("ROOT_KEY") = kRootKey;
    m.def("root_key", &root_key, py::arg("salt"), "the parent key of a first block: ROOT_KEY for salt 0");
}

// ---- sampler

// params: a dict, or any object with the fields' names as attributes (lmd.engine.SamplingParams);
// a missing or None field keeps its default
py::object field_of(py::handle params, const char * name) {
    if (py::isinstance<py::dict>(params)) {
        py::dict d = py::reinterpret_borrow<py::dict>(params);
        return d.contains(name) ? py::reinterpret_borrow<py::object>(d[name]) : py::none();
    }
    return py::getattr(params, name, py::none());
}

bool is_int(py::handle v) { return py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v); }

int64_t int_field(py::handle params, const char * name, int64_t def) {
    py::object v = field_of(params, name);
    if (v.is_none()) return def;
    if (!is_int(v)) fail(std::string("SamplingParams.") + name + ": expected an integer, got " + py::repr(v).cast<std::string>());
    return v.cast<int64_t>();
}

float float_field(py::handle params, const char * name, float def) {
    py::object v = field_of(params, name);
    if (v.is_none()) return def;
    if (py::isinstance<py::bool_>(v) || !(py::isinstance<py::int_>(v) || py::isinstance<py::float_>(v))) {
        fail(std::string("SamplingParams.") + name + ": expected a number, got " + py::repr(v).cast<std::string>());
    }
    return v.cast<float>();
}

std::vector<int32_t> ids_field(py::handle params, const char * name) {
    py::object v = field_of(params, name);
    std::vector<int32_t> out;
    if (v.is_none()) return out;
    for (py::handle t : v) {
        if (!is_int(t)) fail(std::string("SamplingParams.") + name + ": expected token ids, got " + py::repr(t).cast<std::string>());
        out.push_back(t.cast<int32_t>());
    }
    return out;
}

SamplingParams params_of(py::handle obj) {
    SamplingParams p;
    p.min_new_tokens = (int32_t) std::clamp<int64_t>(int_field(obj, "min_new_tokens", 0), -1, INT32_MAX);
    py::object greedy = field_of(obj, "greedy");
    if (!greedy.is_none()) {
        if (!py::isinstance<py::bool_>(greedy)) fail("SamplingParams.greedy: expected True or False");
        p.greedy = greedy.cast<bool>();
    }
    p.temperature = float_field(obj, "temperature", 1.0f);
    p.top_p = float_field(obj, "top_p", 1.0f);
    const int64_t top_k = int_field(obj, "top_k", 0);
    if (top_k < 0) fail("SamplingParams.top_k: must be >= 0, got " + std::to_string(top_k));
    p.top_k = (int32_t) std::min<int64_t>(top_k, INT32_MAX);
    p.min_p = float_field(obj, "min_p", 0.0f);
    p.repetition_penalty = float_field(obj, "repetition_penalty", 1.0f);
    p.presence_penalty = float_field(obj, "presence_penalty", 0.0f);
    p.frequency_penalty = float_field(obj, "frequency_penalty", 0.0f);
    py::object seed = field_of(obj, "random_seed");
    if (!seed.is_none()) {
        if (!is_int(seed)) fail("SamplingParams.random_seed: expected an integer");
        const unsigned long long v = PyLong_AsUnsignedLongLong(seed.ptr());
        if (v == (unsigned long long) -1 && PyErr_Occurred()) {
            PyErr_Clear();
            fail("SamplingParams.random_seed: must be in [0, 2**64 - 1], got " + py::repr(seed).cast<std::string>());
        }
        p.has_seed = true;
        p.random_seed = v;
    }
    p.stop_token_ids = ids_field(obj, "stop_token_ids");
    p.bad_token_ids = ids_field(obj, "bad_token_ids");
    py::object lp = field_of(obj, "logprobs");
    if (!lp.is_none()) {
        const int64_t k = int_field(obj, "logprobs", 0);
        if (k < 0 || k > 20) fail("SamplingParams.logprobs: must be in [0, 20], got " + std::to_string(k));
        p.logprobs = (int32_t) k;
    }
    py::object plp = field_of(obj, "prompt_logprobs");
    if (!plp.is_none()) {
        const int64_t k = int_field(obj, "prompt_logprobs", 0);
        if (k < 0 || k > 20) fail("SamplingParams.prompt_logprobs: must be in [0, 20], got " + std::to_string(k));
        p.prompt_logprobs = (int32_t) k;
    }
    const std::string err = sampling_params_check(p);
    if (!err.empty()) fail("SamplingParams." + err);
    return p;
}

using Logits = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Bitmask = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// Row pointers of an optional bitmask [batch, ceil(vocab / 32)] (None: an empty vector).
std::vector<const int32_t *> bitmask_rows(const py::object & bitmask, Bitmask & holder, int64_t batch, int64_t vocab,
                                          const char * fn) {
    std::vector<const int32_t *> rows;
    if (bitmask.is_none()) return rows;
    holder = bitmask.cast<Bitmask>();
    const int64_t words = (vocab + 31) / 32;
    if (holder.ndim() != 2 || holder.shape(0) != batch || holder.shape(1) != words) {
        std::string shape;
        for (py::ssize_t d = 0; d < holder.ndim(); ++d) shape += (d ? ", " : "") + std::to_string(holder.shape(d));
        fail(std::string(fn) + ": bitmask must be int32 [" + std::to_string(batch) + ", " + std::to_string(words) +
             "] (ceil(vocab / 32) words a row), got [" + shape + "]");
    }
    for (int64_t i = 0; i < batch; ++i) rows.push_back(holder.data() + i * words);
    return rows;
}

std::vector<const SamplingState *> states_of(const Logits & logits, const py::sequence & states, const char * fn) {
    if (logits.ndim() != 2) fail(std::string(fn) + ": logits must be [batch, vocab], got " + std::to_string(logits.ndim()) + " dims");
    if ((size_t) logits.shape(0) != py::len(states)) {
        fail(std::string(fn) + ": logits have " + std::to_string(logits.shape(0)) + " rows for " +
             std::to_string(py::len(states)) + " states");
    }
    if (logits.shape(1) < 1) fail(std::string(fn) + ": logits have an empty vocabulary");
    std::vector<const SamplingState *> out;
    for (py::handle h : states) out.push_back(&h.cast<const SamplingState &>());
    return out;
}

void bind_sampler(py::module_ & m) {
    py::class_<SamplingState>(m, "SamplingState",
                              "Per-request sampling state: params (a dict or lmd.engine.SamplingParams), the "
                              "prompt's ids, and the tokens appended since.")
        .def(py::init([](py::handle params, const std::vector<int32_t> & prompt_token_ids) {
                 return new SamplingState(params_of(params), prompt_token_ids.data(), (int64_t) prompt_token_ids.size());
             }),
             py::arg("params"), py::arg("prompt_token_ids") = std::vector<int32_t>())
        .def("append", &SamplingState::append, py::arg("token_id"))
        .def_readonly("num_generated", &SamplingState::num_generated)
        .def_readonly("greedy", &SamplingState::greedy)
        .def_readwrite("constrained", &SamplingState::constrained,
                       "a grammar decides where the text ends (the engine sets it for a request with a constraint)")
        .def("needs_processing", &SamplingState::needs_processing);

    py::class_<Sampler>(m, "Sampler")
        .def(py::init([](py::object seed) {
                 uint64_t s = seed.is_none() ? ((uint64_t) std::random_device{}() << 32) ^ std::random_device{}()
                                             : seed.cast<uint64_t>();
                 return new Sampler(s);
             }),
             py::arg("seed") = py::none(), "seed: of the stream rows without random_seed draw from (None: random)")
        .def("sample",
             [](Sampler & sampler, const Logits & logits, const py::sequence & states_seq, const py::object & bitmask) {
                 std::vector<const SamplingState *> states = states_of(logits, states_seq, "sample");
                 const int64_t batch = logits.shape(0), vocab = logits.shape(1);
                 Bitmask holder;
                 std::vector<const int32_t *> masks = bitmask_rows(bitmask, holder, batch, vocab, "sample");
                 std::vector<int32_t> ids(batch);
                 std::vector<std::vector<TokenLogprob>> lps;
                 {
                     py::gil_scoped_release release;
                     sampler.sample(logits.data(), batch, vocab, vocab, states.data(), ids.data(), &lps,
                                    masks.empty() ? nullptr : masks.data());
                 }
                 py::list out_lps;
                 for (int64_t i = 0; i < batch; ++i) {
                     if (states[i]->params.logprobs < 0) {
                         out_lps.append(py::none());
                         continue;
                     }
                     py::list row;
                     for (const TokenLogprob & t : lps[i]) row.append(py::make_tuple(t.token_id, t.logprob));
                     out_lps.append(row);
                 }
                 return py::make_tuple(ids, out_lps);
             },
             py::arg("logits"), py::arg("states"), py::arg("bitmask") = py::none(),
             "logits: float32 [batch, vocab]; bitmask: None or int32 [batch, ceil(vocab / 32)] (structured "
             "output; every row masked); -> (token_ids, logprobs): logprobs[i] is None, or "
             "[(chosen, lp), (alternative, lp), ...] best first");
    m.def("process_logits", [](const Logits & logits, const py::sequence & states_seq, const py::object & bitmask) {
        std::vector<const SamplingState *> states = states_of(logits, states_seq, "process_logits");
        Bitmask holder;
        std::vector<const int32_t *> masks = bitmask_rows(bitmask, holder, logits.shape(0), logits.shape(1),
                                                          "process_logits");
        py::array_t<float> out({logits.shape(0), logits.shape(1)});
        Sampler::process_logits(logits.data(), logits.shape(0), logits.shape(1), logits.shape(1), states.data(),
                                out.mutable_data(), masks.empty() ? nullptr : masks.data());
        return out;
    }, py::arg("logits"), py::arg("states"), py::arg("bitmask") = py::none(),
       "the logits after penalties, masks and the bitmask (None: none)");
    m.def("apply_token_bitmask", [](const Logits & logits, const py::object & bitmask) {
        if (logits.ndim() != 2) fail("apply_token_bitmask: logits must be [batch, vocab]");
        if (bitmask.is_none()) fail("apply_token_bitmask: bitmask is required");
        const int64_t batch = logits.shape(0), vocab = logits.shape(1);
        Bitmask holder;
        std::vector<const int32_t *> masks = bitmask_rows(bitmask, holder, batch, vocab, "apply_token_bitmask");
        py::array_t<float> out({batch, vocab});
        float * o = out.mutable_data();
        std::copy(logits.data(), logits.data() + batch * vocab, o);
        for (int64_t i = 0; i < batch; ++i) apply_token_bitmask(o + i * vocab, vocab, masks[i]);
        return out;
    }, py::arg("logits"), py::arg("bitmask"),
       "a copy of logits [batch, vocab] with every token whose bit is clear set to -inf");
    m.def("distribution", [](const Logits & logits, const py::sequence & states_seq) {
        std::vector<const SamplingState *> states = states_of(logits, states_seq, "distribution");
        py::array_t<float> out({logits.shape(0), logits.shape(1)});
        Sampler::distribution(logits.data(), logits.shape(0), logits.shape(1), logits.shape(1), states.data(),
                              out.mutable_data());
        return out;
    }, py::arg("logits"), py::arg("states"), "the normalized distribution each row draws from (greedy: one-hot)");
    m.def("seeded_uniform", &Sampler::seeded_uniform, py::arg("seed"), py::arg("num_generated"));
}


// ---- scheduler

const char * status_name(SequenceStatus s) {
    switch (s) {
        case SequenceStatus::waiting: return "waiting";
        case SequenceStatus::running: return "running";
        case SequenceStatus::idle: return "idle";
        case SequenceStatus::finished: return "finished";
    }
    return "?";
}

// The scheduler holds sequences by pointer: the binding keeps their Python objects alive from
// add() until finish(seq) without keep (a failed sequence too stays held until then).
struct PyScheduler {
    py::object block_manager;  // keeps the BlockManager the scheduler refers to alive
    Scheduler scheduler;
    std::unordered_map<const Sequence *, py::object> held;

    PyScheduler(py::object bm, int64_t max_batch_size, int64_t max_num_batched_tokens)
        : block_manager(bm), scheduler(bm.cast<BlockManager &>(), max_batch_size, max_num_batched_tokens) {}

    void hold(py::object obj) {
        const Sequence * seq = &obj.cast<const Sequence &>();
        if (held.count(seq)) fail("Scheduler.add: session " + std::to_string(seq->session_id) + " is already queued");
        held.emplace(seq, std::move(obj));
    }
    Sequence & of(py::object obj, const char * fn) {
        Sequence & seq = obj.cast<Sequence &>();
        if (!held.count(&seq)) fail(std::string("Scheduler.") + fn + ": session " + std::to_string(seq.session_id) + " is not in this scheduler");
        return seq;
    }
};

template <typename Seqs>
py::list seq_list(const Seqs & seqs) {
    py::list out;
    for (Sequence * s : seqs) out.append(py::cast(s, py::return_value_policy::reference));
    return out;
}

void bind_scheduler(py::module_ & m) {
    py::class_<Sequence>(m, "Sequence", "What the scheduler reads and writes of a sequence (pytorch_backend/sequence.py's "
                                        "fields of the same names).")
        .def(py::init([](int64_t session_id, std::vector<int32_t> token_ids) {
                 auto * s = new Sequence();
                 s->session_id = session_id;
                 s->blocks.token_ids = std::move(token_ids);
                 s->num_prompt_tokens = s->num_tokens();
                 return s;
             }),
             py::arg("session_id"), py::arg("token_ids"))
        .def_readonly("session_id", &Sequence::session_id)
        .def_property_readonly("token_ids", [](const Sequence & s) { return s.blocks.token_ids; })
        .def_property_readonly("num_tokens", &Sequence::num_tokens)
        .def_property_readonly("num_generated_tokens", &Sequence::num_generated_tokens)
        .def_property_readonly("num_computed_tokens", [](const Sequence & s) { return s.blocks.num_computed_tokens; })
        .def_property_readonly("block_ids", [](const Sequence & s) { return s.blocks.block_ids; })
        .def_property_readonly("block_hashes", [](const Sequence & s) { return s.blocks.block_hashes; })
        .def_property_readonly("blocks", [](Sequence & s) -> BlockSequence & { return s.blocks; },
                               py::return_value_policy::reference_internal, "its BlockSequence (for check_invariants)")
        .def_readonly("num_prompt_tokens", &Sequence::num_prompt_tokens)
        .def_readonly("num_cached_tokens", &Sequence::num_cached_tokens)
        .def_readonly("is_admitted", &Sequence::is_admitted)
        .def_readonly("num_preemptions", &Sequence::num_preemptions)
        .def_readwrite("skip_reading_prefix_cache", &Sequence::skip_reading_prefix_cache,
                       "admitted without a prefix-cache match (the engine sets it while prompt logprobs are read)")
        .def_property_readonly("status", [](const Sequence & s) { return status_name(s.status); })
        .def_readwrite("draft_token_ids", &Sequence::draft_token_ids,
                       "speculative decoding: tokens drafted to follow the context in the next step (schedule may cut them)")
        .def("append_token", [](Sequence & s, int32_t t) { s.blocks.token_ids.push_back(t); }, py::arg("token_id"))
        .def("start_turn", &Sequence::start_turn, py::arg("token_ids"),
             "an interactive session's next turn: its prompt follows the kept history");

    py::class_<SchedulerOutput>(m, "SchedulerOutput")
        .def_property_readonly("seqs", [](const SchedulerOutput & o) { return seq_list(o.seqs); })
        .def_readonly("num_scheduled_tokens", &SchedulerOutput::num_scheduled_tokens)
        .def_property_readonly("preempted", [](const SchedulerOutput & o) { return seq_list(o.preempted); })
        .def_property_readonly("failed", [](const SchedulerOutput & o) {
            py::list out;
            for (const auto & [s, why] : o.failed) out.append(py::make_tuple(py::cast(s, py::return_value_policy::reference), why));
            return out;
        })
        .def_property_readonly("is_empty", &SchedulerOutput::empty);

    py::class_<PyScheduler>(m, "Scheduler")
        .def(py::init([](py::object bm, int64_t max_batch_size, int64_t max_num_batched_tokens) {
                 if (!py::isinstance<BlockManager>(bm)) fail("Scheduler: block_manager must be an engine_parts.BlockManager");
                 if (max_batch_size < 1 || max_num_batched_tokens < 1) {
                     fail("Scheduler needs max_batch_size >= 1 and max_num_batched_tokens >= 1, got " +
                          std::to_string(max_batch_size) + ", " + std::to_string(max_num_batched_tokens));
                 }
                 return new PyScheduler(bm, max_batch_size, max_num_batched_tokens);
             }),
             py::arg("block_manager"), py::arg("max_batch_size"), py::arg("max_num_batched_tokens"))
        .def_property_readonly("has_work", [](const PyScheduler & p) { return p.scheduler.has_work(); })
        .def_property_readonly("num_preemptions", [](const PyScheduler & p) { return p.scheduler.num_preemptions(); })
        .def_property_readonly("waiting", [](const PyScheduler & p) { return seq_list(p.scheduler.waiting()); })
        .def_property_readonly("running", [](const PyScheduler & p) { return seq_list(p.scheduler.running()); })
        .def_property_readonly("idle", [](const PyScheduler & p) { return seq_list(p.scheduler.idle()); },
                               "kept sessions, least recently used first")
        .def("add",
             [](PyScheduler & p, py::object seq) {
                 p.hold(seq);
                 p.scheduler.add(&seq.cast<Sequence &>());
             },
             py::arg("seq"))
        .def("resume",
             [](PyScheduler & p, py::object obj) {
                 Sequence & seq = p.of(obj, "resume");
                 const auto & idle = p.scheduler.idle();
                 if (std::find(idle.begin(), idle.end(), &seq) == idle.end()) {
                     fail("Scheduler.resume: session " + std::to_string(seq.session_id) + " is not idle");
                 }
                 p.scheduler.resume(&seq);
             },
             py::arg("seq"))
        .def("schedule", [](PyScheduler & p) { return p.scheduler.schedule(); })
        .def("update", [](PyScheduler & p, const SchedulerOutput & out) { p.scheduler.update(out); }, py::arg("out"))
        .def("accept_draft",
             [](PyScheduler & p, py::object obj, int64_t num_accepted) {
                 p.scheduler.accept_draft(&p.of(obj, "accept_draft"), num_accepted);
             },
             py::arg("seq"), py::arg("num_accepted"),
             "after update: the first num_accepted drafts (already appended to the context) count as computed; the "
             "blocks of the rest go back")
        .def("check_invariants",
             [](const PyScheduler & p) {
                 const std::string err = p.scheduler.check_invariants();
                 if (!err.empty()) assert_fail(err);
             },
             "AssertionError unless every sequence holds exactly the blocks its computed tokens need and the block "
             "manager's invariants hold over them")
        .def("finish",
             [](PyScheduler & p, py::object obj, bool keep) {
                 Sequence & seq = p.of(obj, "finish");
                 p.scheduler.finish(&seq, keep);
                 if (!keep) p.held.erase(&seq);
             },
             py::arg("seq"), py::arg("keep") = false);
}

}  // namespace

// The one reader of sampling settings from Python: lmd.engine.SamplingParams, the frozen object
// the engines receive (or a dict with its field names, in tests). Engine.add and the sampler's
// bindings both use it, so a setting is checked the same way on every path.
SamplingParams sampling_params_from_python(py::handle obj) { return params_of(obj); }

void bind_engine_parts(py::module_ & m) {
    py::module_ sub = m.def_submodule("engine_parts", "The C++ engine's block manager, scheduler and sampler, bound for tests");
    bind_block_manager(sub);
    bind_scheduler(sub);
    bind_sampler(sub);
}

}  // namespace turbomind
