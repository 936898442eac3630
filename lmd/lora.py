"""LoRA adapters as PEFT saves them, made ready for the engines' fused matmuls.

A PEFT LoRA folder holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``, the
per-module ``rank_pattern`` / ``alpha_pattern``, ``target_modules``) and ``adapter_model.safetensors``
with, for each adapted matmul ``W`` [N, K], ``lora_A`` [r, K] and ``lora_B`` [N, r]: the adapted
layer computes ``x W^T + (x A^T) B^T * s`` with ``s = alpha / r`` (rsLoRA: ``alpha / sqrt(r)``).

Both engines run q/k/v as one ``qkv`` matmul and gate/up as one ``gate_up`` (``lmd.weights.schema``),
so the parts' adapters are fused the same way here, once, at load: the parts' A stacked along the
rank ([r_q + r_k + r_v, K]) and their B placed block-diagonally ([N_q + N_k + N_v, r_q + r_k + r_v],
zeros where a part's output does not read another part's rank), the scale folded into B. A part
without an adapter contributes no rank. Each engine then adds ``(x A^T) B^T`` to a matmul's output
for the rows of the requests that named the adapter, all adapters of a step in one grouped pass
(``lmd.kernels.ops.lora_apply`` on the CPU; a masked matmul over the step's adapters in torch),
never merged into the base weights.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ModelFormatError

if TYPE_CHECKING:  # torch and the weights layer load with the first adapter, not with the engine interface
    import torch

    from .model_config import ModelConfig

# the matmuls an adapter may target, by their HF module names (fused checkpoints' too: Phi-3)
TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', 'qkv_proj', 'gate_up_proj')
FUSED = ('qkv', 'o', 'gate_up', 'down')
_KEY = re.compile(r'^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$')


class LoraError(ModelFormatError):
    """An adapter folder that cannot be served on this model; the message names what is wrong."""


@dataclass(frozen=True)
class LoraLinear:
    """One fused matmul's adapter: y += (x a^T) b^T, the scale folded into b."""
    a: torch.Tensor  # float32 [R, K]
    b: torch.Tensor  # float32 [N, R]


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter ready for the engines: per layer, fused matmul name -> its LoraLinear (absent: none)."""
    name: str
    path: str
    rank: int    # the largest of its parts' ranks
    layers: tuple[dict[str, LoraLinear], ...]

    @property
    def num_params(self) -> int:
        return sum(w.a.numel() + w.b.numel() for layer in self.layers for w in layer.values())


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the first pattern that matches the end of the module's name."""
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(rf'(?:.*\.)?(?:{pattern})', module):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    cfg_file = os.path.join(path, 'adapter_config.json')
    if not os.path.isfile(cfg_file):
        raise LoraError(f'{path} is not a LoRA adapter folder: it has no adapter_config.json')
    with open(cfg_file) as f:
        cfg = json.load(f)
    peft_type = cfg.get('peft_type', 'LORA')
    if peft_type != 'LORA':
        raise LoraError(f'{path}: peft_type {peft_type!r} is not served; only LoRA adapters are')
    refused = {'use_dora': 'DoRA', 'fan_in_fan_out': 'fan_in_fan_out (Conv1D layers)'}
    for key, what in refused.items():
        if cfg.get(key):
            raise LoraError(f'{path}: {what} adapters are not supported')
    if cfg.get('bias', 'none') != 'none':
        raise LoraError(f"{path}: bias={cfg['bias']!r} trains the base model's biases; only bias='none' is served")
    if cfg.get('modules_to_save'):
        raise LoraError(f"{path}: modules_to_save {cfg['modules_to_save']} replaces whole modules of the base "
                        'model; only LoRA matmuls are served (merge those modules into a model of their own)')
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    import torch
    from safetensors.torch import load_file
    st = os.path.join(path, 'adapter_model.safetensors')
    if os.path.isfile(st):
        return load_file(st)
    binary = os.path.join(path, 'adapter_model.bin')
    if os.path.isfile(binary):
        return torch.load(binary, map_location='cpu', weights_only=True)
    raise LoraError(f'{path} has no adapter_model.safetensors (or adapter_model.bin)')


