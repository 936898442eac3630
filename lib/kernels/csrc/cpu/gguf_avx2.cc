// AVX2 kernels of the GGUF block matmuls (gguf.h). Each type's blocks are turned, 32 values at a
// time, into one register of integer codes in natural order (Codes<T>::chunk), plus the scale and
// min of each 16 (Codes<T>::params); everything after that is shared:
// - W A16: a run of weight rows is dequantized into float32 (fma(s, q, m): exact), then multiplied
//   by the rows of x eight k at a time, one accumulator lane per k mod 8.
// - W A8: codes straight from the blocks in registers, for a tile of rows; vpmaddubsw (codes
//   unsigned, or |q| against x carrying q's sign) and vpmaddwd by ones give each lane's four
//   products in 32 bits, exactly; an offset comes off in integers, a float min per block in a scalar.
// Tiles only change which (m, n) pairs run together, never the arithmetic of one: results equal
// the reference bit for bit. Compiled with -mavx2 -mfma -mf16c; gguf.cc calls in only when the CPU
// has them.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/gguf.h"
#include "cpu/simd_avx2.h"

namespace lmd::cpu::avx2 {

namespace {

// An fp16 field as float32 (vmovd then vcvtph2ps: no merge into a register a previous block wrote,
// which _cvtsh_ss's vpinsrw makes a chain of dependencies through the whole row).
inline float half(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

inline __m256i load256(const uint8_t * p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

// 16 nibble bytes -> 32 codes: the low nibbles are values 0..15, the high ones 16..31.
inline __m256i nibbles32(const uint8_t * qs) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs)), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
}

// Bit j of the 32 bits at p, as 0x10 in byte j: byte j of a broadcast takes the byte holding bit j,
// every other bit of it is forced to 1, so the byte is all ones exactly when bit j was.
inline __m256i high_bits32(const uint8_t * p) {
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // byte j: all bits but j mod 8
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

inline __m256i shift_right16(__m256i v, int bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }

void scale_min_k4(int j, const uint8_t * sc, int & scale, int & min) {
    if (j < 4) {
        scale = sc[j] & 63;
        min = sc[j + 4] & 63;
    } else {
        scale = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// Per type: QK, B, the offset o (-1: float mins instead, gguf.h), whether codes are signed int8
// (else unsigned, at most 63), whether m is ever nonzero; params(block, s, m) fills the QK / 16
// scales and mins (m = -o s for an offset type); chunk(block, c) the codes of values 32 c .. 32 c + 31.
template <GgufType T> struct Codes;

template <> struct Codes<GgufType::Q4_0> {
    static constexpr int QK = 32, B = 18;
    static constexpr int kOffset = 8;
    static constexpr bool kSigned = false, kMins = true;
    static void params(const uint8_t * b, float * s, float * m) { s[0] = s[1] = half(b), m[0] = m[1] = -8.f * half(b); }
    static __m256i chunk(const uint8_t * b, int) { return nibbles32(b + 2); }
};
template <> struct Codes<GgufType::Q4_1> {
    static constexpr int QK = 32, B = 20;
    static constexpr int kOffset = -1;
    static constexpr bool kSigned = false, kMins = true;
    static void params(const uint8_t * b, float * s, float * m) { s[0] = s[1] = half(b), m[0] = m[1] = half(b + 2); }
    static __m256i chunk(const uint8_t * b, int) { return nibbles32(b + 4); }
};
template <> struct Codes<GgufType::Q5_0> {
    static constexpr int QK = 32, B = 22;
    static constexpr int kOffset = 16;
    static constexpr bool kSigned = false, kMins = true;
    static void params(const uint8_t * b, float * s, float * m) { s[0] = s[1] = half(b), m[0] = m[1] = -16.f * half(b); }
    static __m256i chunk(const uint8_t * b, int) { return _mm256_or_si256(nibbles32(b + 6), high_bits32(b + 2)); }
};
template <> struct Codes<GgufType::Q5_1> {
    static constexpr int QK = 32, B = 24;
    static constexpr int kOffset = -1;
    static constexpr bool kSigned = false, kMins = true;
    static void params(const uint8_t * b, float * s, float * m) { s[0] = s[1] = half(b), m[0] = m[1] = half(b + 2); }
    static __m256i chunk(const uint8_t * b, int) { return _mm256_or_si256(nibbles32(b + 8), high_bits32(b + 4)); }
};
template <> struct Codes<GgufType::Q8_0> {
    static constexpr int QK = 32, B = 34;
    static constexpr int kOffset = 0;
    static constexpr bool kSigned = true, kMins = false;
    static void params(const uint8_t * b, float * s, float * m) { s[0] = s[1] = half(b), m[0] = m[1] = 0.f; }
    static __m256i chunk(const uint8_t * b, int) { return load256(b + 2); }
};
template <> struct Codes<GgufType::IQ4_NL> {
    static constexpr int QK = 32, B = 18;
    static constexpr int kOffset = 0;
    static constexpr bool kSigned = true, kMins = false;
    static void params(const uint8_t * b, float * s, float * m) { s[0] = s[1] = half(b), m[0] = m[1] = 0.f; }
    static __m256i chunk(const uint8_t * b, int) {
        const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i *>(kIQ4NLValues));
        return _mm256_shuffle_epi8(_mm256_set_m128i(levels, levels), nibbles32(b + 2));
    }
};
template <GgufType T> struct CodesK {  // Q4_K and Q5_K
    static constexpr bool kFive = T == GgufType::Q5_K;
    static constexpr int QK = 256, B = kFive ? 176 : 144;
    static constexpr int kOffset = -1;
    static constexpr bool kSigned = false, kMins = true;
    static void params(const uint8_t * b, float * s, float * m) {
        const float d = half(b), dmin = half(b + 2);
        for (int j = 0; j < 8; ++j) {
            int scale, min;
            scale_min_k4(j, b + 4, scale, min);
            s[2 * j] = s[2 * j + 1] = d * static_cast<float>(scale);
            m[2 * j] = m[2 * j + 1] = -(dmin * static_cast<float>(min));
        }
    }
    static __m256i chunk(const uint8_t * b, int c) {
        const __m256i low = _mm256_set1_epi8(0x0F);
        const __m256i q = _mm256_and_si256(shift_right16(load256(b + (kFive ? 48 : 16) + 32 * (c / 2)), 4 * (c % 2)), low);
        if constexpr (!kFive) {
            return q;
        } else {
            const __m256i h = _mm256_and_si256(shift_right16(load256(b + 16), c), _mm256_set1_epi8(1));
            return _mm256_or_si256(q, _mm256_slli_epi16(h, 4));
        }
    }
};
template <> struct Codes<GgufType::Q4_K> : CodesK<GgufType::Q4_K> {};
template <> struct Codes<GgufType::Q5_K> : CodesK<GgufType::Q5_K> {};
template <> struct Codes<GgufType::Q6_K> {
    static constexpr int QK = 256, B = 210;
    static constexpr int kOffset = 32;
    static constexpr bool kSigned = false, kMins = true;
    static void params(const uint8_t * b, float * s, float * m) {
        const float d = half(b + 208);
        for (int j = 0; j < 16; ++j) {
            s[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
            m[j] = -32.f * s[j];
        }
    }
    static __m256i chunk(const uint8_t * b, int c) {  // half h = c / 4 of 128 values, run r = c % 4 of it
        const int h = c / 4, r = c % 4;
        const __m256i low = _mm256_and_si256(shift_right16(load256(b + 64 * h + 32 * (r % 2)), 4 * (r / 2)),
                                             _mm256_set1_epi8(0x0F));
        const __m256i high = _mm256_and_si256(shift_right16(load256(b + 128 + 32 * h), 2 * r), _mm256_set1_epi8(3));
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
};

// Bytes 8 i .. 8 i + 7 of v, less the offset, as eight float32.
template <bool kSigned, int kOffset>
inline __m256 codes8(__m256i v, int i) {
    const __m128i half128 = i < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
    const __m128i part = i % 2 ? _mm_unpackhi_epi64(half128, half128) : half128;
    __m256i q = kSigned ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
    if (kOffset > 0) q = _mm256_sub_epi32(q, _mm256_set1_epi32(kOffset));
    return _mm256_cvtepi32_ps(q);
}

// ---- dequantization: rows of raw into float32 ---------------------------------------------------

template <GgufType T>
void dequantize_row(const uint8_t * row, int64_t K, float * out) {
    using C = Codes<T>;
    float s[16], m[16];
    for (int64_t b = 0; b < K / C::QK; ++b) {
        const uint8_t * blk = row + b * C::B;
        C::params(blk, s, m);
        for (int c = 0; c < C::QK / 32; ++c) {
            const __m256i q = C::chunk(blk, c);
            float * w = out + b * C::QK + 32 * c;
            for (int i = 0; i < 4; ++i) {
                const int j = 2 * c + i / 2;
                const __m256 scale = _mm256_set1_ps(s[j]);
                if constexpr (C::kOffset >= 0) {  // s (q - o), as the file's format computes it
                    store8(w + 8 * i, _mm256_mul_ps(scale, codes8<C::kSigned, C::kOffset>(q, i)));
                } else {
                    store8(w + 8 * i, _mm256_fmadd_ps(scale, codes8<C::kSigned, 0>(q, i), _mm256_set1_ps(m[j])));
                }
            }
        }
    }
}

// ---- W A16: weight rows dequantized, then eight-lane dots --------------------------------------

// y[m, n0 + r] for MR rows of x against NR dequantized rows of w (row stride K).
template <int MR, int NR, typename YT>
void a16_tile(const float * x, int64_t ldx, int64_t K, const float * w, const float * bias, YT * y, int64_t ldy) {
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv[MR];
        for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
        for (int r = 0; r < NR; ++r) {
            const __m256 wv = _mm256_loadu_ps(w + r * K + k);
            for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(xv[i], wv, acc[i][r]);
        }
    }
    for (int i = 0; i < MR; ++i) {
        for (int r = 0; r < NR; ++r) {
            float v = hsum(acc[i][r]);
            if (bias) v += bias[r];
            store1(y + i * ldy + r, v);
        }
    }
}

template <typename YT>
void a16_rows(const float * x, int64_t ldx, int64_t M, int64_t K, const float * w, int64_t nr, const float * bias,
              YT * y, int64_t ldy) {
    auto b = [&](int r) { return bias ? bias + r : nullptr; };
    int64_t m = 0;
    if (nr == 4) {
        for (; m + 2 <= M; m += 2) a16_tile<2, 4>(x + m * ldx, ldx, K, w, bias, y + m * ldy, ldy);
        if (m < M) a16_tile<1, 4>(x + m * ldx, ldx, K, w, bias, y + m * ldy, ldy);
        return;
    }
    for (int r = 0; r < nr; ++r) {
        for (m = 0; m < M; ++m) a16_tile<1, 1>(x + m * ldx, ldx, K, w + r * K, b(r), y + m * ldy + r, ldy);
    }
}

// ---- W A8: codes straight from the blocks, integer dots ------------------------------------------

// W A8's activations (gguf.h): xq [M, K], dx [M, K / 32], sl [M, K / 32, 8] the lanes' int32 sums of
// xq, sb [M, K / 32] = float(S) * dx per block.
struct A8Acts {
    const int8_t * xq;
    const float * dx;
    const int32_t * sl;
    const float * sb;
    int64_t K;
};

template <bool kSigned>
inline __m256i lane_dots(__m256i q, __m256i xq) {
    const __m256i pairs = kSigned ? _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q))
                                  : _mm256_maddubs_epi16(q, xq);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

constexpr int log2_offset(int o) { return o == 8 ? 3 : o == 16 ? 4 : o == 32 ? 5 : 0; }

// y[m0 + i, r] for MR rows of x against NR rows of blocks (`rows`, row stride row_bytes).
template <GgufType T, int MR, int NR, typename YT>
void a8_tile(const A8Acts & a, int64_t m0, const uint8_t * rows, int64_t row_bytes, const float * bias, YT * y,
             int64_t ldy) {
    using C = Codes<T>;
    const int64_t K = a.K, nb = K / 32;
    __m256 acc[MR][NR];
    float U[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_setzero_ps(), U[i][r] = 0.f;
    float s[NR][16], m[NR][16];
    for (int64_t blk = 0; blk < K / C::QK; ++blk) {
        for (int r = 0; r < NR; ++r) C::params(rows + r * row_bytes + blk * C::B, s[r], m[r]);
        for (int c = 0; c < C::QK / 32; ++c) {
            const int64_t b = blk * (C::QK / 32) + c;
            __m256i xv[MR], offs[MR];
            float dxv[MR];
            for (int i = 0; i < MR; ++i) {
                const int64_t mb = (m0 + i) * nb + b;
                xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.xq + (m0 + i) * K + 32 * b));
                dxv[i] = a.dx[mb];
                if constexpr (C::kOffset > 0) {  // o S per lane: the codes' offset taken off in integers
                    offs[i] = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.sl + 8 * mb)),
                                                log2_offset(C::kOffset));
                }
            }
            for (int r = 0; r < NR; ++r) {
                const __m256i q = C::chunk(rows + r * row_bytes + blk * C::B, c);
                const float s0 = s[r][2 * c], s1 = s[r][2 * c + 1];
                for (int i = 0; i < MR; ++i) {
                    __m256i dot = lane_dots<C::kSigned>(q, xv[i]);
                    if constexpr (C::kOffset > 0) dot = _mm256_sub_epi32(dot, offs[i]);
                    const __m256 scale = C::QK == 256 && T == GgufType::Q6_K
                                             ? _mm256_set_m128(_mm_set1_ps(s1 * dxv[i]), _mm_set1_ps(s0 * dxv[i]))
                                             : _mm256_set1_ps(s0 * dxv[i]);
                    acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i][r]);
                    if constexpr (C::kOffset < 0) U[i][r] = std::fma(m[r][2 * c], a.sb[(m0 + i) * nb + b], U[i][r]);
                }
            }
        }
    }
    for (int i = 0; i < MR; ++i) {
        for (int r = 0; r < NR; ++r) {
            float v = hsum(acc[i][r]) + U[i][r];
            if (bias) v += bias[r];
            store1(y + i * ldy + r, v);
        }
    }
}

