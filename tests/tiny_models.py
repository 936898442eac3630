"""Tiny randomly initialised HF models, shared by the model and engine tests."""
from __future__ import annotations

import torch
import transformers


def tiny_hf_model(config_class: str, model_class: str, seed: int = 0, **config_kwargs):
    """An eager float32 HF model of the named classes, its parameters spread so each matters.

    HF's own init (std 0.02, unit norms, zero biases) leaves logits near uniform, which
    makes greedy ties and hides norm and bias bugs.
    """
    hf_config = getattr(transformers, config_class)(**config_kwargs)
    hf_config.architectures = [model_class]
    hf_config._attn_implementation = 'eager'
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'norm' in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.12)
    return model, hf_config


def saved_models(tmp_path_factory, make):
    """family -> (HF model, the directory it is saved in), each built once by ``make(family)``, whose
    first value is the HF model."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = make(family)[0]
            path = str(tmp_path_factory.mktemp(family))
            model.save_pretrained(path, safe_serialization=True)
            cache[family] = (model, path)
        return cache[family]
    return get
