"""GGUF's block types multiplied as stored (ops.gguf_dequantize / ops.linear_gguf;
lib/kernels/csrc/cpu/gguf.h): every type's dequantization equals gguf.quants.dequantize bit for
bit, the AVX2 kernels equal the scalar C++ reference bit for bit (both products, every output
dtype, tile remainders, with and without bias), the float product equals the dequantized weights
times x to float32 rounding, the int8-activation product stays within the activations' rounding
bound, and rows do not depend on the batch or the thread count."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch.utils.dlpack import to_dlpack as dl

from lmd.kernels import ops
from test_gemm_kernels import DTYPES, assert_rows_independent, rand
from test_q8_activation_kernels import quantize_q8

TYPES = sorted(ops.GGUF_TYPES)
# byte offsets of each type's fp16 fields in its block (gguf.h)
FP16_FIELDS = {'Q4_0': (0,), 'Q4_1': (0, 2), 'Q5_0': (0,), 'Q5_1': (0, 2), 'Q8_0': (0,), 'Q4_K': (0, 2),
               'Q5_K': (0, 2), 'Q6_K': (208,), 'IQ4_NL': (0,)}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """raw uint8 [n, k / QK * B]: random codes and scale bytes, fp16 fields set to finite values
    of either sign (as real files hold) so that every bit pattern of the rest is exercised."""
    _, qk, nbytes = ops.GGUF_TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // qk, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[type_name]:
        vals = (rng.uniform(0.002, 0.05, size=blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0]))
        blocks[:, off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, -1).copy())


def gguf_reference(type_name: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    w = dequantize(raw.numpy(), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(raw.shape[0], k)


def deq(raw, type_name, k, reference=False):
    out = torch.empty(raw.shape[0], k)
    ops.gguf_dequantize(dl(raw), ops.GGUF_TYPES[type_name][0], dl(out), reference=reference)
    return out


def linear(x, raw, type_name, bias=None, int8=False, reference=False):
    y = torch.empty(x.shape[0], raw.shape[0], dtype=x.dtype)
    ops.linear_gguf(dl(x), dl(raw), ops.GGUF_TYPES[type_name][0], None if bias is None else dl(bias), dl(y),
                    int8_activations=int8, reference=reference)
    return y


def k_for(type_name: str) -> int:
    return 512 if ops.GGUF_TYPES[type_name][1] == 256 else 96


@pytest.mark.parametrize('type_name', TYPES)
def test_dequantization_equals_gguf_bit_for_bit(type_name):
    k = k_for(type_name)
    raw = random_blocks(type_name, 13, k, seed=1)
    want = gguf_reference(type_name, raw, k)
    for reference in (True, False):
        got = deq(raw, type_name, k, reference)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (type_name, reference)


@pytest.mark.parametrize('type_name', TYPES)
@pytest.mark.parametrize('int8', [False, True], ids=['a16', 'a8'])
def test_avx2_equals_the_reference_bit_for_bit(type_name, int8):
    k = k_for(type_name)
    raw = random_blocks(type_name, 11, k, seed=2)  # 11 columns: a run of 4, 4, then 3
    bias = rand(11, seed=3)
    for dtype in DTYPES:
        for M in (1, 2, 5):
            x = rand(M, k, seed=M).to(dtype)
            for b in (None, bias):
                fast = linear(x, raw, type_name, b, int8)
                ref = linear(x, raw, type_name, b, int8, reference=True)
                assert torch.equal(fast.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                   ref.view(torch.int16 if dtype != torch.float32 else torch.int32)), (dtype, M, b is None)


@pytest.mark.parametrize('type_name', TYPES)
def test_float_product_is_the_dequantized_matmul(type_name):
    k = k_for(type_name)
    raw = random_blocks(type_name, 40, k, seed=4)
    w = gguf_reference(type_name, raw, k).double()
    x = rand(3, k, seed=5)
    bias = rand(40, seed=6)
    want = x.double() @ w.T + bias.double()
    got = linear(x, raw, type_name, bias).double()
    bound = (x.double().abs() @ w.abs().T) * 2 ** -21 + 1e-6  # k float32 roundings, summed in lanes
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize('type_name', TYPES)
def test_int8_activation_product_is_within_the_rounding_bound(type_name):
    k = k_for(type_name)
    raw = random_blocks(type_name, 40, k, seed=7)
    w = gguf_reference(type_name, raw, k).double()
    x = rand(3, k, seed=8)
    xq, dx = quantize_q8(x)
    x_used = (xq.view(3, -1, 32).double() * dx.double()[..., None]).view(3, k)
    got = linear(x, raw, type_name, int8=True).double()
    # the product of w and x' = xq dx, to float32 rounding; and x' within dx / 2 of x
    assert torch.allclose(got, x_used @ w.T, rtol=1e-5, atol=1e-4)
    bound = (w.abs() @ dx.double().repeat_interleave(32, dim=1).T / 2).T
    assert ((got - x.double() @ w.T).abs() <= bound + 1e-4).all()


@pytest.mark.parametrize('type_name', ['Q5_0', 'Q4_K', 'Q6_K', 'Q8_0'])
@pytest.mark.parametrize('int8', [False, True], ids=['a16', 'a8'])
def test_rows_do_not_depend_on_the_batch_or_the_threads(type_name, int8):
    k = k_for(type_name)
    raw = random_blocks(type_name, 70, k, seed=9)
    bias = rand(70, seed=10)
    assert_rows_independent(lambda x: linear(x, raw, type_name, bias, int8), rand(70, k, seed=11))


def test_q4_k_maps_onto_the_w4a16_layout_bit_for_bit():
    """TurboMind runs Q4_K matmuls on the W4A16 panels: eight groups of 32 per block, exactly."""
    from lmd.weights.quant_layouts import dequantize_w4a16, from_gguf_q4_k
    raw = random_blocks('Q4_K', 24, 768, seed=5)
    want = gguf_reference('Q4_K', raw, 768)
    got = dequantize_w4a16(*from_gguf_q4_k(raw.numpy(), 24, 768))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros too


@pytest.mark.parametrize('type_name', TYPES)
def test_types_without_mins_map_onto_w8a16_bit_for_bit(type_name):
    """Both engines run Q5_0 / Q8_0 / Q6_K matmuls on the W8A16 panels (gguf_to_w8a16): codes less the
    offset times one scale a group of 32 (16 for Q6_K), the same weights to the sign of a zero."""
    from lmd.kernels import gguf_to_w8a16
    from lmd.weights.quant_layouts import dequantize_w8a16
    type_id, k = ops.GGUF_TYPES[type_name][0], k_for(type_name)
    raw = random_blocks(type_name, 21, k, seed=6)
    if ops.gguf_w8a16_group(type_id) == 0:  # float mins: no W8A16 form, refused by name
        assert type_name in ('Q4_1', 'Q5_1', 'Q4_K', 'Q5_K')
        with pytest.raises(ValueError, match=f'type {type_id} has float mins'):
            gguf_to_w8a16(raw, type_id)
        return
    qweight, scales = gguf_to_w8a16(raw, type_id)
    assert scales.shape == (21, k // (16 if type_name == 'Q6_K' else 32))
    got = dequantize_w8a16(qweight, scales)
    assert torch.equal(got.view(torch.int32), gguf_reference(type_name, raw, k).view(torch.int32))


def test_a_strided_output_is_written_in_place():
    """TurboMind writes a fused matmul's parts (one per GGUF type) into column ranges of one y."""
    raw = random_blocks('Q4_K', 8, 256, seed=12)
    x = rand(3, 256, seed=13)
    y = torch.full((3, 20), 7.0)
    ops.linear_gguf(dl(x), dl(raw), ops.GGUF_TYPES['Q4_K'][0], None, dl(y[:, 4:12]))
    assert torch.equal(y[:, 4:12], linear(x, raw, 'Q4_K'))
    assert (y[:, :4] == 7).all() and (y[:, 12:] == 7).all()


def test_bad_arguments_are_clear_errors():
    raw = random_blocks('Q4_K', 4, 256)
    x = rand(2, 256)
    with pytest.raises(ValueError, match='type 5 is not a GGUF type lmd runs'):
        ops.linear_gguf(dl(x), dl(raw), 5, None, dl(torch.empty(2, 4)))
    with pytest.raises(ValueError, match='K = 100 is not a multiple of .*256-value blocks'):
        ops.linear_gguf(dl(rand(2, 100)), dl(raw), 12, None, dl(torch.empty(2, 4)))
    with pytest.raises(ValueError, match=r'raw .*must be a contiguous uint8 \[N, 288\]'):
        ops.linear_gguf(dl(rand(2, 512)), dl(raw), 12, None, dl(torch.empty(2, 4)))
    with pytest.raises(ValueError, match=r'y .*must be \[M, N\] = \[2, 4\]'):
        ops.linear_gguf(dl(x), dl(raw), 12, None, dl(torch.empty(2, 5)))
    with pytest.raises(ValueError, match=r'out .*must have raw\'s N = 4 rows'):
        ops.gguf_dequantize(dl(raw), 12, dl(torch.empty(3, 256)))