// Rows of x that stay in L2 while a run of weight rows is reused against them.
constexpr int64_t kMBlock = 64;
constexpr int kRun = 4;  // weight rows unpacked at a time

template <GgufType T, typename YT>
void a16_columns(const float * x, int64_t ldx, int64_t M, int64_t K, const uint8_t * raw, const float * bias, YT * y,
                 int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / Codes<T>::QK * Codes<T>::B;
    static thread_local std::vector<float> w;
    if (w.size() < static_cast<size_t>(kRun * K)) w.resize(kRun * K);
    for (int64_t mb = 0; mb < M; mb += kMBlock) {
        const int64_t me = std::min(M, mb + kMBlock);
        for (int64_t n = n0; n < n1; n += kRun) {
            const int nr = static_cast<int>(std::min<int64_t>(kRun, n1 - n));
            if (n + 2 * kRun <= n1) prefetch_range(raw + (n + kRun) * row_bytes, kRun * row_bytes);
            for (int r = 0; r < nr; ++r) dequantize_row<T>(raw + (n + r) * row_bytes, K, w.data() + r * K);
            a16_rows(x + mb * ldx, ldx, me - mb, K, w.data(), nr, bias ? bias + n : nullptr, y + mb * ldy + n, ldy);
        }
    }
}

