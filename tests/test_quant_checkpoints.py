"""Quantized checkpoints as users get them (GPTQ, compressed-tensors, FP8) in both engines.

Each checkpoint is written here from a tiny random model by the format's own rules (writers of our own,
following the layouts in lmd/weights/gptq.py, compressed_tensors.py, fp8.py, independent of the
readers), and the reference is HF transformers in float32 on the weights the checkpoint stands for,
dequantized by the format's formula. TurboMind and the PyTorch engine must give its teacher-forced
logits within the AWQ tests' tolerance and its greedy tokens.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmd.convert import convert
from lmd.errors import ModelFormatError
from lmd.messages import TurbomindEngineConfig
from lmd.model_config import ModelConfig
from lmd.turbomind.engine import TurbomindEngine
from lmd.weights.gptq import from_gptq
from lmd.weights.quant_layouts import act_order, dequantize_w4a16
from lmd.weights.turbomind_layout import WEIGHTS_FILE
from test_pytorch_engine import hf_greedy
from test_pytorch_quant import pt_engine, pt_greedy, pt_logits
from test_turbomind_formats import (ARCHS, ENGINE, LINEARS, TINY, W8A8_TOLERANCE, engine_greedy, hf_logits,
                                    quantize_activations_per_token, tm_logits, tokens)
from tiny_models import tiny_hf_model

TOLERANCE = 1e-3  # the AWQ tests': the W4A16 kernel sums per group, in another order than HF's float matmul
PROMPT_LENS, GREEDY_TOKENS = (5, 23), 16


# ---- writers -------------------------------------------------------------------------------------------

def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0..2^32 - 1 -> the int32 with those bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_along_rows(u: torch.Tensor) -> torch.Tensor:
    """u [8 R, C] in 0..15 -> int32 [R, C], nibble i of word [r, c] = u[8 r + i, c] (GPTQ's qweight)."""
    u = u.to(torch.int64).reshape(-1, 8, u.shape[1])
    return to_int32(sum(u[:, i] << (4 * i) for i in range(8))).contiguous()


def pack_along_cols(u: torch.Tensor) -> torch.Tensor:
    """u [R, 8 C] in 0..15 -> int32 [R, C], nibble i of word [r, c] = u[r, 8 c + i]."""
    return pack_along_rows(u.T).T.contiguous()


def groups_of(k: int, group_size: int, shuffled: torch.Generator | None) -> torch.Tensor:
    """g_idx [K]: k // G, or (act-order) the groups of a random permutation of k."""
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    if shuffled is None:
        return g_idx
    out = torch.empty_like(g_idx)
    out[torch.randperm(k, generator=shuffled)] = g_idx
    return out


def quantize_int4(w: torch.Tensor, g_idx: torch.Tensor, num_groups: int, sym: bool, scale_dtype: torch.dtype,
                  min_zero: int = 0):
    """w [N, K] -> (q [N, K], z [N, groups] integers, s [N, groups] in scale_dtype) by the groups g_idx
    names: min-max asymmetric, or symmetric about z = 8; w ~ (q - z[:, g_idx]) * s[:, g_idx]."""
    n = w.shape[0]
    members = torch.stack([(g_idx == g).nonzero()[:, 0] for g in range(num_groups)])  # [groups, G]
    wg = w.float()[:, members]                                                       # [N, groups, G]
    if sym:
        s = (wg.abs().amax(-1) * 2 / 15).clamp(min=1e-4).to(scale_dtype).float()
        z = torch.full_like(s, 8)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-4).to(scale_dtype).float()
        z = torch.round(-lo / s).clamp(min_zero, 15)
    qg = (torch.round(wg / s[..., None]) + z[..., None]).clamp(0, 15)
    q = torch.empty(w.shape)
    q[:, members.reshape(-1)] = qg.reshape(n, -1)
    return q.to(torch.uint8), z, s.to(scale_dtype)


def int4_reference(q, z, s, g_idx) -> torch.Tensor:
    """The format's formula in float32: w[n, k] = (q[n, k] - z[n, g_idx[k]]) * s[n, g_idx[k]]."""
    g = g_idx.long()
    return (q.float() - z.float()[:, g]) * s.float()[:, g]


