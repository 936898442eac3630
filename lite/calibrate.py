"""Calibration: the float HF model run over calibration text one decoder layer at a time,
with statistics of what each linear of the layer is given.

Every sample's input to the current layer is kept ([num_samples, seqlen, hidden]); the layer
runs over it in batches and its outputs overwrite it, so beyond the weights only one layer's
activations exist. The arguments the model's own forward hands each layer (rotary
``position_embeddings``, the causal or sliding-window mask) are recorded once per batch size
by running the model with stand-ins for its layers (``_Recorder``).

``lmd lite calibrate`` writes ``calib_stats.safetensors`` into its work dir:

    <linear>.input_absmax   float32 [in_features]   max |x| per input channel, over every token
    <linear>.input_absmean  float32 [in_features]   mean |x| per input channel
    key_min, key_max        float32 [num_layers, num_kv_heads]   range of K per head (before RoPE;
    value_min, value_max    float32 [num_layers, num_kv_heads]   after k_norm where there is one)

where <linear> is e.g. ``model.layers.3.mlp.down_proj``; the metadata says the model, dataset,
samples and seqlen. (LMDeploy writes the same figures as ``inputs_stats.pth`` / ``key_stats.pth``
/ ``value_stats.pth`` pickles; one safetensors file loads without unpickling.)
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from lmd.weights.schema import LINEARS

from .calib_data import BUILTIN, calib_tokens
from .checkpoint import STATS_FILE, atomic_dir, check_finite

ARCHITECTURES = ('LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'MistralForCausalLM')
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def load_float_model(model: str, dtype: str = 'float32'):
    """(model_dir, HF model in ``dtype``, lmd Tokenizer) of a float Llama / Qwen2 / Qwen3 / Mistral
    model: a directory or 'smollm2' (``prepare_model_dir``)."""
    from transformers import AutoModelForCausalLM

    from lmd.errors import ModelFormatError
    from lmd.model_path import prepare_model_dir
    from lmd.tokenizer import Tokenizer
    if dtype not in DTYPES:
        raise ValueError(f'--dtype {dtype!r} is invalid: allowed values are {", ".join(DTYPES)}')
    model_dir = prepare_model_dir(model)
    with open(os.path.join(model_dir, 'config.json'), encoding='utf-8') as f:
        config = json.load(f)
    arch = (config.get('architectures') or ['?'])[0]
    if arch not in ARCHITECTURES:
        raise ModelFormatError(f'{model_dir}: architecture {arch!r} is not supported by lmd lite; '
                               f'supported: {", ".join(ARCHITECTURES)}')
    if config.get('quantization_config'):
        method = config['quantization_config'].get('quant_method')
        raise ModelFormatError(f'{model_dir} is already quantized ({method}); lmd lite needs a float model')
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation='sdpa')
    return model_dir, hf.eval(), Tokenizer(model_dir)


class _Recorder(nn.Module):
    """Stands in for a decoder layer while the model's forward shows what it hands that layer."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.attention_type = getattr(layer, 'attention_type', None)
        self.given = None

    def forward(self, hidden_states, **kwargs):
        self.given = hidden_states, kwargs
        return hidden_states


class LayerwiseRunner:
    """Pushes calibration samples through the decoder layers one at a time (see the module doc)."""

    def __init__(self, model, tokens: torch.Tensor, batch_size: int):
        if batch_size < 1:
            raise ValueError(f'--batch-size must be positive, got {batch_size}')
        self.layers, self.batch_size = model.model.layers, batch_size
        recorders = nn.ModuleList(_Recorder(layer) for layer in self.layers)
        model.model.layers = recorders
        self.layer_kwargs: dict[int, list[dict]] = {}  # batch size -> what each layer is given
        hidden = []
        try:
            with torch.no_grad():
                for batch in tokens.split(batch_size):
                    model.model(input_ids=batch, use_cache=False)
                    hidden.append(recorders[0].given[0])
                    self.layer_kwargs.setdefault(len(batch), [r.given[1] for r in recorders])
        finally:
            model.model.layers = self.layers
        self.hidden = torch.cat(hidden)  # [num_samples, seqlen, hidden]: the input of the next layer to run

    @torch.no_grad()
    def run(self, i: int, update: bool = True) -> None:
        """Push every sample through layer ``i``; its outputs become the next layer's inputs (``update``)
        or are dropped (a pass for the hooks alone)."""
        for x in self.hidden.split(self.batch_size):
            out = self.layers[i](x, **self.layer_kwargs[len(x)][i])
            if update:
                x.copy_(out[0] if isinstance(out, tuple) else out)


