// The packed matmuls in lmd.kernels.ops (next to the kernels of bindings/ops.cc,
// with the same conventions): float weights, and W4A16 and W8A16 in the same panels. Layouts and
// results: cpu/gemm.h.
#include <pybind11/pybind11.h>

#include <string>

#include "core/py_tensor.h"
#include "cpu/gemm.h"

namespace lmd {
namespace {

std::string panels_shape(int64_t N, int64_t K, int64_t W = cpu::kPanelWidth) {
    return "[" + std::to_string((N + W - 1) / W) + ", " + std::to_string(K) + ", " + std::to_string(W) + "]";
}

void check_packed(const TensorView & packed) {
    expect(packed.ndim == 3 && packed.contiguous() && is_float(packed.dtype) && packed.size(2) == cpu::kPanelWidth,
           "packed", packed, "must be a contiguous float [P, K, 16] tensor (ops.pack_linear)");
}

void pack_linear(py::handle w_h, py::handle packed_h) {
    const TensorView w = view_of(w_h, "w"), packed = view_of(packed_h, "packed");
    expect(w.ndim == 2 && w.contiguous() && is_float(w.dtype), "w", w, "must be a contiguous float [N, K] tensor");
    check_packed(packed);
    expect(packed.dtype == w.dtype && packed.size(0) == cpu::num_panels(w.size(0)) && packed.size(1) == w.size(1),
           "packed", packed, "must be " + panels_shape(w.size(0), w.size(1)) + " with w's dtype");
    py::gil_scoped_release release;
    cpu::pack_linear(w, packed);
}

void unpack_linear(py::handle packed_h, py::handle w_h) {
    const TensorView packed = view_of(packed_h, "packed"), w = view_of(w_h, "w");
    check_packed(packed);
    expect(w.ndim == 2 && w.contiguous() && w.dtype == packed.dtype && w.size(1) == packed.size(1) &&
           cpu::num_panels(w.size(0)) == packed.size(0), "w", w,
           "must be a contiguous [N, K] tensor with packed's dtype, K and ceil(N / 16) = P");
    py::gil_scoped_release release;
    cpu::unpack_linear(packed, w);
}

void linear_packed(py::handle x_h, py::handle packed_h, py::handle bias_h, py::handle y_h, bool reference) {
    const TensorView x = view_of(x_h, "x"), packed = view_of(packed_h, "packed"), y = view_of(y_h, "y");
    check_packed(packed);
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype), "x", x,
           "must be a float 2-D [M, K] tensor with unit stride in K");
    expect(packed.size(1) == x.size(1), "packed", packed, "K must match x's " + std::to_string(x.size(1)));
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.dtype == x.dtype &&
           cpu::num_panels(y.size(1)) == packed.size(0), "y", y,
           "must be [M, N] with x's M and dtype, unit stride in N and ceil(N / 16) = " +
           std::to_string(packed.size(0)) + " panels");
    TensorView bias;
    const bool has_bias = !bias_h.is_none();
    if (has_bias) {
        bias = view_of(bias_h, "bias");
        expect(bias.ndim == 1 && bias.size(0) == y.size(1) && bias.contiguous() && bias.dtype == packed.dtype, "bias",
               bias, "must be [N] with packed's dtype");
    }
    py::gil_scoped_release release;
    cpu::linear_packed(x, packed, has_bias ? &bias : nullptr, y, reference);
}

// The quantized matmuls' bias: none, or float32 [N] for y [M, N] (an empty view when none).
TensorView f32_bias(py::handle bias_h, const TensorView & y) {
    if (bias_h.is_none()) return TensorView();
    const TensorView bias = view_of(bias_h, "bias");
    expect(bias.ndim == 1 && bias.size(0) == y.size(1) && bias.contiguous() && bias.dtype == DType::f32, "bias", bias,
           "must be a float32 [N] tensor");
    return bias;
}