template <GgufType T, typename YT>
void a8_columns(const A8Acts & a, int64_t M, const uint8_t * raw, const float * bias, YT * y, int64_t ldy, int64_t n0,
                int64_t n1) {
    const int64_t row_bytes = a.K / Codes<T>::QK * Codes<T>::B;
    auto at = [&](int64_t n) { return bias ? bias + n : nullptr; };
    for (int64_t mb = 0; mb < M; mb += kMBlock) {
        const int64_t me = std::min(M, mb + kMBlock);
        int64_t n = n0;
        for (; n + kRun <= n1; n += kRun) {
            if (n + 2 * kRun <= n1) prefetch_range(raw + (n + kRun) * row_bytes, kRun * row_bytes);
            int64_t m = mb;
            for (; m + 2 <= me; m += 2) a8_tile<T, 2, kRun>(a, m, raw + n * row_bytes, row_bytes, at(n), y + m * ldy + n, ldy);
            if (m < me) a8_tile<T, 1, kRun>(a, m, raw + n * row_bytes, row_bytes, at(n), y + m * ldy + n, ldy);
        }
        for (; n < n1; ++n) {
            for (int64_t m = mb; m < me; ++m) a8_tile<T, 1, 1>(a, m, raw + n * row_bytes, row_bytes, at(n), y + m * ldy + n, ldy);
        }
    }
}