def gptq_tensors(w, group_size, sym, v2, g_idx):
    """AutoGPTQ's tensors of w (the module doc of lmd/weights/gptq.py) and the weight they stand for."""
    num_groups = w.shape[1] // group_size
    q, z, s = quantize_int4(w, g_idx, num_groups, sym, torch.float16, min_zero=0 if v2 else 1)
    stored_z = z if v2 else z - 1  # 'gptq' stores z - 1 (so z = 0 cannot be stored: min_zero 1)
    tensors = {'qweight': pack_along_rows(q.T.contiguous()), 'qzeros': pack_along_cols(stored_z.T.to(torch.uint8)),
               'scales': s.T.contiguous(), 'g_idx': g_idx.clone()}
    return tensors, int4_reference(q, z, s, g_idx)


def pack_quantized_tensors(w, group_size, sym, g_idx):
    """compressed-tensors' pack-quantized tensors of w (offset 8: u = q + 8 of the signed q) and its weight."""
    n, k = w.shape
    num_groups = k // group_size
    q, z, s = quantize_int4(w, g_idx, num_groups, sym, torch.bfloat16)
    tensors = {'weight_packed': pack_along_cols(q), 'weight_scale': s, 'weight_shape': torch.tensor([n, k])}
    if not sym:
        tensors['weight_zero_point'] = pack_along_rows(z.to(torch.uint8))
    if not torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group_size):
        tensors['weight_g_idx'] = g_idx
    return tensors, int4_reference(q, z, s, g_idx)


def int8_tensors(w):
    """int-quantized: symmetric per channel, scale absmax / 127.5 as compressed-tensors takes it (so -128 occurs)."""
    s = (w.abs().amax(1, keepdim=True) / 127.5).to(torch.bfloat16)
    q = torch.round(w / s.float()).clamp(-128, 127).to(torch.int8)
    return {'weight': q, 'weight_scale': s}, q.float() * s.float()


