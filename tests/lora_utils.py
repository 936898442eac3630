"""Random PEFT LoRA adapters on tiny HF models, and HF + PEFT's logits as the reference, shared by the
LoRA tests of both engines."""
from __future__ import annotations

import copy

import torch

# adapters of different ranks, targets and scalings: (name, LoraConfig keyword arguments)
ADAPTERS = {
    'attn': dict(r=8, lora_alpha=16, target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']),
    'mlp': dict(r=4, lora_alpha=8, target_modules=['gate_proj', 'up_proj', 'down_proj']),
    'all-rs': dict(r=16, lora_alpha=4, use_rslora=True,
                   target_modules=['q_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']),
    # a rank and an alpha of their own for some modules; only layer 0's q_proj and k_proj
    'patterns': dict(r=6, lora_alpha=12, target_modules=['q_proj', 'k_proj', 'down_proj'],
                     rank_pattern={'k_proj': 2}, alpha_pattern={'down_proj': 3}),
}


def make_adapter(model, path: str, seed: int, **lora_kwargs) -> str:
    """Save a PEFT LoRA adapter of ``model`` (an HF causal LM, left untouched) with random A and B
    (PEFT initialises B to zero, which would make every adapter the base model) in ``path``."""
    import peft
    config = peft.LoraConfig(task_type='CAUSAL_LM', lora_dropout=0.0, **lora_kwargs)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if 'lora_A' in name or 'lora_B' in name:
                p.normal_(0, 0.3 / p.shape[-1] ** 0.5)
    wrapped.save_pretrained(path, safe_serialization=True)
    return path


def make_adapters(model, out_dir: str, names=tuple(ADAPTERS)) -> dict[str, str]:
    """``ADAPTERS`` (those named) saved under ``out_dir``: name -> folder."""
    return {name: make_adapter(model, f'{out_dir}/{name}', seed=i + 1, **ADAPTERS[name])
            for i, name in enumerate(names)}


def peft_model(model, adapter_dir: str | None):
    """``model`` with the adapter in ``adapter_dir`` applied by PEFT (unmerged), or ``model`` itself."""
    if adapter_dir is None:
        return model
    import peft
    return peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter_dir).eval()


@torch.no_grad()
def peft_logits(model, adapter_dir: str | None, token_ids: list[int]) -> torch.Tensor:
    """float32 [n, vocab]: HF + PEFT's teacher-forced logits of ``token_ids``."""
    return peft_model(model, adapter_dir)(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def peft_greedy(model, adapter_dir: str | None, token_ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ``token_ids`` by HF + PEFT (no stop token)."""
    m = peft_model(model, adapter_dir)
    out = m.generate(torch.tensor([token_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(token_ids):].tolist()
