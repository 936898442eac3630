#include "models/mla.h"

#include <cstring>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/mla_attention.h"
#include "models/moe.h"  // apply_linear
#include "models/views.h"

namespace turbomind {

namespace {

// The n elements at `data` rotated NeoX style by position p's row of cos_sin [max_position, n], in float32.
void rotate(void * data, DType dt, int64_t n, const TensorView & cos_sin, int64_t p) {
    const int64_t half = n / 2, base = p * cos_sin.stride(0);
    for (int64_t i = 0; i < half; ++i) {
        const float c = load_f32(cos_sin.data, base + i, cos_sin.dtype), s = load_f32(cos_sin.data, base + half + i, cos_sin.dtype);
        const float x1 = load_f32(data, i, dt), x2 = load_f32(data, half + i, dt);
        store_f32(data, i, dt, x1 * c - x2 * s);
        store_f32(data, half + i, dt, x2 * c + x1 * s);
    }
}

uint8_t * at(const TensorView & t, int64_t elems) { return static_cast<uint8_t *>(t.data) + elems * dtype_size(t.dtype); }

// Head h's matrix of a contiguous [heads, N, K] stack.
TensorView head(const TensorView & stack, int64_t h) {
    return view(at(stack, h * stack.size(1) * stack.size(2)), stack.dtype, {stack.size(1), stack.size(2)});
}

}  // namespace

void mla_attention(const MlaWeights & w, const LinearWeights & o, int64_t num_heads, float eps, float scale,
                   const TensorView & x, const TensorView & positions, const TensorView & cos_sin,
                   const TensorView & cache, const TensorView & slots, const TensorView & tables,
                   const TensorView & row_seqs, const TensorView & lens, const TensorView & out,
                   bool int8_activations) {
    const int64_t T = x.size(0), Hq = num_heads, L = w.kv_lora_rank, R = w.qk_rope_head_dim;
    const int64_t nope = w.qk_nope_head_dim, V = w.v_head_dim, Dq = nope + R, Dc = w.cache_dim();
    const DType dt = x.dtype;
    const size_t es = dtype_size(dt);
    static thread_local Scratch s_qa, s_q, s_kv, s_ql, s_ol, s_heads;

    // q [T, Hq, nope + rope], through the low-rank pair where there is one
    const TensorView q = view(s_q.get(T * Hq * Dq * es), dt, {T, Hq * Dq});
    if (w.q_a_norm.data) {
        const int64_t r = w.q_a_norm.size(0);
        const TensorView qa = view(s_qa.get(T * r * es), dt, {T, r});
        apply_linear(x, w.q_a, qa, int8_activations);
        cpu::rms_norm(qa, w.q_a_norm, eps, qa, nullptr);
        apply_linear(qa, w.q, q, int8_activations);
    } else {
        apply_linear(x, w.q, q, int8_activations);
    }
    // each row's [latent | key]: the latent normed, the key and q's rope dims rotated, then into the cache
    const TensorView kv = view(s_kv.get(T * Dc * es), dt, {T, Dc});
    apply_linear(x, w.kv_a, kv, int8_activations);
    const TensorView latent = strided(kv.data, dt, T, L, Dc);
    cpu::rms_norm(latent, w.kv_a_norm, eps, latent, nullptr);
    const int64_t * pos = positions.ptr<int64_t>();
    const int64_t * slot = slots.ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
        rotate(at(kv, t * Dc + L), dt, R, cos_sin, pos[t]);
        for (int64_t h = 0; h < Hq; ++h) rotate(at(q, (t * Hq + h) * Dq + nope), dt, R, cos_sin, pos[t]);
        std::memcpy(at(cache, slot[t] * Dc), at(kv, t * Dc), Dc * es);
    }
    // the latent queries [T, Hq, L + rope]: q_nope · W_UK per head, then q_pe
    const TensorView ql = view(s_ql.get(T * Hq * Dc * es), dt, {T, Hq, Dc});
    for (int64_t h = 0; h < Hq; ++h) {
        cpu::linear(strided(at(q, h * Dq), dt, T, nope, Hq * Dq), head(w.w_uk_t, h), nullptr,
                    strided(at(ql, h * Dc), dt, T, L, Hq * Dc));
        for (int64_t t = 0; t < T; ++t) std::memcpy(at(ql, (t * Hq + h) * Dc + L), at(q, (t * Hq + h) * Dq + nope), R * es);
    }
    const TensorView ol = view(s_ol.get(T * Hq * L * es), dt, {T, Hq, L});
    cpu::paged_latent_attention(ql, cache, tables, row_seqs.ptr<int32_t>(), lens, scale, ol);
    // each head's output, latent · W_UVᵀ, side by side [T, Hq v], then o_proj
    const TensorView heads = view(s_heads.get(T * Hq * V * es), dt, {T, Hq * V});
    for (int64_t h = 0; h < Hq; ++h) {
        cpu::linear(strided(at(ol, h * L), dt, T, L, Hq * L), head(w.w_uv, h), nullptr,
                    strided(at(heads, h * V), dt, T, V, Hq * V));
    }
    apply_linear(heads, o, out, int8_activations);
}

}  // namespace turbomind