template <GgufType T> using TypeTag = std::integral_constant<GgufType, T>;

// fn(TypeTag<T>()) for the GgufType of id `type`.
template <typename Fn>
void with_type(int type, Fn && fn) {
    switch (static_cast<GgufType>(type)) {
        case GgufType::Q4_0: fn(TypeTag<GgufType::Q4_0>()); break;
        case GgufType::Q4_1: fn(TypeTag<GgufType::Q4_1>()); break;
        case GgufType::Q5_0: fn(TypeTag<GgufType::Q5_0>()); break;
        case GgufType::Q5_1: fn(TypeTag<GgufType::Q5_1>()); break;
        case GgufType::Q8_0: fn(TypeTag<GgufType::Q8_0>()); break;
        case GgufType::Q4_K: fn(TypeTag<GgufType::Q4_K>()); break;
        case GgufType::Q5_K: fn(TypeTag<GgufType::Q5_K>()); break;
        case GgufType::Q6_K: fn(TypeTag<GgufType::Q6_K>()); break;
        case GgufType::IQ4_NL: fn(TypeTag<GgufType::IQ4_NL>()); break;
    }
}

// fn(YT * y) for y's dtype.
template <typename Fn>
void with_output(const TensorView & y, Fn && fn) {
    switch (y.dtype) {
        case DType::f32: fn(y.ptr<float>()); break;
        case DType::bf16: fn(y.ptr<bf16>()); break;
        case DType::f16: fn(y.ptr<f16>()); break;
        default: break;
    }
}

}  // namespace