def fp8_tensors(w, scheme: str, block: int = 64):
    """e4m3 weights with a scale per tensor (scalar), channel ([N, 1]) or block (``weight_scale_inv``)."""
    n, k = w.shape
    if scheme == 'tensor':
        s = w.abs().amax() / 448
        expanded = s
    elif scheme == 'channel':
        s = w.abs().amax(1, keepdim=True) / 448
        expanded = s
    else:
        s = w.abs().reshape(n // block, block, k // block, block).amax((1, 3)) / 448
        expanded = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
    s = s.to(torch.bfloat16)
    expanded = expanded.to(torch.bfloat16).float()
    q = (w / expanded).to(torch.float8_e4m3fn)
    return {'weight': q, 'weight_scale_inv' if scheme == 'block' else 'weight_scale': s}, q.float() * expanded


def save_checkpoint(arch: str, path: str, quant_config: dict, linear) -> torch.nn.Module:
    """A tiny random ``arch`` model saved with each layer linear X replaced by ``linear(name, w)``'s tensors
    (X.<field>); returns the HF float32 model on the weights those tensors stand for."""
    cfg_name, model_name, extra = ARCHS[arch]
    model, hf_config = tiny_hf_model(cfg_name, model_name, seed=3, **TINY, **extra)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        del state['lm_head.weight']
    ckpt, ref = {}, {}
    for name, t in state.items():
        base = name[:-len('.weight')]
        if name.endswith('.weight') and base.endswith(LINEARS):
            tensors, ref[name] = linear(base, t)
            ckpt.update({f'{base}.{field}': v for field, v in tensors.items()})
        else:
            ckpt[name] = t.to(torch.bfloat16)
            ref[name] = ckpt[name].float()
    os.makedirs(path, exist_ok=True)
    save_file(ckpt, os.path.join(path, 'model.safetensors'))
    cfg = hf_config.to_dict()
    cfg['torch_dtype'] = 'bfloat16'
    cfg['quantization_config'] = quant_config
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    model.load_state_dict(ref, strict=not hf_config.tie_word_embeddings)
    return model


def ct_config(fmt: str, weights: dict, input_activations: dict | None = None) -> dict:
    return {'quant_method': 'compressed-tensors', 'format': fmt, 'quantization_status': 'compressed',
            'ignore': ['lm_head'], 'config_groups': {'group_0': {
                'targets': ['Linear'], 'weights': weights, 'input_activations': input_activations}}}


# ---- checks ---------------------------------------------------------------------------------------------

def check_engines(path: str, ref, fmt: str, tolerance: float = TOLERANCE) -> None:
    """Both engines on ``path``: logits within ``tolerance`` of ``ref`` (teacher forced), greedy tokens equal."""
    toks = tokens(11 + 16, seed=7)
    want = hf_logits(ref, toks)
    for got in (tm_logits(path, toks)[10:], pt_logits(path, toks)):
        diff = (got - want[10:]).abs().max().item()
        assert diff < tolerance, diff
    prompts = [tokens(n, seed=n) for n in PROMPT_LENS]
    expected = [hf_greedy(ref, p, GREEDY_TOKENS) for p in prompts]
    assert engine_greedy(path, prompts, GREEDY_TOKENS) == expected
    with pt_engine(path) as engine:
        assert engine.model_format == fmt
    assert pt_greedy(path, prompts, GREEDY_TOKENS) == expected


# ---- GPTQ -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('arch, group_size, sym, v2, act_order_perms', [
    ('llama', 32, True, False, None),       # desc_act false, the 'gptq' format's z - 1
    ('qwen2', 64, False, True, 'own'),      # act-order, each of q, k, v its own g_idx: parts
    ('llama', 64, False, False, 'input'),   # act-order, one g_idx per input (as AutoGPTQ's Hessian gives)
])
def test_gptq(tmp_path, arch, group_size, sym, v2, act_order_perms):
    gen = torch.Generator().manual_seed(group_size)
    per_input: dict[str, torch.Tensor] = {}

    def linear(base, w):
        shuffled = None if act_order_perms is None else gen
        if act_order_perms == 'input':  # q/k/v share x, gate/up share x
            key = base.rsplit('.', 1)[0] + ('.o' if base.endswith('o_proj') else '.down' if 'down' in base else '')
            g_idx = per_input.setdefault(key, groups_of(w.shape[1], group_size, gen))
        else:
            g_idx = groups_of(w.shape[1], group_size, shuffled)
        return gptq_tensors(w, group_size, sym, v2, g_idx)

    cfg = {'quant_method': 'gptq', 'bits': 4, 'group_size': group_size, 'desc_act': act_order_perms is not None,
           'sym': sym, 'checkpoint_format': 'gptq_v2' if v2 else 'gptq'}
    ref = save_checkpoint(arch, str(tmp_path), cfg, linear)
    with TurbomindEngine(str(tmp_path), TurbomindEngineConfig(**ENGINE)) as engine:
        tensors = engine.model.tensors
        assert engine.model_format == 'gptq'
        assert ('layers.0.qkv.part_rows' in tensors) == (act_order_perms == 'own')
        assert ('layers.0.qkv.perm' in tensors) == (act_order_perms == 'input')
        assert set(engine.model.linear_formats.values()) == {'w4a16', 'float'}
    check_engines(str(tmp_path), ref, 'gptq')


def test_gptq_reads_zero_points_as_the_kernels_do():
    """'gptq' adds 1 to each stored nibble (15 -> 16), 'gptq_v2' none; act-order sorts k by group."""
    k, n = 64, 8
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    stored = torch.tensor([[15, 0, 7, 3, 15, 1, 2, 14]], dtype=torch.uint8)        # [groups = 1, N]
    s = torch.rand(1, n, dtype=torch.float16) + 0.5
    g_idx = torch.zeros(k, dtype=torch.int32)
    for offset in (1, 0):
        got = from_gptq(pack_along_rows(q.T), pack_along_cols(stored), s, g_idx, offset)
        assert len(got) == 3  # one group: no permutation
        want = int4_reference(q, stored.T.float() + offset, s.T, g_idx)
        assert torch.equal(dequantize_w4a16(*got), want)
    g_idx = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.int32)
    assert act_order(g_idx, 2).tolist() == [1, 3, 4, 0, 2, 5]
    with pytest.raises(ValueError, match='each of the 2 groups'):
        act_order(torch.tensor([1, 0, 1, 1], dtype=torch.int32), 2)