class InputStats:
    """Per-input-channel max and mean of |x| over every token a linear is given, and (``keep_rows``)
    a fixed random sample of those tokens for the quantizers' searches."""

    def __init__(self, keep_rows: int = 0, num_batches: int = 1):
        self.absmax = self.abssum = None
        self.count = 0
        self.rows_per_batch = -(-keep_rows // num_batches) if keep_rows else 0
        self.rows: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        a = x.abs()
        amax, asum = a.amax(0), a.sum(0)
        self.absmax = amax if self.absmax is None else torch.maximum(self.absmax, amax)
        self.abssum = asum if self.abssum is None else self.abssum + asum
        self.count += len(x)
        if self.rows_per_batch:
            g = torch.Generator().manual_seed(len(self.rows))
            self.rows.append(x[torch.randperm(len(x), generator=g)[:self.rows_per_batch]].clone())

    @property
    def absmean(self) -> torch.Tensor:
        return self.abssum / self.count

    @property
    def samples(self) -> torch.Tensor:
        """The kept tokens' inputs [rows, in_features]."""
        return torch.cat(self.rows)


class KVStats:
    """min / max of a layer's K (after k_norm where there is one, before RoPE) and V, per KV head."""

    def __init__(self, num_kv_heads: int):
        self.num_kv_heads = num_kv_heads
        self.ranges: dict[str, list[torch.Tensor]] = {}

    def add(self, which: str, x: torch.Tensor) -> None:
        # x: [batch, seqlen, num_kv_heads * head_dim] (k_proj, v_proj) or
        #    [batch, seqlen, num_kv_heads, head_dim] (k_norm)
        x = x.detach().float().flatten(2).unflatten(-1, (self.num_kv_heads, -1))
        lo, hi = x.amin((0, 1, 3)), x.amax((0, 1, 3))
        if which in self.ranges:
            lo, hi = torch.minimum(self.ranges[which][0], lo), torch.maximum(self.ranges[which][1], hi)
        self.ranges[which] = [lo, hi]


def hook_input_stats(runner: LayerwiseRunner, i: int, keep_rows: int = 0) -> tuple[dict, list]:
    """``InputStats`` of layer ``i``'s linears (keyed by LINEARS names), filled by forward hooks while the
    runner runs the layer; returns them and the hooks' handles (the caller removes them)."""
    layer = runner.layers[i]
    num_batches = -(-len(runner.hidden) // runner.batch_size)
    stats = {name: InputStats(keep_rows, num_batches) for name in LINEARS}
    handles = [layer.get_submodule(name).register_forward_hook(lambda m, args, out, s=stats[name]: s.add(args[0]))
               for name in LINEARS]
    return stats, handles


def run_layers(model, tokens: torch.Tensor, batch_size: int, visit, keep_rows: int = 0) -> None:
    """For each decoder layer i: run every sample through it with hooks gathering ``InputStats`` of
    its linears (keyed by LINEARS names) and ``KVStats``, then ``visit(i, layer, stats, kv)``. A visit
    may change the layer in ways that keep its float output (folding scales): the next layer's
    inputs were computed before it."""
    runner = LayerwiseRunner(model, tokens, batch_size)
    num_kv_heads = model.config.num_key_value_heads
    for i, layer in enumerate(runner.layers):
        stats, handles = hook_input_stats(runner, i, keep_rows)
        kv = KVStats(num_kv_heads)
        attn = layer.self_attn
        k_module = getattr(attn, 'k_norm', None) or attn.k_proj
        handles.append(k_module.register_forward_hook(lambda m, args, out, kv=kv: kv.add('key', out)))
        handles.append(attn.v_proj.register_forward_hook(lambda m, args, out, kv=kv: kv.add('value', out)))
        try:
            runner.run(i)
        finally:
            for h in handles:
                h.remove()
        visit(i, layer, stats, kv)


def calibrate(model: str, work_dir: str, calib_dataset: str = BUILTIN, calib_samples: int = 128,
              calib_seqlen: int = 512, batch_size: int = 4, dtype: str = 'float32') -> str:
    """Write ``work_dir/calib_stats.safetensors`` (see the module doc); returns its path."""
    from safetensors.torch import save_file

    model_dir, hf, tokenizer = load_float_model(model, dtype)
    tokens = calib_tokens(tokenizer, calib_dataset, calib_samples, calib_seqlen)
    out, kv_ranges = {}, {'key_min': [], 'key_max': [], 'value_min': [], 'value_max': []}

    def visit(i, layer, stats, kv):
        for name, s in stats.items():
            out[f'model.layers.{i}.{name}.input_absmax'] = s.absmax
            out[f'model.layers.{i}.{name}.input_absmean'] = s.absmean
        for which, (lo, hi) in kv.ranges.items():
            kv_ranges[f'{which}_min'].append(lo)
            kv_ranges[f'{which}_max'].append(hi)

    run_layers(hf, tokens, batch_size, visit)
    out.update({k: torch.stack(v) for k, v in kv_ranges.items()})
    check_finite(out)
    meta = dict(model=model_dir, calib_dataset=calib_dataset, calib_samples=str(calib_samples),
                calib_seqlen=str(calib_seqlen), dtype=dtype)
    with atomic_dir(work_dir) as tmp:
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(tmp, STATS_FILE), metadata=meta)
    return os.path.join(work_dir, STATS_FILE)