// The three W4A16 panel tensors for w[N, K] in groups of G (a multiple of 32).
void check_w4a16_panels(const TensorView & q, const TensorView & s, const TensorView & m) {
    constexpr int64_t W = cpu::kW4A16PanelWidth;
    expect(q.ndim == 3 && q.contiguous() && q.dtype == DType::i32 && q.size(2) == W, "qpanels", q,
           "must be a contiguous int32 [P4, K / 8, 64] tensor (ops.pack_w4a16)");
    const int64_t P = q.size(0), K = q.size(1) * 8;
    expect(s.ndim == 3 && s.contiguous() && (s.dtype == DType::f32 || s.dtype == DType::f16) && s.size(0) == P &&
           s.size(2) == W && s.size(1) > 0 && K % s.size(1) == 0 && (K / s.size(1)) % 32 == 0, "spanels", s,
           "must be a contiguous float32 or float16 [P4, K / G, 64] tensor with qpanels' P4 and G a multiple of 32");
    expect(m.ndim == 3 && m.contiguous() && m.dtype == s.dtype && m.size(0) == P && m.size(1) == s.size(1) &&
           m.size(2) == W, "mpanels", m, "must have spanels' shape and dtype");
}

int64_t num_w4a16_panels(int64_t N) { return (N + cpu::kW4A16PanelWidth - 1) / cpu::kW4A16PanelWidth; }

void pack_w4a16(py::handle q_h, py::handle s_h, py::handle m_h, py::handle qp_h, py::handle sp_h, py::handle mp_h) {
    const TensorView q = view_of(q_h, "qweight"), s = view_of(s_h, "scales"), m = view_of(m_h, "mins");
    const TensorView qp = view_of(qp_h, "qpanels"), sp = view_of(sp_h, "spanels"), mp = view_of(mp_h, "mpanels");
    expect(q.ndim == 2 && q.contiguous() && q.dtype == DType::u8 && q.size(1) % 4 == 0, "qweight", q,
           "must be a contiguous uint8 [N, K / 2] tensor, K a multiple of 8");
    const int64_t N = q.size(0), K = q.size(1) * 2;
    check_w4a16_panels(qp, sp, mp);
    expect(s.ndim == 2 && s.contiguous() && s.dtype == sp.dtype && s.size(0) == N, "scales", s,
           std::string("must be a contiguous [N, K / G] tensor of spanels' dtype, ") + dtype_name(sp.dtype));
    expect(m.ndim == 2 && m.contiguous() && m.dtype == sp.dtype && m.size(0) == N && m.size(1) == s.size(1), "mins",
           m, "must have scales' shape and dtype");
    expect(qp.size(0) == num_w4a16_panels(N) && qp.size(1) == K / 8 && sp.size(1) == s.size(1), "qpanels", qp,
           "must be " + panels_shape(N, K / 8, cpu::kW4A16PanelWidth) + " (and spanels, mpanels [P4, K / G, 64]) "
           "for qweight " + shape_str(q));
    py::gil_scoped_release release;
    cpu::pack_w4a16(q, s, m, qp, sp, mp);
}

void unpack_w4a16(py::handle qp_h, py::handle sp_h, py::handle mp_h, py::handle q_h, py::handle s_h, py::handle m_h) {
    const TensorView qp = view_of(qp_h, "qpanels"), sp = view_of(sp_h, "spanels"), mp = view_of(mp_h, "mpanels");
    const TensorView q = view_of(q_h, "qweight"), s = view_of(s_h, "scales"), m = view_of(m_h, "mins");
    check_w4a16_panels(qp, sp, mp);
    const int64_t N = q.size(0);
    bool ok = q.ndim == 2 && q.contiguous() && q.dtype == DType::u8 && q.size(1) == qp.size(1) * 4 &&
              num_w4a16_panels(N) == qp.size(0);
    for (const TensorView * t : {&s, &m}) {
        ok = ok && t->ndim == 2 && t->contiguous() && t->dtype == sp.dtype && t->size(0) == N &&
             t->size(1) == sp.size(1);
    }
    expect(ok, "qweight", q, "qweight uint8 [N, K / 2], scales and mins [N, K / G] in spanels' dtype must fit the panels");
    py::gil_scoped_release release;
    cpu::unpack_w4a16(qp, sp, mp, q, s, m);
}