# ---- compressed-tensors ---------------------------------------------------------------------------------

@pytest.mark.parametrize('arch, group_size, sym, actorder', [
    ('llama', 32, True, False), ('qwen2', 64, False, True), ('llama', None, False, False)])  # None: channel
def test_compressed_tensors_w4a16(tmp_path, arch, group_size, sym, actorder):
    gen = torch.Generator().manual_seed(1)

    def linear(_, w):
        g = group_size or w.shape[1]
        return pack_quantized_tensors(w, g, sym, groups_of(w.shape[1], g, gen if actorder else None))

    weights = {'num_bits': 4, 'type': 'int', 'symmetric': sym, 'strategy': 'group' if group_size else 'channel',
               'group_size': group_size, 'actorder': 'group' if actorder else None}
    ref = save_checkpoint(arch, str(tmp_path), ct_config('pack-quantized', weights), linear)
    check_engines(str(tmp_path), ref, 'compressed-tensors')


def test_compressed_tensors_w8a8_and_w8a16(tmp_path):
    weights = {'num_bits': 8, 'type': 'int', 'symmetric': True, 'strategy': 'channel'}
    activations = {'num_bits': 8, 'type': 'int', 'symmetric': True, 'strategy': 'token', 'dynamic': True}
    ref = save_checkpoint('qwen2', str(tmp_path / 'w8a8'), ct_config('int-quantized', weights, activations),
                          lambda _, w: int8_tensors(w))
    assert any((t == -128).any() for t in load_file(tmp_path / 'w8a8' / 'model.safetensors').values()
               if t.dtype == torch.int8)
    # a prompt whose activations stay clear of int8 rounding boundaries: a flip (one code step, from float
    # rounding differences of ~1e-6 in norms or attention) early in the prompt moves every later position
    toks = tokens(11 + 16, seed=1)
    float_ref = hf_logits(ref, toks)[10:]
    quantize_activations_per_token(ref)
    want = hf_logits(ref, toks)[10:]
    for got in (tm_logits(str(tmp_path / 'w8a8'), toks)[10:], pt_logits(str(tmp_path / 'w8a8'), toks)):
        # as in test_turbomind_formats' W8A8 test: most positions within the tolerance, none without the
        # activation quantization
        diff = (got - want).abs().amax(-1)
        assert (diff < W8A8_TOLERANCE).float().mean().item() >= 0.75, diff
        assert ((got - float_ref).abs().amax(-1) > 100 * W8A8_TOLERANCE).all()
    ref = save_checkpoint('llama', str(tmp_path / 'w8a16'), ct_config('naive-quantized', weights),
                          lambda _, w: int8_tensors(w))
    with pt_engine(str(tmp_path / 'w8a16')) as engine:
        assert engine.runner.model.layers[0].down_weight[1].shape == (TINY['hidden_size'], 1)  # W8A16, G = K
    check_engines(str(tmp_path / 'w8a16'), ref, 'compressed-tensors')


# ---- FP8 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('scheme', ['tensor', 'block', 'channel'])
def test_fp8_runs_dequantized(tmp_path, scheme):
    if scheme == 'channel':  # compressed-tensors' float-quantized
        cfg = ct_config('float-quantized', {'num_bits': 8, 'type': 'float', 'symmetric': True, 'strategy': 'channel'},
                        {'num_bits': 8, 'type': 'float', 'symmetric': True, 'strategy': 'token', 'dynamic': True})
    else:  # transformers / vLLM
        cfg = {'quant_method': 'fp8', 'activation_scheme': 'dynamic',
               **({'weight_block_size': [64, 64]} if scheme == 'block' else {})}
    ref = save_checkpoint('llama', str(tmp_path), cfg, lambda _, w: fp8_tensors(w, scheme))
    check_engines(str(tmp_path), ref, 'compressed-tensors' if scheme == 'channel' else 'fp8', tolerance=1e-4)


