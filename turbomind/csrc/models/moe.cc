#include "models/moe.h"
#include "models/views.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "cpu/kernels.h"

namespace turbomind {

namespace {

// A contiguous [rows, cols] view of `data`.
TensorView matrix(void * data, DType dtype, int64_t rows, int64_t cols) { return view(data, dtype, {rows, cols}); }

// Rows [r0, r0 + n) of a contiguous matrix.
TensorView rows(const TensorView & m, int64_t r0, int64_t n) {
    return matrix(static_cast<uint8_t *>(m.data) + r0 * m.size(1) * dtype_size(m.dtype), m.dtype, n, m.size(1));
}

float round_to(float v, DType dtype) {
    uint32_t word = 0;
    store_f32(&word, 0, dtype, v);
    return load_f32(&word, 0, dtype);
}

// Each token's experts ids[T, k] and weights[T, k] from the router's logits[T, E] (the file comment).
void route(const MoeWeights & w, const float * logits, int64_t T, DType dtype, int32_t * ids, float * weights) {
    const int64_t E = w.num_experts(), k = w.top_k;
    std::vector<float> probs(static_cast<size_t>(E));
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::vector<float> best(static_cast<size_t>(w.num_groups));        // grouped routing: each group's best
    std::vector<int32_t> groups(static_cast<size_t>(w.num_groups));
    for (int64_t t = 0; t < T; ++t) {
        const float * l = logits + t * E;
        if (w.topk_softmax) {  // gpt-oss: the k largest logits, then a softmax over them
            std::iota(order.begin(), order.end(), 0);
            std::partial_sort(order.begin(), order.begin() + k, order.end(),
                              [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
            float sum = 0.0f;
            for (int64_t j = 0; j < k; ++j) sum += probs[j] = std::exp(l[order[j]] - l[order[0]]);
            for (int64_t j = 0; j < k; ++j) {
                ids[t * k + j] = order[j];
                weights[t * k + j] = w.round_weights ? round_to(probs[j] / sum, dtype) : probs[j] / sum;
            }
            continue;
        }
        const float top = *std::max_element(l, l + E);
        float sum = 0.0f;
        for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(l[e] - top);
        for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
        if (w.num_groups > 1) {  // DeepSeek-V2: only the experts of the topk_groups best groups stay eligible
            const int64_t G = w.num_groups, per = E / G;
            for (int64_t g = 0; g < G; ++g) best[g] = *std::max_element(probs.begin() + g * per, probs.begin() + (g + 1) * per);
            std::iota(groups.begin(), groups.end(), 0);
            std::partial_sort(groups.begin(), groups.begin() + w.topk_groups, groups.end(),
                              [&](int32_t a, int32_t b) { return best[a] > best[b] || (best[a] == best[b] && a < b); });
            for (int64_t g = w.topk_groups; g < G; ++g) std::fill(probs.begin() + groups[g] * per, probs.begin() + (groups[g] + 1) * per, 0.0f);
        }
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + k, order.end(),
                          [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
        float picked = 0.0f;
        for (int64_t j = 0; j < k; ++j) picked += probs[order[j]];
        for (int64_t j = 0; j < k; ++j) {
            float p = probs[order[j]];
            if (w.norm_topk_prob) p /= picked;
            p *= w.routed_scaling_factor;
            ids[t * k + j] = order[j];
            weights[t * k + j] = w.round_weights ? round_to(p, dtype) : p;
        }
    }
}

// x[T, H] as float32 (the router's and the shared gate's input: their logits in float32).
TensorView widened(const TensorView & x) {
    static thread_local Scratch s;
    const int64_t n = x.numel();
    float * f = s.get<float>(n);
    for (int64_t i = 0; i < n; ++i) f[i] = load_f32(x.data, i, x.dtype);
    return matrix(f, DType::f32, x.size(0), x.size(1));
}

// gpt-oss's clamped SwiGLU, act[T, I] from gu[T, 2 I] = [gate | up] (the file comment), in float32 and
// rounded to the model dtype once, as transformers' float32 reference computes it.
void clamped_swiglu(const TensorView & gu, const TensorView & act, float limit, float alpha) {
    const int64_t T = gu.size(0), I = act.size(1);
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < I; ++i) {
            const float gate = std::fmin(load_f32(gu.data, t * 2 * I + i, gu.dtype), limit);
            const float up = std::fmax(std::fmin(load_f32(gu.data, t * 2 * I + I + i, gu.dtype), limit), -limit);
            store_f32(act.data, t * I + i, act.dtype, (up + 1.0f) * (gate / (1.0f + std::exp(-alpha * gate))));
        }
    }
}

// y[T, H] = down(act(gate_up(x))), in the buffers gu and act of 2 I and I columns; act is silu_and_mul,
// or the clamped SwiGLU where limit > 0.
void swiglu(const TensorView & x, const LinearWeights & gate_up, const LinearWeights & down, const TensorView & gu,
            const TensorView & act, const TensorView & y, bool int8_activations, float limit = 0.f,
            float alpha = 1.f) {
    apply_linear(x, gate_up, gu, int8_activations);
    if (limit > 0.f) {
        clamped_swiglu(gu, act, limit, alpha);
    } else {
        cpu::silu_and_mul(gu, act);
    }
    apply_linear(act, down, y, int8_activations);
}

}  // namespace

void moe_forward(const MoeWeights & w, const TensorView & x, const TensorView & out, bool int8_activations) {
    const int64_t T = x.size(0), H = x.size(1), E = w.num_experts(), k = w.top_k, I = w.intermediate_size;
    const int64_t S = w.shared_intermediate_size, TK = T * k;
    const DType dt = x.dtype;
    const size_t es = dtype_size(dt);
    static thread_local Scratch s_logits, s_ids, s_weights, s_pos, s_xs, s_gu, s_act, s_ys, s_gate, s_sout;

    // route every token
    const TensorView xf = widened(x);
    const TensorView logits = matrix(s_logits.get<float>(T * E), DType::f32, T, E);
    apply_linear(xf, w.router, logits, false);
    int32_t * ids = s_ids.get<int32_t>(TK);
    float * weights = s_weights.get<float>(TK);
    route(w, logits.ptr<float>(), T, dt, ids, weights);

    // group the (token, slot) pairs by expert, in token order within an expert: pos[t k + j] is the
    // grouped row of token t's j-th expert
    std::vector<int64_t> start(static_cast<size_t>(E + 1), 0);
    for (int64_t i = 0; i < TK; ++i) ++start[ids[i] + 1];
    std::partial_sum(start.begin(), start.end(), start.begin());
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    int64_t * pos = s_pos.get<int64_t>(TK);
    const TensorView xs = matrix(s_xs.get<uint8_t>(TK * H * es), dt, TK, H);
    for (int64_t i = 0; i < TK; ++i) {
        pos[i] = fill[ids[i]]++;
        std::memcpy(static_cast<uint8_t *>(xs.data) + pos[i] * H * es,
                    static_cast<const uint8_t *>(x.data) + (i / k) * H * es, H * es);
    }

    // each expert with rows: its two matmuls over all of them
    const int64_t width = std::max(I, S);
    const TensorView gu = matrix(s_gu.get<uint8_t>(std::max(TK, T) * 2 * width * es), dt, std::max(TK, T), 2 * width);
    const TensorView act = matrix(s_act.get<uint8_t>(std::max(TK, T) * width * es), dt, std::max(TK, T), width);
    const TensorView ys = matrix(s_ys.get<uint8_t>(TK * H * es), dt, TK, H);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = start[e], n = start[e + 1] - start[e];
        if (n == 0) continue;
        swiglu(rows(xs, r0, n), w.gate_up[e], w.down[e], matrix(gu.data, dt, n, 2 * I), matrix(act.data, dt, n, I),
               rows(ys, r0, n), int8_activations, w.swiglu_limit, w.swiglu_alpha);
    }