// linear_w4a16_packed and linear_w4a8_packed: one set of checks, then fn.
template <typename Fn>
void w4_packed_call(py::handle x_h, py::handle qp_h, py::handle sp_h, py::handle mp_h, py::handle bias_h,
                    py::handle y_h, bool reference, Fn && fn) {
    const TensorView x = view_of(x_h, "x"), y = view_of(y_h, "y");
    const TensorView qp = view_of(qp_h, "qpanels"), sp = view_of(sp_h, "spanels"), mp = view_of(mp_h, "mpanels");
    check_w4a16_panels(qp, sp, mp);
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype) && x.size(1) == qp.size(1) * 8, "x", x,
           "must be a float [M, K] tensor with unit stride in K, K = " + std::to_string(qp.size(1) * 8));
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.dtype == x.dtype &&
           num_w4a16_panels(y.size(1)) == qp.size(0), "y", y,
           "must be [M, N] with x's M and dtype, unit stride in N and ceil(N / 64) = " + std::to_string(qp.size(0)) +
           " panels");
    const TensorView bias = f32_bias(bias_h, y);
    py::gil_scoped_release release;
    fn(x, qp, sp, mp, bias.data ? &bias : nullptr, y, reference);
}

void linear_w4a16_packed(py::handle x, py::handle qp, py::handle sp, py::handle mp, py::handle bias, py::handle y,
                         bool reference) {
    w4_packed_call(x, qp, sp, mp, bias, y, reference, cpu::linear_w4a16_packed);
}

void linear_w4a8_packed(py::handle x, py::handle qp, py::handle sp, py::handle mp, py::handle bias, py::handle y,
                        bool reference) {
    w4_packed_call(x, qp, sp, mp, bias, y, reference, cpu::linear_w4a8_packed);
}

// The two W8A16 panel tensors for w[N, K] in groups of G (a multiple of 16: GGUF's Q6_K groups 16).
void check_w8a16_panels(const TensorView & q, const TensorView & s) {
    constexpr int64_t W = cpu::kPanelWidth;
    expect(q.ndim == 3 && q.contiguous() && q.dtype == DType::i8 && q.size(2) == W, "qpanels", q,
           "must be a contiguous int8 [P, K, 16] tensor (ops.pack_w8a16)");
    const int64_t K = q.size(1);
    expect(s.ndim == 3 && s.contiguous() && (s.dtype == DType::f32 || s.dtype == DType::f16) && s.size(0) == q.size(0) &&
           s.size(2) == W && s.size(1) > 0 && K % s.size(1) == 0 && (K / s.size(1)) % 16 == 0, "spanels", s,
           "must be a contiguous float32 or float16 [P, K / G, 16] tensor with qpanels' P and G a multiple of 16");
}

void pack_w8a16(py::handle q_h, py::handle s_h, py::handle qp_h, py::handle sp_h) {
    const TensorView q = view_of(q_h, "qweight"), s = view_of(s_h, "scales");
    const TensorView qp = view_of(qp_h, "qpanels"), sp = view_of(sp_h, "spanels");
    expect(q.ndim == 2 && q.contiguous() && q.dtype == DType::i8, "qweight", q, "must be a contiguous int8 [N, K] tensor");
    check_w8a16_panels(qp, sp);
    expect(s.ndim == 2 && s.contiguous() && s.dtype == sp.dtype && s.size(0) == q.size(0) && s.size(1) == sp.size(1),
           "scales", s, std::string("must be a contiguous [N, K / G] tensor of spanels' dtype, ") + dtype_name(sp.dtype));
    expect(qp.size(0) == cpu::num_panels(q.size(0)) && qp.size(1) == q.size(1), "qpanels", qp,
           "must be " + panels_shape(q.size(0), q.size(1)) + " for qweight " + shape_str(q));
    py::gil_scoped_release release;
    cpu::pack_w8a16(q, s, qp, sp);
}

void unpack_w8a16(py::handle qp_h, py::handle sp_h, py::handle q_h, py::handle s_h) {
    const TensorView qp = view_of(qp_h, "qpanels"), sp = view_of(sp_h, "spanels");
    const TensorView q = view_of(q_h, "qweight"), s = view_of(s_h, "scales");
    check_w8a16_panels(qp, sp);
    expect(q.ndim == 2 && q.contiguous() && q.dtype == DType::i8 && q.size(1) == qp.size(1) &&
           cpu::num_panels(q.size(0)) == qp.size(0) && s.ndim == 2 && s.contiguous() && s.dtype == sp.dtype &&
           s.size(0) == q.size(0) && s.size(1) == sp.size(1), "qweight", q,
           "qweight int8 [N, K] and scales [N, K / G] in spanels' dtype must fit the panels");
    py::gil_scoped_release release;
    cpu::unpack_w8a16(qp, sp, q, s);
}