# ---- mixture of experts -----------------------------------------------------------------------------------

# Qwen2-MoE: every layer sparse, 4 experts beside a shared expert; each expert's, and the shared expert's,
# gate / up / down quantized as the attention matmuls are (the router and the shared expert's gate stay float)
MOE = dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=96,
           norm_topk_prob=False)
MOE_MATMULS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


def save_moe_checkpoint(path: str, quant_config: dict, linear) -> torch.nn.Module:
    """``save_checkpoint`` for a tiny Qwen2-MoE, read back from its saved per-expert tensors (transformers
    holds the experts stacked in memory); returns HF float32 on the weights the checkpoint stands for."""
    import transformers
    model, _ = tiny_hf_model('Qwen2MoeConfig', 'Qwen2MoeForCausalLM', seed=3, **TINY, **MOE)
    model.save_pretrained(os.path.join(path, 'float'))
    ckpt, ref = {}, {}
    for name, t in load_file(os.path.join(path, 'float', 'model.safetensors')).items():
        base = name[:-len('.weight')]
        if name.endswith('.weight') and base.endswith(MOE_MATMULS):
            tensors, ref[name] = linear(base, t.float())
            ckpt.update({f'{base}.{field}': v for field, v in tensors.items()})
        else:
            ckpt[name] = t.to(torch.bfloat16)
            ref[name] = ckpt[name].float()
    with open(os.path.join(path, 'float', 'config.json')) as f:
        cfg = json.load(f)
    for sub, tensors, extra in (('ckpt', ckpt, {'quantization_config': quant_config}), ('ref', ref, {})):
        os.makedirs(os.path.join(path, sub))
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, sub, 'model.safetensors'))
        with open(os.path.join(path, sub, 'config.json'), 'w') as f:
            json.dump({**cfg, 'torch_dtype': 'bfloat16', **extra}, f)
    return transformers.Qwen2MoeForCausalLM.from_pretrained(os.path.join(path, 'ref'), dtype=torch.float32,
                                                            attn_implementation='eager').eval()


@pytest.mark.parametrize('fmt', ['gptq', 'w8a16'])
def test_moe_experts_run_quantized(tmp_path, fmt):
    """A Qwen2-MoE checkpoint with quantized experts (GPTQ W4A16, compressed-tensors W8A16): both engines
    run each expert's matmuls quantized, one matmul an expert, and match HF on the dequantized weights."""
    if fmt == 'gptq':
        cfg = {'quant_method': 'gptq', 'bits': 4, 'group_size': 32, 'desc_act': False, 'sym': True}
        ref = save_moe_checkpoint(str(tmp_path), cfg, lambda _, w: gptq_tensors(
            w, 32, True, False, groups_of(w.shape[1], 32, None)))
    else:
        cfg = ct_config('naive-quantized', {'num_bits': 8, 'type': 'int', 'symmetric': True, 'strategy': 'channel'})
        ref = save_moe_checkpoint(str(tmp_path), cfg, lambda _, w: int8_tensors(w))
    path = str(tmp_path / 'ckpt')
    with TurbomindEngine(path, TurbomindEngineConfig(**ENGINE)) as engine:
        tensors = engine.model.tensors
        assert 'layers.0.experts.gate_up' not in tensors and 'layers.1.experts.down.3.qweight' in tensors
        assert 'layers.0.shared_gate_up.qweight' in tensors
    with pt_engine(path) as engine:
        moe = engine.runner.model.layers[0].moe
        assert isinstance(moe.gate_up, list) and len(moe.down) == MOE['num_experts']
    check_engines(path, ref, 'gptq' if fmt == 'gptq' else 'compressed-tensors')
    # TurboMind's own layout keeps the quantized experts as they are
    out = convert(path, str(tmp_path / 'tm'), backend='turbomind', dtype='float32')
    assert 'layers.1.experts.down.3.qweight' in load_file(os.path.join(out, WEIGHTS_FILE))
    prompts = [tokens(n, seed=n) for n in PROMPT_LENS]
    assert engine_greedy(out, prompts, GREEDY_TOKENS) == [hf_greedy(ref, p, GREEDY_TOKENS) for p in prompts]


