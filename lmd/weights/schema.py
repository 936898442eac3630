"""The weights of a Llama-family model by name: what each architecture holds (HF names and
shapes, ``check_weights``) and how its matmuls fuse, in one place for both engines.

A decoder layer runs four matmuls (``LAYER_MATMULS``): q/k/v fused into ``qkv``
([(Hq + 2 Hk) * D, H]), ``o``, gate/up fused into ``gate_up`` ([2 I, H]) and ``down``; the
parts are concatenated along N, biases alike. A checkpoint that stores them fused already (Phi-3:
``CHECKPOINT_FUSED``) has one part each (``layer_matmuls``). A quantized matmul (``quant_layouts.py``) is a
tuple standing for its [N, K] weight: (qweight, scales, mins) W4A16, (qweight, scales, mins, perm)
W4A16 over x[:, perm] (GPTQ act-order), (qweight int8, scales [N, K / G]) W8A16, (qweight int8, scales
[N]) W8A8; fused, each field is concatenated along N (``fuse_quantized``), except where the parts read
differently permuted inputs: those stay parts, ``<name>.part.<i>.qweight`` ..., each the next
``<name>.part_rows[i]`` rows of the output with its own ``_bias``.
(raw uint8, type int32 [1]) is GGUF blocks as stored; fused, the parts go in runs of one block type
(``<name>.gguf.<i>``, their types in ``<name>.gguf_types``), each run its own columns of the output.

``fuse_weights`` gives the fused tensors under TurboMind's names (``embed``, ``norm``,
``lm_head``, ``layers.{i}.qkv`` ...), the names of TurboMind's own layout
(``turbomind_layout.py``).
"""
from __future__ import annotations

import torch

from lmd.errors import ModelFormatError
from lmd.model_config import ModelConfig

from .mla import fuse_mla, mla_weight_shapes
from .moe import fuse_moe, moe_weight_shapes, quantized_moe_matmuls
from .quant_layouts import gguf_as_w8a16, gguf_block_shape
from .interleaved_rope import to_half_split
from .rope import build_cos_sin_cache

# The seven matmuls of a decoder layer, under model.layers.{i}.
LINEARS = ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'self_attn.o_proj',
           'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj')
# fused matmul -> the HF matmuls concatenated (along N) into it
LAYER_MATMULS = {
    'qkv': ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj'),
    'o': ('self_attn.o_proj',),
    'gate_up': ('mlp.gate_proj', 'mlp.up_proj'),
    'down': ('mlp.down_proj',),
}
MATMUL_SUFFIXES = tuple(f'.{name}' for name in LAYER_MATMULS)
# Buffers some checkpoints still carry; recomputed, never read.
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)


# Checkpoints that store a fused matmul as one tensor (Phi-3's qkv_proj [(Hq + 2 Hk) * D, H] and
# gate_up_proj [2 I, H], gate rows first): fused matmul -> that tensor's matmul.
CHECKPOINT_FUSED = {'qkv': ('self_attn.qkv_proj',), 'gate_up': ('mlp.gate_up_proj',)}
# family -> the fused matmuls its checkpoints store as one tensor (GLM: gate_up only)
_CHECKPOINT_FUSED_FAMILIES = {'phi3': ('qkv', 'gate_up'), 'glm': ('gate_up',), 'glm4': ('gate_up',)}


