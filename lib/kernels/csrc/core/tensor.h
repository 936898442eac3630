// A non-owning view of a tensor in host or CUDA memory: what the kernels take. The bindings
// build one from a DLPack capsule after checking device, dtype and layout, so kernels trust it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace lmd {

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2, i32 = 3, i64 = 4, i8 = 5, u8 = 6 };

inline size_t dtype_size(DType t) {
    switch (t) {
        case DType::f32: case DType::i32: return 4;
        case DType::bf16: case DType::f16: return 2;
        case DType::i64: return 8;
        case DType::i8: case DType::u8: return 1;
    }
    return 0;
}

inline const char * dtype_name(DType t) {
    switch (t) {
        case DType::f32: return "float32";
        case DType::bf16: return "bfloat16";
        case DType::f16: return "float16";
        case DType::i32: return "int32";
        case DType::i64: return "int64";
        case DType::i8: return "int8";
        case DType::u8: return "uint8";
    }
    return "?";
}

constexpr int kMaxDims = 6;

enum class Device : int { cpu = 0, cuda = 1 };

struct TensorView {
    void * data = nullptr;
    DType dtype = DType::f32;
    Device device = Device::cpu;
    int device_id = 0;  // the CUDA ordinal (0 on the CPU)
    int ndim = 0;
    int64_t shape[kMaxDims] = {};
    int64_t strides[kMaxDims] = {};  // in elements

    int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
    int64_t stride(int d) const { return strides[d < 0 ? d + ndim : d]; }
    int64_t numel() const {
        int64_t n = 1;
        for (int i = 0; i < ndim; ++i) n *= shape[i];
        return n;
    }
    bool contiguous() const {
        int64_t expect = 1;
        for (int i = ndim - 1; i >= 0; --i) {
            if (shape[i] != 1 && strides[i] != expect) return false;
            expect *= shape[i];
        }
        return true;
    }
    template <typename T> T * ptr() const { return static_cast<T *>(data); }
};

// A quantized KV cache (quant_policy 8 or 4). k_cache and v_cache are uint8
// [num_blocks, block_size, Hk, D * bits / 8] (4 bits: element 2i in the low nibble of byte i,
// 2i + 1 in the high one); each (token, head) row of D values has its own asymmetric pair
// (scale, zero) in k_params / v_params, float32 [num_blocks, block_size, Hk, 2]:
//   x ≈ q * scale + zero,   scale = (max - min) / (2^bits - 1),   zero = min,
//   q = round-half-even((x - min) * (1 / scale)) clamped to [0, 2^bits - 1]  (0 when scale is 0).
struct KVQuant {
    TensorView k_params, v_params;
    int bits = 0;
};

// float <-> bfloat16 / float16 in scalar code (the reference kernels and the tails).
inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace lmd

namespace lmd {

// Element idx of a buffer of dtype t, as float (reference kernels and tails only: slow).
inline float load_f32(const void * base, int64_t idx, DType t) {
    switch (t) {
        case DType::f32: return static_cast<const float *>(base)[idx];
        case DType::bf16: return bf16_to_f32(static_cast<const uint16_t *>(base)[idx]);
        case DType::f16: return f16_to_f32(static_cast<const uint16_t *>(base)[idx]);
        default: return 0.f;
    }
}

inline void store_f32(void * base, int64_t idx, DType t, float v) {
    switch (t) {
        case DType::f32: static_cast<float *>(base)[idx] = v; break;
        case DType::bf16: static_cast<uint16_t *>(base)[idx] = f32_to_bf16(v); break;
        case DType::f16: static_cast<uint16_t *>(base)[idx] = f32_to_f16(v); break;
        default: break;
    }
}

}  // namespace lmd
