// The latent attention in lmd.kernels.ops (cpu/mla_attention.h): DeepSeek-V2's attention over a cache
// whose rows are both its keys and, in their first v_dim dims, its values.
#include <pybind11/pybind11.h>

#include <string>

#include "core/py_tensor.h"
#include "cpu/mla_attention.h"

namespace py = pybind11;

namespace lmd {
namespace {

void paged_latent_attention(py::handle q_h, py::handle cache_h, py::handle tables_h, py::handle lens_h, float scale,
                            py::handle out_h, py::handle row_seqs_h, bool reference) {
    const TensorView q = view_of(q_h, "q"), cache = view_of(cache_h, "cache"), out = view_of(out_h, "out");
    const TensorView tables = view_of(tables_h, "block_tables"), lens = view_of(lens_h, "context_lens");
    expect(q.ndim == 3 && q.stride(2) == 1 && is_float(q.dtype), "q", q, "must be a float [B, Hq, D] tensor with unit stride in D");
    const int64_t B = q.size(0), D = q.size(2);
    expect(cache.ndim == 4 && cache.contiguous() && cache.size(2) == 1 && cache.size(3) == D && cache.dtype == q.dtype,
           "cache", cache, "must be a contiguous [num_blocks, block_size, 1, D = " + std::to_string(D) +
           "] tensor with q's dtype");
    expect(out.ndim == 3 && out.stride(2) == 1 && out.dtype == q.dtype && out.size(0) == B && out.size(1) == q.size(1) &&
           out.size(2) >= 1 && out.size(2) <= D, "out", out, "must be [B, Hq, v_dim <= D] with q's dtype");
    expect(tables.ndim == 2 && tables.dtype == DType::i32 && tables.stride(1) == 1, "block_tables", tables,
           "must be an int32 [S, max_blocks] tensor");
    expect(lens.ndim == 1 && lens.dtype == DType::i32 && lens.stride(0) == 1 && lens.size(0) == B,
           "context_lens", lens, "must be an int32 [B] tensor");
    TensorView row_seqs;
    const bool has_rows = !row_seqs_h.is_none();
    if (has_rows) {
        row_seqs = view_of(row_seqs_h, "row_seqs");
        expect(row_seqs.ndim == 1 && row_seqs.dtype == DType::i32 && row_seqs.stride(0) == 1 && row_seqs.size(0) == B,
               "row_seqs", row_seqs, "must be an int32 [B] tensor");
    } else {
        expect(tables.size(0) == B, "block_tables", tables, "must have a row per query row without row_seqs");
    }
    const int32_t * len = lens.ptr<int32_t>();
    const int32_t * table = tables.ptr<int32_t>();
    const int64_t block_size = cache.size(1), num_blocks = cache.size(0), max_blocks = tables.size(1);
    for (int64_t b = 0; b < B; ++b) {  // a bad table must be an error, not a wild read
        const int64_t seq = has_rows ? row_seqs.ptr<int32_t>()[b] : b;
        if (seq < 0 || seq >= tables.size(0)) {
            fail("row_seqs[" + std::to_string(b) + "] = " + std::to_string(seq) + " is not a row of block_tables");
        }
        if (len[b] < 1 || (len[b] + block_size - 1) / block_size > max_blocks) {
            fail("context_lens[" + std::to_string(b) + "] = " + std::to_string(len[b]) + " is outside [1, " +
                 std::to_string(max_blocks * block_size) + "]");
        }
        for (int64_t i = 0; i < (len[b] + block_size - 1) / block_size; ++i) {
            const int32_t id = table[seq * tables.stride(0) + i];
            if (id < 0 || id >= num_blocks) {
                fail("block_tables[" + std::to_string(seq) + ", " + std::to_string(i) + "] = " + std::to_string(id) +
                     " is not a block of the cache (0.." + std::to_string(num_blocks - 1) + ")");
            }
        }
    }
    py::gil_scoped_release release;
    cpu::paged_latent_attention(q, cache, tables, has_rows ? row_seqs.ptr<int32_t>() : nullptr, lens, scale, out,
                                reference);
}

}  // namespace

void bind_mla(py::module_ & ops) {
    ops.def("paged_latent_attention", &paged_latent_attention, py::arg("q"), py::arg("cache"), py::arg("block_tables"),
            py::arg("context_lens"), py::arg("scale"), py::arg("out"), py::arg("row_seqs") = py::none(),
            py::arg("reference") = false,
            "out[B, Hq, v_dim]: each query row's heads attend to the context_lens[b] cached rows of its table "
            "(block_tables[row_seqs[b]], or row b) as keys, their first v_dim dims as values (DeepSeek-V2's "
            "latent attention; cache [num_blocks, block_size, 1, D]).");
}

}  // namespace lmd