    // Qwen2-MoE's shared expert over every token, and its gate's logit
    TensorView sout, gate;
    if (S) {
        sout = matrix(s_sout.get<uint8_t>(T * H * es), dt, T, H);
        swiglu(x, w.shared_gate_up, w.shared_down, matrix(gu.data, dt, T, 2 * S), matrix(act.data, dt, T, S), sout,
               int8_activations);
        if (w.shared_gated) {
            gate = matrix(s_gate.get<float>(T), DType::f32, T, 1);
            apply_linear(xf, w.shared_gate, gate, false);
        }
    }

    // each token's sum in float32, its experts in top-k order, then the shared expert
    std::vector<float> acc(static_cast<size_t>(H));
    for (int64_t t = 0; t < T; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < k; ++j) {
            const float wj = weights[t * k + j];
            const int64_t base = pos[t * k + j] * H;
            for (int64_t h = 0; h < H; ++h) acc[h] += wj * load_f32(ys.data, base + h, dt);
        }
        if (S) {
            const float g = w.shared_gated ? 1.0f / (1.0f + std::exp(-gate.ptr<float>()[t])) : 1.0f;
            for (int64_t h = 0; h < H; ++h) acc[h] += g * load_f32(sout.data, t * H + h, dt);
        }
        for (int64_t h = 0; h < H; ++h) store_f32(out.data, t * H + h, dt, acc[h]);
    }
}

}  // namespace turbomind
