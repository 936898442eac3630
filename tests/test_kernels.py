"""Kernels of the PyTorch backend: torch versions against plain references, and the Triton
versions against their torch twins under the Triton interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations

import os
from dataclasses import replace

# Triton decides at @triton.jit time whether a kernel is interpreted: set this before any
# Triton kernel module of ours is imported.
os.environ['TRITON_INTERPRET'] = '1'

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lmd.pytorch_backend.kernels import get_kernels, torch_ops  # noqa: E402
from kernel_cases import ATTN_CASES, cos_sin, make_ctx  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


# -- plain references (written the way HF writes them) -------------------------------------------

def ref_rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def ref_rotary(x, positions, cos_sin_cache):
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[positions, :half], cos_sin_cache[positions, half:]
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    rot = 2 * half
    xr = x[..., :rot]
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), -1)
    return torch.cat((xr * cos + rotated * sin, x[..., rot:]), -1)


def ref_silu_and_mul(x):
    inter = x.shape[-1] // 2
    return F.silu(x[:, :inter]) * x[:, inter:]


def ref_paged_attention(q, k_cache, v_cache, ctx, scale, window=0):
    """Token by token: gather the visible context (with a window, its last ``window`` tokens) through
    the block table, softmax in float32."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    bs = ctx.block_size
    t = 0
    for i, (q_len, ctx_len) in enumerate(zip(ctx.query_lens_list, ctx.context_lens_list)):
        for j in range(q_len):
            visible = ctx_len - q_len + j + 1
            first = max(0, visible - window) if window else 0
            slots = [(int(ctx.block_tables[i, p // bs]), p % bs) for p in range(first, visible)]
            k = torch.stack([k_cache[b, o] for b, o in slots]).float()    # [L, Hk, D]
            v = torch.stack([v_cache[b, o] for b, o in slots]).float()
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum('hd,lhd->hl', q[t].float(), k) * scale
            out[t] = torch.einsum('hl,lhd->hd', scores.softmax(-1), v).to(q.dtype)
            t += 1
    return out


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# -- torch kernels vs references --------------------------------------------------------------

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', [(1, 576), (5, 64), (3, 4, 24)])
def test_torch_rms_norm(shape, dtype):
    x = torch.randn(shape).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1])).to(dtype)
    torch.testing.assert_close(torch_ops.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('heads,head_dim,rot_dim', [((4, 2), 16, 16), ((9, 3), 64, 64), ((2, 1), 24, 12)])
def test_torch_apply_rotary(heads, head_dim, rot_dim, dtype):
    positions = torch.tensor([0, 3, 17, 5, 63])
    q = torch.randn(5, heads[0], head_dim).to(dtype)
    k = torch.randn(5, heads[1], head_dim).to(dtype)
    cache = cos_sin(64, rot_dim, dtype)
    q2, k2 = torch_ops.apply_rotary(q.clone(), k.clone(), positions, cache)
    torch.testing.assert_close(q2, ref_rotary(q, positions, cache), **TOL[dtype])
    torch.testing.assert_close(k2, ref_rotary(k, positions, cache), **TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
def test_torch_silu_and_mul(dtype):
    x = torch.randn(6, 2 * 96).to(dtype)
    torch.testing.assert_close(torch_ops.silu_and_mul(x), ref_silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
def test_torch_fill_kv_cache(dtype):
    k_cache = torch.zeros(6, 4, 2, 8, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([13, 2, 20, 7])
    k, v = torch.randn(4, 2, 8).to(dtype), torch.randn(4, 2, 8).to(dtype)
    torch_ops.fill_kv_cache(k, v, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // 4, s % 4], k[t]) and torch.equal(v_cache[s // 4, s % 4], v[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 4  # nothing else written


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('case', ATTN_CASES)
def test_torch_paged_attention(case, dtype):
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim = case
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale)
    torch.testing.assert_close(out, ref_paged_attention(q, k_cache, v_cache, ctx, scale), **TOL[dtype])


@pytest.mark.parametrize('backend', ['torch', 'native', 'triton'])
@pytest.mark.parametrize('window', [1, 3, 8, 100])
@pytest.mark.parametrize('case', ATTN_CASES)
def test_paged_attention_over_a_sliding_window(case, window, backend):
    """Every backend's attention over a window; the blocks wholly before every query's window are
    freed (-1 in the table) and never read."""
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim = case
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, block_size, num_kv_heads, head_dim, torch.float32)
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    want = ref_paged_attention(q, k_cache, v_cache, ctx, head_dim ** -0.5, window)
    tables = ctx.block_tables.clone()
    for i, (q_len, n) in enumerate(zip(query_lens, context_lens)):
        tables[i, :max(0, n - q_len + 1 - window) // block_size] = -1
    freed = replace(ctx, block_tables=tables, derived={})
    out = get_kernels('cpu', backend).paged_attention(q, k_cache, v_cache, freed, head_dim ** -0.5, window=window)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


def test_dispatch_table():
    assert get_kernels('cpu').name == 'native'  # the compiled extension is part of every install
    assert get_kernels('cpu', 'torch').name == 'torch'
    assert get_kernels('cpu', 'triton').name == 'triton'
    with pytest.raises(ValueError, match='unknown kernel backend'):
        get_kernels('cpu', 'cuda-graphs')


# -- Triton kernels vs their torch twins (interpreted on CPU) ---------------------------------

TRITON_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope='module')
def triton_kernels():
    from triton.runtime.interpreter import InterpretedFunction
    from lmd.pytorch_backend.kernels.triton import attention, norm
    if not isinstance(norm._rms_norm_kernel, InterpretedFunction) or \
            not isinstance(attention._paged_decode_kernel, InterpretedFunction):
        pytest.fail('Triton kernels were imported before TRITON_INTERPRET=1 was set, so they cannot '
                    'run on CPU in this process; run tests/test_kernels.py in its own pytest process')
    return get_kernels('cpu', 'triton')


@pytest.mark.parametrize('dtype', TRITON_DTYPES)
@pytest.mark.parametrize('shape', [(3, 576), (2, 4, 24)])
def test_triton_rms_norm(triton_kernels, shape, dtype):
    x = torch.randn(shape).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1])).to(dtype)
    torch.testing.assert_close(triton_kernels.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6), **TOL[dtype])


