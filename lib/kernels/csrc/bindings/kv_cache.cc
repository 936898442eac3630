// The paged KV cache's arguments, checked once (kv_cache.h).
#include "bindings/kv_cache.h"

#include <string>

namespace lmd {

bool check_kv_cache(const TensorView & kc, const TensorView & vc, py::handle kp_h, py::handle vp_h, DType dtype,
                    int64_t num_kv_heads, int64_t D, KVQuant & kvq, ViewReader read) {
    const bool quantized = !kp_h.is_none() || !vp_h.is_none();
    if (!quantized) {
        expect(kc.ndim == 4 && kc.contiguous() && kc.dtype == dtype && kc.size(2) == num_kv_heads && kc.size(3) == D,
               "k_cache", kc, "must be a contiguous [num_blocks, block_size, " + std::to_string(num_kv_heads) + ", " +
               std::to_string(D) + "] tensor of " + dtype_name(dtype));
    } else {
        if (kp_h.is_none() || vp_h.is_none()) fail("k_params and v_params: give both (a quantized cache) or neither");
        expect(kc.ndim == 4 && kc.contiguous() && kc.dtype == DType::u8 && kc.size(2) == num_kv_heads &&
               (kc.size(3) == D || (D % 2 == 0 && kc.size(3) == D / 2)), "k_cache", kc,
               "a quantized cache must be a contiguous uint8 [num_blocks, block_size, " + std::to_string(num_kv_heads) +
               ", D or D / 2] tensor (8 or 4 bits), D = " + std::to_string(D));
        kvq.bits = kc.size(3) == D ? 8 : 4;
        kvq.k_params = read(kp_h, "k_params");
        kvq.v_params = read(vp_h, "v_params");
        for (const TensorView * p : {&kvq.k_params, &kvq.v_params}) {
            expect(p->ndim == 4 && p->contiguous() && p->dtype == DType::f32 && p->size(0) == kc.size(0) &&
                   p->size(1) == kc.size(1) && p->size(2) == kc.size(2) && p->size(3) == 2,
                   p == &kvq.k_params ? "k_params" : "v_params", *p,
                   "must be a contiguous float32 [num_blocks, block_size, Hk, 2] tensor (scale, zero)");
        }
    }
    expect(vc.ndim == 4 && vc.contiguous() && vc.dtype == kc.dtype, "v_cache", vc, "must match k_cache");
    for (int i = 0; i < 4; ++i) expect(vc.size(i) == kc.size(i), "v_cache", vc, "must have k_cache's shape");
    return quantized;
}

}  // namespace lmd