def load_lora_adapter(path: str, config: ModelConfig, name: str | None = None) -> LoraAdapter:
    """The PEFT adapter in folder ``path`` for a model of ``config``, fused as the engines run it
    (see the module docstring). LoraError names what does not fit: a module it targets that lmd does
    not adapt (embeddings, lm_head, experts, latent attention), a layer or shape the model does not have."""
    import torch

    from .weights.interleaved_rope import to_half_split
    from .weights.schema import _matmul_shapes, layer_matmuls
    path = os.path.abspath(os.path.expanduser(path))
    if config.mla is not None:
        raise LoraError(f'{path}: LoRA on {config.architecture} (latent attention, MLA) is not supported')
    cfg = read_adapter_config(path)
    tensors = _read_tensors(path)
    shapes = _matmul_shapes(config)
    # per (layer, 'self_attn.q_proj' ...): {'A': ..., 'B': ...}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(f'{path}: tensor {key} is not a LoRA matmul of a decoder layer; lmd adapts '
                            f'{", ".join(TARGETS)}')
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in TARGETS:
            raise LoraError(f'{path}: {key} targets {module}; lmd adapts {", ".join(TARGETS)}')
        if layer >= config.num_layers:
            raise LoraError(f'{path}: {key} is for layer {layer}; the model has {config.num_layers} layers')
        found.setdefault((layer, f'{block}.{module}'), {})[ab] = t.float()
    if not found:
        raise LoraError(f'{path}: adapter_model holds no LoRA weights')

    alpha = cfg.get('lora_alpha', cfg.get('r', 8))
    rs = bool(cfg.get('use_rslora', False))
    parts: dict[tuple[int, str], LoraLinear] = {}  # unfused, scaled
    for (layer, module), ab in sorted(found.items()):
        where = f'{path}: model.layers.{layer}.{module}'
        if set(ab) != {'A', 'B'}:
            raise LoraError(f'{where} has lora_{"A" if "A" in ab else "B"} without its pair')
        if module not in shapes or module not in sum(layer_matmuls(config).values(), ()):
            raise LoraError(f'{where}: {config.architecture} has no such matmul (its are '
                            f'{", ".join(sum(layer_matmuls(config).values(), ()))})')
        if module.startswith('mlp.') and config.is_sparse(layer):
            raise LoraError(f"{where}: layer {layer} is a mixture of experts; LoRA on experts is not supported")
        a, b = ab['A'], ab['B']
        n, k = shapes[module]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != k or b.shape != (n, r):
            raise LoraError(f'{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its weight '
                            f'[{n}, {k}] (a different base model?)')
        layer_alpha = _pattern_value(cfg.get('alpha_pattern'), f'model.layers.{layer}.{module}', alpha)
        scale = layer_alpha / (math.sqrt(r) if rs else r)
        parts[(layer, module)] = LoraLinear(a.contiguous(), (b * scale).contiguous())

    if config.rope_interleaved:  # GLM: q's and k's rows are permuted at load; so are their adapters' outputs
        named = {f'model.layers.{layer}.{module}.weight': w.b for (layer, module), w in parts.items()}
        named = to_half_split(config, named)
        parts = {key: LoraLinear(w.a, named[f'model.layers.{key[0]}.{key[1]}.weight']) for key, w in parts.items()}

    layers: list[dict[str, LoraLinear]] = []
    for layer in range(config.num_layers):
        fused: dict[str, LoraLinear] = {}
        for fused_name, modules in layer_matmuls(config).items():
            present = [parts.get((layer, m)) for m in modules]
            if all(p is None for p in present):
                continue
            rank = sum(p.a.shape[0] for p in present if p is not None)
            n_total = sum(shapes[m][0] for m in modules)
            b = torch.zeros(n_total, rank)
            n0 = r0 = 0
            for m, p in zip(modules, present):
                if p is not None:
                    r = p.a.shape[0]
                    b[n0:n0 + shapes[m][0], r0:r0 + r] = p.b
                    r0 += r
                n0 += shapes[m][0]
            a = torch.cat([p.a for p in present if p is not None])
            fused[fused_name] = LoraLinear(a, b)
        layers.append(fused)
    rank = max(w.a.shape[0] for w in parts.values())
    return LoraAdapter(name=name or os.path.basename(path.rstrip('/')), path=path, rank=rank, layers=tuple(layers))


