#include "core/tensor.h"

#include <cmath>

namespace lmd {

// IEEE binary16 by hand: the scalar paths must not need F16C.
float f16_to_f32(uint16_t h) {
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    float f;
    if (exp == 0) {  // zero or subnormal: man * 2^-24
        f = std::ldexp(static_cast<float>(man), -24);
        return sign ? -f : f;
    }
    uint32_t u;
    if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_f16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);    // NaN
    if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);   // overflows to inf
    if (abs < 0x38800000u) {  // subnormal or zero in half: round abs * 2^24 to an integer
        const float a = std::fabs(f) * 16777216.0f;
        return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a)));
    }
    uint32_t r = abs - 0x38000000u;  // rebias 127 -> 15 (exponent field shifts by 112 << 23)
    r += 0xfffu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
}

}  // namespace lmd