void gguf_dequantize_rows(const uint8_t * raw, int type, int64_t K, float * out, int64_t n0, int64_t n1) {
    const int64_t row_bytes = gguf_row_bytes(type, K);
    with_type(type, [&](auto tag) {
        constexpr GgufType T = decltype(tag)::value;
        for (int64_t n = n0; n < n1; ++n) dequantize_row<T>(raw + n * row_bytes, K, out + n * K);
    });
}

void linear_gguf_a16_rows(const float * x, int64_t ldx, int64_t M, int64_t K, const uint8_t * raw, int type,
                          const float * bias, const TensorView & y, int64_t n0, int64_t n1) {
    with_output(y, [&](auto * yp) {
        with_type(type, [&](auto tag) {
        constexpr GgufType T = decltype(tag)::value; a16_columns<T>(x, ldx, M, K, raw, bias, yp, y.stride(0), n0, n1); });
    });
}

void gguf_a8_prepare(const int8_t * xq, const float * dx, int64_t M, int64_t K, int32_t * sl, float * sb) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t b = 0; b < K / 32; ++b) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq + m * K + 32 * b));
            const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16);
            const int64_t i = m * (K / 32) + b;
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(sl + 8 * i), sums);
            int32_t lanes[8];
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(lanes), sums);
            int32_t total = 0;
            for (int l = 0; l < 8; ++l) total += lanes[l];
            sb[i] = static_cast<float>(total) * dx[i];
        }
    }
}

void linear_gguf_a8_rows(const int8_t * xq, const float * dx, const int32_t * sl, const float * sb, int64_t M,
                         int64_t K, const uint8_t * raw, int type, const float * bias, const TensorView & y,
                         int64_t n0, int64_t n1) {
    const A8Acts a{xq, dx, sl, sb, K};
    with_output(y, [&](auto * yp) {
        with_type(type, [&](auto tag) {
            constexpr GgufType T = decltype(tag)::value;
            a8_columns<T>(a, M, raw, bias, yp, y.stride(0), n0, n1);
        });
    });
}

}  // namespace lmd::cpu::avx2