# ---- errors ---------------------------------------------------------------------------------------------

def rewrite(path, config=None, drop=(), change=None) -> None:
    """Edit a saved checkpoint: quantization_config keys, tensors dropped or replaced."""
    if config:
        cfg = json.load(open(os.path.join(path, 'config.json')))
        cfg['quantization_config'].update(config)
        json.dump(cfg, open(os.path.join(path, 'config.json'), 'w'))
    weights = load_file(os.path.join(path, 'model.safetensors'))
    for name in drop:
        del weights[name]
    weights.update(change or {})
    save_file(weights, os.path.join(path, 'model.safetensors'))


def test_malformed_checkpoints_name_the_field(tmp_path):
    gptq = str(tmp_path / 'gptq')
    save_checkpoint('llama', gptq, {'quant_method': 'gptq', 'bits': 4, 'group_size': 32, 'desc_act': False},
                    lambda _, w: gptq_tensors(w, 32, True, False, groups_of(w.shape[1], 32, None)))
    assert ModelConfig.from_dir(gptq).model_format == 'gptq'
    with pytest.raises(ModelFormatError, match="gptq checkpoint .* model_format='awq'"):
        pt_engine(gptq, model_format='awq')
    p = 'model.layers.1.mlp.up_proj'
    cases = [
        (dict(config={'checkpoint_format': 'marlin'}), "checkpoint_format 'marlin'"),
        (dict(config={'bits': 8}), 'bits must be 4'),
        (dict(drop=[p + '.qzeros']), f"'{p}.qzeros' is missing"),
        (dict(change={p + '.g_idx': torch.zeros(128, dtype=torch.int32)}), f"GPTQ linear '{p}': g_idx does not"),
        (dict(change={p + '.scales': torch.ones(2, 256, dtype=torch.float16)}), f"'{p}.scales' has 2 groups"),
    ]
    for edit, message in cases:
        save_checkpoint('llama', gptq, {'quant_method': 'gptq', 'bits': 4, 'group_size': 32, 'desc_act': False},
                        lambda _, w: gptq_tensors(w, 32, True, False, groups_of(w.shape[1], 32, None)))
        rewrite(gptq, **edit)
        for build in (pt_engine, lambda path: TurbomindEngine(path, TurbomindEngineConfig(**ENGINE))):
            with pytest.raises(ModelFormatError, match=message):
                build(gptq)

    ct = str(tmp_path / 'ct')
    weights = {'num_bits': 4, 'type': 'int', 'symmetric': False, 'strategy': 'group', 'group_size': 32}
    cases = [
        (dict(config={'format': 'sparse-24-bitmask'}), "config_groups.group_0.format: 'sparse-24-bitmask'"),
        (dict(config={'sparsity_config': {'format': 'sparse-24'}}), "sparsity_config.format: 'sparse-24'"),
        (dict(change={p + '.weight_zero_point': torch.zeros(4, 8, dtype=torch.int32)}),
         f"'{p}.weight_zero_point' is torch.int32 \\[4, 8\\]"),
        (dict(change={p + '.weight_shape': torch.tensor([256, 100])}), f"'{p}.weight_shape' is \\[256, 100\\]"),
    ]
    for edit, message in cases:
        save_checkpoint('llama', ct, ct_config('pack-quantized', weights),
                        lambda _, w: pack_quantized_tensors(w, 32, False, groups_of(w.shape[1], 32, None)))
        rewrite(ct, **edit)
        with pytest.raises(ModelFormatError, match=message):
            pt_engine(ct)

    fp8 = str(tmp_path / 'fp8')
    save_checkpoint('llama', fp8, {'quant_method': 'fp8'}, lambda _, w: fp8_tensors(w, 'channel'))
    rewrite(fp8, drop=[p + '.weight_scale'])
    with pytest.raises(ModelFormatError, match=f"FP8 tensor '{p}.weight' has no '{p}.weight_scale'"):
        TurbomindEngine(fp8, TurbomindEngineConfig(**ENGINE))