def layer_matmuls(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Fused matmul -> the HF matmuls of ``config``'s checkpoint concatenated (along N) into it."""
    fused = _CHECKPOINT_FUSED_FAMILIES.get(config.family, ())
    return {**LAYER_MATMULS, **{name: CHECKPOINT_FUSED[name] for name in fused}} if fused else LAYER_MATMULS


def matmul_parts(config: ModelConfig, layer: int, fused: str, field: str = 'weight') -> list[str]:
    """The HF names of ``field`` ('weight' or 'bias') of the parts of layer ``layer``'s ``fused`` matmul."""
    return [f'model.layers.{layer}.{part}.{field}' for part in layer_matmuls(config)[fused]]


def _matmul_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF matmul (``self_attn.q_proj`` ...) -> its weight's [N, K], fused checkpoint tensors included."""
    H, I = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {'self_attn.q_proj': (q_size, H), 'self_attn.k_proj': (kv_size, H), 'self_attn.v_proj': (kv_size, H),
            'self_attn.qkv_proj': (q_size + 2 * kv_size, H), 'self_attn.o_proj': (H, q_size),
            'mlp.gate_proj': (I, H), 'mlp.up_proj': (I, H), 'mlp.gate_up_proj': (2 * I, H), 'mlp.down_proj': (H, I)}


# families whose layer norms HF names its own way: OLMo 2 norms only the attention's and the MLP's
# outputs (no pre-norms); GLM-4's sandwich
_FAMILY_NORMS = {
    'olmo2': {'attn_out_norm': 'post_attention_layernorm', 'mlp_out_norm': 'post_feedforward_layernorm'},
    'glm4': {'input_norm': 'input_layernorm', 'attn_out_norm': 'post_self_attn_layernorm',
             'post_norm': 'post_attention_layernorm', 'mlp_out_norm': 'post_mlp_layernorm'},
}


def layer_norms(config: ModelConfig) -> dict[str, str]:
    """A decoder layer's RMSNorms over H: our name -> HF's, under model.layers.{i}. ``post_norm`` is the
    one before the MLP; Gemma's sandwich adds one on the attention's output and one on the MLP's. Without
    ``pre_norms`` (OLMo 2) there is no ``input_norm`` nor ``post_norm``: each block reads the residual."""
    if config.family in _FAMILY_NORMS:
        return _FAMILY_NORMS[config.family]
    if not config.sandwich_norms:
        return {'input_norm': 'input_layernorm', 'post_norm': 'post_attention_layernorm'}
    return {'input_norm': 'input_layernorm', 'attn_out_norm': 'post_attention_layernorm',
            'post_norm': 'pre_feedforward_layernorm', 'mlp_out_norm': 'post_feedforward_layernorm'}


def norm_weight(config: ModelConfig, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An RMSNorm's weight as the kernels scale by it: Gemma's (1 + w), summed in float32 as HF does."""
    if not config.norm_offset:
        return weight.to(dtype).contiguous()
    return (weight.float() + config.norm_offset).to(dtype).contiguous()


def expected_weight_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """HF tensor name -> shape for every tensor the model needs, and the set of names
    that may be present but are not required (tied lm_head)."""
    H, D = config.hidden_size, config.head_dim
    mlp_bias = bool(config.raw.get('mlp_bias', False))
    biased = {'qkv': config.attention_bias,
              'o': config.attention_bias and config.family in ('llama', 'qwen3', 'smollm3', 'qwen3_moe', 'olmo2',
                                                               'gpt_oss'),
              'gate_up': mlp_bias, 'down': mlp_bias}
    matmul_shapes = _matmul_shapes(config)
    shapes: dict[str, tuple[int, ...]] = {
        'model.embed_tokens.weight': (config.vocab_size, H),
        'model.norm.weight': (H,),
    }
    optional: set[str] = set()
    if config.tie_word_embeddings:
        optional.add('lm_head.weight')
    shapes['lm_head.weight'] = (config.vocab_size, H)
    for n in range(config.num_layers):
        p = f'model.layers.{n}.'
        for hf_name in layer_norms(config).values():
            shapes[f'{p}{hf_name}.weight'] = (H,)
        for fused, parts in layer_matmuls(config).items():
            if fused in ('gate_up', 'down') and config.is_sparse(n):
                continue  # a mixture of experts instead (lmd.weights.moe)
            if fused in ('qkv', 'o') and config.mla is not None:
                continue  # latent attention instead (lmd.weights.mla)
            for part in parts:
                shapes[f'{p}{part}.weight'] = matmul_shapes[part]
                if biased[fused]:
                    shapes[f'{p}{part}.bias'] = matmul_shapes[part][:1]
        if config.qk_norm:  # per head, or over all heads at once (OLMo 2)
            shapes[p + 'self_attn.q_norm.weight'] = (config.num_heads * D if config.qk_norm_all_heads else D,)
            shapes[p + 'self_attn.k_norm.weight'] = (config.num_kv_heads * D if config.qk_norm_all_heads else D,)
        if config.attention_sinks:  # gpt-oss: a logit per query head
            shapes[p + 'self_attn.sinks'] = (config.num_heads,)
        if config.is_sparse(n):
            shapes.update(moe_weight_shapes(config, n))
        if config.mla is not None:
            shapes.update(mla_weight_shapes(config, n))
    return shapes, optional


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise ModelFormatError naming every unknown, missing or wrongly shaped tensor."""
    shapes, optional = expected_weight_shapes(config)
    problems = []
    for name, t in weights.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name not in shapes:
            problems.append(f'unexpected tensor {name!r} with shape {list(t.shape)}')
        elif tuple(t.shape) != shapes[name]:
            problems.append(f'tensor {name!r} has shape {list(t.shape)}, expected {list(shapes[name])}')
    for name, shape in shapes.items():
        if name not in weights and name not in optional:
            problems.append(f'missing tensor {name!r} (expected shape {list(shape)})')
    if problems:
        more = f' (and {len(problems) - 8} more)' if len(problems) > 8 else ''
        raise ModelFormatError(f'{config.architecture} weights do not match config.json: '
                               + '; '.join(problems[:8]) + more)


_DTYPE_CHECKS = {'int32': lambda t: t.dtype == torch.int32, 'int8': lambda t: t.dtype == torch.int8,
                 'float': lambda t: t.is_floating_point()}


def take_tensor(weights: dict[str, torch.Tensor], name: str, kind: str, where: str) -> torch.Tensor:
    """weights.pop(name): a 2-D tensor of ``kind`` ('int32', 'int8', 'float'), else ModelFormatError naming it."""
    t = weights.pop(name, None)
    if t is None or t.dim() != 2 or not _DTYPE_CHECKS[kind](t):
        got = 'missing' if t is None else f'{t.dtype} {list(t.shape)}'
        raise ModelFormatError(f'{where}: tensor {name!r} is {got}; expected a 2-D {kind} tensor')
    return t


def dense_shape(parts: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """[N, K] of the weight a quantized tuple stands for (W4A16 packs two values a byte)."""
    fmt = quant_format(parts)
    if fmt == 'gguf':
        return gguf_block_shape(parts[0], int(parts[1][0]))
    n, cols = parts[0].shape
    return n, cols * 2 if fmt == 'w4a16' else cols


def check_quantized_weights(config: ModelConfig, weights: dict[str, torch.Tensor],
                            quantized: dict[str, tuple]) -> None:
    """``check_weights`` with each quantized matmul (and no float copy of it) checked by the shape
    of the weight it stands for."""
    check_weights(config, {**weights, **{n: torch.empty(dense_shape(q), device='meta')
                                         for n, q in quantized.items() if n not in weights}})


def quant_format(parts: tuple[torch.Tensor, ...]) -> str:
    """The layout of a quantized matmul: 'w4a16', 'w8a16' or 'w8a8' (``quant_layouts.py``), or 'gguf'
    (raw GGUF blocks and their type, ``gguf_linears.read_gguf_blocks``)."""
    if len(parts) in (3, 4):
        return 'w4a16'
    if parts[0].dtype == torch.uint8:
        return 'gguf'
    return 'w8a8' if parts[1].dim() == 1 else 'w8a16'


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def gguf_runs(qs: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """GGUF parts (raw, type) of one matmul in runs of one block type: consecutive parts of a type
    concatenated along N, in order."""
    runs: list[list] = []
    for raw, type_id in qs:
        if runs and int(runs[-1][1][0]) == int(type_id[0]):
            runs[-1][0].append(raw)
        else:
            runs.append([[raw], type_id])
    return [(torch.cat(raws).contiguous(), type_id) for raws, type_id in runs]


def fuse_quantized(qs: list[tuple]) -> tuple | list[tuple]:
    """The quantized parts of a fused matmul (one format and group count) as one: each field concatenated
    along N, a W4A16 input permutation kept once. Parts that read differently permuted inputs (GPTQ
    act-order, each part its own g_idx) cannot share one gathered x: they stay a list, in order. GGUF
    blocks become one W8A16 weight where their types allow (``gguf_as_w8a16``), else runs of one type
    (``gguf_runs``), each its own part."""
    if quant_format(qs[0]) == 'gguf':
        runs = gguf_runs(qs)
        widened = gguf_as_w8a16(runs)
        return widened if widened is not None else runs[0] if len(runs) == 1 else runs
    perms = [q[3] if len(q) == 4 else None for q in qs]
    if not all(_same_perm(p, perms[0]) for p in perms[1:]):
        return list(qs)
    fused = tuple(torch.cat(fields, dim=0).contiguous() for fields in zip(*(q[:3] for q in qs)))
    return fused if perms[0] is None else (*fused, perms[0])


def fuse_weights(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 quantized: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """HF names -> TurboMind's names (``embed``, ``norm``, ``lm_head``, ``layers.{i}.qkv`` ...).

    ``quantized``: HF weight name (``...q_proj.weight``, ``lm_head.weight``) -> its weight in a
    quantized layout (see the module doc). A fused matmul whose parts are all quantized alike
    runs so (``<name>.qweight``, ``.scales``, ``.mins``; bias float32); else in float from
    ``weights`` (a GGUF conversion has both). The embedding lookup always reads the float rows.
    """
    quantized = quantized or {}
    check_quantized_weights(config, weights, quantized)
    weights = to_half_split(config, weights, quantized)  # GLM's interleaved RoPE (interleaved_rope.py)

    def get(name: str) -> torch.Tensor | None:
        t = weights.get(name)
        return None if t is None else t.to(dtype).contiguous()

    def cat(names: list[str], dt: torch.dtype = dtype) -> torch.Tensor | None:
        if names[0] not in weights:
            return None
        return torch.cat([weights[n].to(dt) for n in names], dim=0).contiguous()

    def put_quantized(name: str, q: tuple) -> None:
        out.update({f'{name}.{field}': t for field, t in zip(('qweight', 'scales', 'mins', 'perm'), q)})

    def linear(name: str, parts: list[str], bias_parts: list[str]) -> None:
        qs = [quantized.get(p) for p in parts]
        if all(q is not None and quant_format(q) == 'gguf' for q in qs):
            # one matmul in runs of parts of one block type each, written into its columns in turn
            runs = gguf_runs(qs)
            for i, (raw, _) in enumerate(runs):
                out[f'{name}.gguf.{i}'] = raw
            out[f'{name}.gguf_types'] = torch.tensor([int(t[0]) for _, t in runs], dtype=torch.int32)
            out[name + '_bias'] = cat(bias_parts, torch.float32)
        elif all(q is not None for q in qs) and len({(quant_format(q), q[1].shape[1:]) for q in qs}) == 1:
            fused = fuse_quantized(qs)
            if isinstance(fused, list):  # parts over differently permuted x, each with its rows of the bias
                for i, (q, b) in enumerate(zip(fused, bias_parts)):
                    put_quantized(f'{name}.part.{i}', q)
                    out[f'{name}.part.{i}_bias'] = cat([b], torch.float32)
                out[name + '.part_rows'] = torch.tensor([q[0].shape[0] for q in fused], dtype=torch.int32)
            else:
                put_quantized(name, fused)
                out[name + '_bias'] = cat(bias_parts, torch.float32)  # the quantized kernels take a float32 bias
        elif all(p in weights for p in parts):
            out[name], out[name + '_bias'] = cat(parts), cat(bias_parts)
        else:
            raise ModelFormatError(f'{config.architecture}: {", ".join(parts)} mix quantized formats or group '
                                   f'sizes without float weights to fall back on; TurboMind fuses them into {name}')

    def norm(name: str) -> torch.Tensor | None:
        return norm_weight(config, weights[name], dtype) if name in weights else None

    out = {'embed': get('model.embed_tokens.weight'), 'norm': norm('model.norm.weight'),
           'cos_sin': build_cos_sin_cache(config, dtype, 'cpu')}
    if config.local_rope_layers:
        out['cos_sin_local'] = build_cos_sin_cache(config, dtype, 'cpu', local=True)
    if 'lm_head.weight' in quantized:
        linear('lm_head', ['lm_head.weight'], ['lm_head.bias'])
    else:
        out['lm_head'] = out['embed'] if config.tie_word_embeddings else get('lm_head.weight')
    def matmul(n: int, fused: str) -> None:
        linear(f'layers.{n}.{fused}', matmul_parts(config, n, fused), matmul_parts(config, n, fused, 'bias'))

    for n in range(config.num_layers):
        p, q = f'model.layers.{n}.', f'layers.{n}.'
        for ours, hf_name in layer_norms(config).items():
            out[q + ours] = norm(f'{p}{hf_name}.weight')
        if config.mla is not None:  # latent attention (lmd.weights.mla)
            out.update(fuse_mla(config, weights, n, dtype))
        else:
            matmul(n, 'qkv')
        out[q + 'q_norm'] = norm(p + 'self_attn.q_norm.weight')
        out[q + 'k_norm'] = norm(p + 'self_attn.k_norm.weight')
        if config.attention_sinks:  # float32 [Hq], as the attention kernels read them
            out[q + 'sinks'] = weights[p + 'self_attn.sinks'].float().contiguous()
        matmul(n, 'o')
        if config.is_sparse(n):  # quantized experts one matmul each, in any layout linear() takes
            moe_quantized = quantized_moe_matmuls(config, n, quantized)
            out.update(fuse_moe(config, weights, n, dtype, moe_quantized))
            for name, parts in moe_quantized.items():
                linear(q + name, parts, [part.removesuffix('.weight') + '.bias' for part in parts])
        else:
            matmul(n, 'gate_up')
            matmul(n, 'down')
    return {k: v for k, v in out.items() if v is not None}


def linear_formats(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Fused matmul name -> how it runs: 'float', 'w4a16', 'w8a16', 'w8a8' or 'gguf' (``fuse_weights``'
    output)."""
    names = ['lm_head'] + [f'layers.{n}{s}' for n in range(config.num_layers) for s in MATMUL_SUFFIXES
                           if not (config.is_sparse(n) and s in ('.gate_up', '.down'))]
    return {n: 'gguf' if n + '.gguf_types' in tensors else 'w4a16' if n + '.part_rows' in tensors else
            'float' if n + '.qweight' not in tensors else
            quant_format(tuple(tensors[f'{n}.{f}'] for f in ('qweight', 'scales', 'mins') if f'{n}.{f}' in tensors))
            for n in names}