def test_triton_rms_norm_strided_heads(triton_kernels):
    # q heads as a view into a fused qkv row, as Qwen3's q_norm sees them
    qkv = torch.randn(3, (4 + 2 * 2) * 24)
    q = qkv[:, :96].view(3, 4, 24)
    w = torch.randn(24)
    torch.testing.assert_close(triton_kernels.rms_norm(q, w, 1e-6), torch_ops.rms_norm(q, w, 1e-6), **TOL[torch.float32])


@pytest.mark.parametrize('dtype', TRITON_DTYPES)
@pytest.mark.parametrize('heads,head_dim,rot_dim', [((4, 2), 16, 16), ((9, 3), 64, 64), ((3, 1), 24, 12)])
def test_triton_apply_rotary(triton_kernels, heads, head_dim, rot_dim, dtype):
    positions = torch.tensor([0, 3, 17, 63])
    # q and k as views of one fused qkv buffer, rotated in place
    qkv = torch.randn(4, (heads[0] + 2 * heads[1]) * head_dim).to(dtype)
    q = qkv[:, :heads[0] * head_dim].view(4, heads[0], head_dim)
    k = qkv[:, heads[0] * head_dim:(heads[0] + heads[1]) * head_dim].view(4, heads[1], head_dim)
    v_before = qkv[:, (heads[0] + heads[1]) * head_dim:].clone()
    cache = cos_sin(64, rot_dim, dtype)
    want_q, want_k = torch_ops.apply_rotary(q.clone(), k.clone(), positions, cache)
    got_q, got_k = triton_kernels.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads[0] + heads[1]) * head_dim:], v_before)


@pytest.mark.parametrize('dtype', TRITON_DTYPES)
def test_triton_silu_and_mul(triton_kernels, dtype):
    x = torch.randn(3, 2 * 1536).to(dtype)
    torch.testing.assert_close(triton_kernels.silu_and_mul(x), torch_ops.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize('dtype', TRITON_DTYPES)
def test_triton_fill_kv_cache(triton_kernels, dtype):
    kv = torch.randn(4, 2 * 3, 24).to(dtype)    # k and v as views of one buffer, like qkv
    k, v = kv[:, :3], kv[:, 3:]
    slots = torch.tensor([13, 2, -1, 7])         # -1: padding token, skipped by Triton
    want_k, want_v = torch.zeros(6, 4, 3, 24, dtype=dtype), torch.zeros(6, 4, 3, 24, dtype=dtype)
    keep = slots >= 0
    torch_ops.fill_kv_cache(k[keep], v[keep], want_k, want_v, slots[keep])
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    triton_kernels.fill_kv_cache(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize('dtype', TRITON_DTYPES)
@pytest.mark.parametrize('case', [c for c in ATTN_CASES if all(n == 1 for n in c[0])])
def test_triton_paged_decode_attention(triton_kernels, case, dtype):
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim = case
    ctx, k_cache, v_cache = make_ctx(query_lens, context_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(query_lens), num_heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    want = torch_ops.paged_attention(q, k_cache, v_cache, ctx, scale)
    got = triton_kernels.paged_attention(q, k_cache, v_cache, ctx, scale)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize('arch', ['qwen3', 'qwen2'])
def test_triton_model_matches_torch_model(triton_kernels, arch):
    """A whole tiny model on the Triton kernels (interpreted): chunked prefill, then decode."""
    from test_models import make_hf_model, random_tokens, run_chunked
    from lmd.pytorch_backend.models import build_model
    _, config, weights = make_hf_model(arch)
    tokens = random_tokens(9 + 4, seed=2)
    want = run_chunked(build_model(config, weights, torch.float32, kernel_backend='torch'), tokens, [6, 3])
    got = run_chunked(build_model(config, weights, torch.float32, kernel_backend='triton'), tokens, [6, 3])
    assert (got - want).abs().max().item() < 1e-4