void linear_w8a16_packed(py::handle x_h, py::handle qp_h, py::handle sp_h, py::handle bias_h, py::handle y_h,
                         bool reference) {
    const TensorView x = view_of(x_h, "x"), y = view_of(y_h, "y");
    const TensorView qp = view_of(qp_h, "qpanels"), sp = view_of(sp_h, "spanels");
    check_w8a16_panels(qp, sp);
    expect(x.ndim == 2 && x.stride(1) == 1 && is_float(x.dtype) && x.size(1) == qp.size(1), "x", x,
           "must be a float [M, K] tensor with unit stride in K, K = " + std::to_string(qp.size(1)));
    expect(y.ndim == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.dtype == x.dtype &&
           cpu::num_panels(y.size(1)) == qp.size(0), "y", y,
           "must be [M, N] with x's M and dtype, unit stride in N and ceil(N / 16) = " + std::to_string(qp.size(0)) +
           " panels");
    const TensorView bias = f32_bias(bias_h, y);
    py::gil_scoped_release release;
    cpu::linear_w8a16_packed(x, qp, sp, bias.data ? &bias : nullptr, y, reference);
}

}  // namespace

void bind_gemm(py::module_ & ops) {
    ops.def("pack_linear", &pack_linear, py::arg("w"), py::arg("packed"),
            "packed[P, K, 16] = w[N, K] in panels of 16 rows (P = ceil(N / 16), zero past N), w's dtype.");
    ops.def("unpack_linear", &unpack_linear, py::arg("packed"), py::arg("w"), "w[N, K] back from packed[P, K, 16].");
    ops.def("linear_packed", &linear_packed, py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("y"),
            py::arg("reference") = false,
            "y[M, N] = x[M, K] @ w[N, K].T (+ bias[N]) with w packed: one fma a k in increasing k, float32.");
    ops.def("pack_w4a16", &pack_w4a16, py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("qpanels"),
            py::arg("spanels"), py::arg("mpanels"),
            "W4A16 (qweight uint8 [N, K/2], scales, mins float32 [N, K/G]) into panels 64 wide: qpanels int32 "
            "[P4, K/8, 64], spanels, mpanels float32 [P4, K/G, 64].");
    ops.def("unpack_w4a16", &unpack_w4a16, py::arg("qpanels"), py::arg("spanels"), py::arg("mpanels"),
            py::arg("qweight"), py::arg("scales"), py::arg("mins"), "The W4A16 layout back from its panels.");
    ops.def("linear_w4a16_packed", &linear_w4a16_packed, py::arg("x"), py::arg("qpanels"), py::arg("spanels"),
            py::arg("mpanels"), py::arg("bias"), py::arg("y"), py::arg("reference") = false,
            "y[M, N] = x[M, K] @ w[N, K].T (+ bias[N]) with w W4A16 in panels: per group, scale * (x . q) + "
            "min * sum(x), accumulated in float32 (cpu/gemm.h).");
    ops.def("pack_w8a16", &pack_w8a16, py::arg("qweight"), py::arg("scales"), py::arg("qpanels"), py::arg("spanels"),
            "W8A16 (qweight int8 [N, K], scales float32 or float16 [N, K/G]) into panels 16 wide: qpanels int8 "
            "[P, K, 16], spanels [P, K/G, 16] in scales' dtype.");
    ops.def("unpack_w8a16", &unpack_w8a16, py::arg("qpanels"), py::arg("spanels"), py::arg("qweight"),
            py::arg("scales"), "The W8A16 layout back from its panels.");
    ops.def("linear_w8a16_packed", &linear_w8a16_packed, py::arg("x"), py::arg("qpanels"), py::arg("spanels"),
            py::arg("bias"), py::arg("y"), py::arg("reference") = false,
            "y[M, N] = x[M, K] @ w[N, K].T (+ bias[N]) with w W8A16 in panels: per group, scale * (x . q), "
            "accumulated in float32 in broadcast form (cpu/gemm.h).");
    ops.def("linear_w4a8_packed", &linear_w4a8_packed, py::arg("x"), py::arg("qpanels"), py::arg("spanels"),
            py::arg("mpanels"), py::arg("bias"), py::arg("y"), py::arg("reference") = false,
            "linear_w4a16_packed with x quantized to int8 per 32 k (as llama.cpp's Q8_1): integer dots per block, "
            "scaled in float32 (cpu/gemm.h, W4A8).");
}

}  // namespace lmd
