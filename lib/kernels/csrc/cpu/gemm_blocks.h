// The cache blocking of the packed GEMMs (M >= 6), shared by every instruction set's kernels
// (gemm_avx2.cc, gemm_w4a16_avx2.cc, gemm_avx512.cc): it holds no vector code of its own.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/gemm.h"

namespace lmd::cpu {

// k per step of the GEMM: a chunk of kKC x 16 float32 (16 KiB) stays in L1 while every tile
// of x passes over it (W4A16 takes whole groups: a multiple of G near it).
constexpr int64_t kKC = 256;
// Bytes of x rows that one pass over this thread's panels keeps in L2 (512 KiB a core on
// Zen 3): the rows of x are taken in blocks of about this size, each block meeting every panel.
constexpr int64_t kXBlockBytes = 256 << 10;

// The GEMM's blocking for M >= 6, shared by the float and W4A16 kernels. The rows of x go
// in blocks of mc (about kXBlockBytes of them: the block stays in L2 while this thread's
// panels [p0, p1) stream past it); per block and panel, k in chunks of kc (whole W4A16
// groups). fn(m, mr, p, k0, kc, part) runs one tile of mr <= MR rows from m over a chunk,
// after chunk(p, k0, kc) has readied it; part [mr, 16] keeps the tile's partial sums
// between chunks.
template <int MR, typename Chunk, typename Fn>
void gemm_blocks(int64_t M, int64_t K, int64_t kc, int64_t p0, int64_t p1, Chunk && chunk, Fn && fn) {
    static thread_local std::vector<float> part;
    const int64_t mc = std::max<int64_t>(1, kXBlockBytes / (K * 4) / MR) * MR;
    part.resize(std::min(M, mc) * kPanelWidth);
    for (int64_t mb = 0; mb < M; mb += mc) {
        const int64_t me = std::min(M, mb + mc);
        for (int64_t p = p0; p < p1; ++p) {
            for (int64_t k0 = 0; k0 < K; k0 += kc) {
                const int64_t kn = std::min(kc, K - k0);
                chunk(p, k0, kn);
                for (int64_t m = mb; m < me; m += MR) {
                    fn(m, static_cast<int>(std::min<int64_t>(MR, me - m)), p, k0, kn, part.data() + (m - mb) * kPanelWidth);
                }
            }
        }
    }
}

}  // namespace lmd::cpu