def fused_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The engines' fused matmuls (qkv, o, gate_up, down) -> their weight's [N, K]."""
    from .weights.schema import _matmul_shapes, layer_matmuls
    shapes = _matmul_shapes(config)
    return {name: (sum(shapes[m][0] for m in modules), shapes[modules[0]][1])
            for name, modules in layer_matmuls(config).items()}


def check_fits(adapter: LoraAdapter, config: ModelConfig) -> None:
    """ValueError unless ``adapter`` (loaded for some model) fits a model of ``config``, layer by layer."""
    if len(adapter.layers) != config.num_layers:
        raise ValueError(f'adapter {adapter.name!r} has {len(adapter.layers)} layers; the model has '
                         f'{config.num_layers}')
    shapes = fused_shapes(config)
    for layer, fused in enumerate(adapter.layers):
        for name, w in fused.items():
            n, k = shapes[name]
            if w.a.shape[1] != k or w.b.shape[0] != n:
                raise ValueError(f'adapter {adapter.name!r}: layer {layer} {name} is [{w.b.shape[0]}, '
                                 f'{w.a.shape[1]}]; the model\'s is [{n}, {k}]')


def parse_adapters(specs: str | list[str] | tuple | dict[str, str] | None) -> dict[str, str]:
    """``--adapters name=path,...`` (LMDeploy's flag; a bare path is named by its folder) as {name: path}."""
    if not specs:
        return {}
    if isinstance(specs, dict):
        return dict(specs)
    if isinstance(specs, str):
        specs = [s for s in specs.split(',') if s.strip()]
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition('=')
        if not sep:
            name, path = os.path.basename(spec.rstrip('/')), spec
        if not name or not path:
            raise ValueError(f'--adapters {spec!r}: expected name=path')
        if name in out:
            raise ValueError(f'--adapters: the name {name!r} is given twice')
        out[name] = path
    return out


@dataclass(frozen=True)
class AdapterSlot:
    """Where an engine keeps a loaded adapter: ``slot`` indexes its weights (reused after an unload);
    ``uid`` is unique to this load, the salt of its requests' prefix-cache keys (a reloaded name, or
    another adapter in the same slot, never meets blocks computed with the old weights)."""
    name: str
    slot: int
    uid: int
    adapter: LoraAdapter


class AdapterTable:
    """The adapters loaded into one engine and who uses them; thread-safe. A request holds its adapter
    from admission until it finishes, a kept session until it is ended (``SessionTable``), and an
    adapter in use cannot be unloaded."""

    def __init__(self):
        import threading
        self._lock = threading.Lock()
        self._by_name: dict[str, AdapterSlot] = {}
        self._users: dict[str, int] = {}
        self._next_uid = 1

    def add(self, adapter: LoraAdapter) -> AdapterSlot:
        with self._lock:
            if adapter.name in self._by_name:
                raise ValueError(f'an adapter named {adapter.name!r} is already loaded; unload it first')
            used = {s.slot for s in self._by_name.values()}
            slot = next(i for i in range(len(used) + 1) if i not in used)
            entry = AdapterSlot(adapter.name, slot, self._next_uid, adapter)
            self._next_uid += 1
            self._by_name[adapter.name] = entry
            self._users[adapter.name] = 0
            return entry

    def remove(self, name: str) -> AdapterSlot:
        with self._lock:
            entry = self._lookup(name)
            if self._users[name]:
                raise ValueError(f'adapter {name!r} is in use by {self._users[name]} request(s) or kept session(s); '
                                 'unload it when they have finished')
            del self._by_name[name], self._users[name]
            return entry

    def acquire(self, name: str) -> AdapterSlot:
        with self._lock:
            entry = self._lookup(name)
            self._users[name] += 1
            return entry

    def release(self, name: str) -> None:
        with self._lock:
            if name in self._users:
                self._users[name] -= 1

    def get(self, name: str) -> AdapterSlot:
        with self._lock:
            return self._lookup(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def _lookup(self, name: str) -> AdapterSlot:
        entry = self._by_name.get(name)
        if entry is None:
            loaded = ', '.join(repr(n) for n in self._by_name) or 'none'
            raise ValueError(f'adapter {name!r} is not loaded (loaded: {loaded})')
        return entry
