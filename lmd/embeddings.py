"""Embeddings: a decoder's final hidden states pooled into one vector per input.

Either engine gives every position's final hidden state, after the model's final norm
(``Engine.get_hidden_states``); this module reads them as the model was trained to be read. How is
the model's to say, in the files sentence-transformers writes beside the weights (as vLLM reads them):

- ``modules.json`` lists the modules an input runs through: a ``Transformer``, then a ``Pooling``
  (its folder's ``config.json`` names the pooling: ``pooling_mode`` 'lasttoken' / 'mean' / 'cls',
  or the older flags ``pooling_mode_lasttoken`` ...), then a ``Normalize`` or not. Any other module
  (``Dense``, ``LayerNorm`` ...) would change the vector in a way lmd does not run: such a model is
  refused, never served with different numbers.
- ``1_Pooling/config.json`` alone (no ``modules.json``) names the pooling; the vector is normalized.
- Neither: last-token pooling, normalized (vLLM's default for decoder embedders, Qwen3-Embedding's way).

A request may ask for fewer ``dimensions`` (Matryoshka: the first d values, normalized again) only
where the model declares it was trained for that, with vLLM's keys in its ``config.json``:
``is_matryoshka: true`` (any size) or ``matryoshka_dimensions: [...]`` (those sizes). Truncating an
embedding trained without it gives vectors that look right and retrieve badly, so it is refused.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ModelFormatError

if TYPE_CHECKING:  # torch is imported where vectors are made: the servers and the CLI start without it
    import torch

POOLING_TYPES = ('last', 'mean', 'cls')
# sentence-transformers' names -> ours
_ST_POOLING = {'lasttoken': 'last', 'mean': 'mean', 'cls': 'cls'}
_ST_FLAGS = {'pooling_mode_lasttoken': 'lasttoken', 'pooling_mode_mean_tokens': 'mean',
             'pooling_mode_cls_token': 'cls', 'pooling_mode_max_tokens': 'max',
             'pooling_mode_mean_sqrt_len_tokens': 'mean_sqrt_len_tokens',
             'pooling_mode_weightedmean_tokens': 'weightedmean'}


@dataclass(frozen=True)
class PoolerConfig:
    """How a model's hidden states become its embedding (vLLM's names).

    ``pooling_type``: 'last' (the last token's state), 'mean' (over every token) or 'cls' (the first
    token's). ``normalize``: L2-normalize the vector. ``is_matryoshka``: a request may ask for fewer
    ``dimensions``; ``matryoshka_dimensions``: then only these (None: any size up to the hidden size)."""
    pooling_type: str = 'last'
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f'PoolerConfig.pooling_type={self.pooling_type!r} is invalid: expected one of '
                             f'{", ".join(POOLING_TYPES)}')
        if self.matryoshka_dimensions is not None:
            dims = self.matryoshka_dimensions
            if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
                raise ValueError(f'PoolerConfig.matryoshka_dimensions={dims!r} is invalid: expected positive ints')

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """ValueError unless an embedding of ``dimensions`` values (None: all) may be asked for."""
        if dimensions is None:
            return
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise ValueError(f'dimensions={dimensions!r} is invalid: expected a positive integer')
        if not self.is_matryoshka:
            raise ValueError(f'dimensions={dimensions}: this model does not declare Matryoshka embeddings (config.json '
                             f'is_matryoshka / matryoshka_dimensions), so its {hidden_size} values cannot be cut '
                             'without spoiling them; leave dimensions out')
        if dimensions > hidden_size:
            raise ValueError(f'dimensions={dimensions} is more than the {hidden_size} values of this model\'s '
                             'embedding')
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f'dimensions={dimensions} is not one this model was trained for: '
                             f'{", ".join(map(str, self.matryoshka_dimensions))}')


def pool(hidden: torch.Tensor, method: str, normalize: bool = True) -> torch.Tensor:
    """float32 [H]: one sequence's hidden states [n, H] pooled by ``method`` ('last', 'mean', 'cls'),
    L2-normalized if ``normalize`` (as sentence-transformers' ``Normalize``: x / max(|x|, 1e-12))."""
    if hidden.dim() != 2 or hidden.shape[0] == 0:
        raise ValueError(f'pool takes hidden states [n >= 1, hidden], got {tuple(hidden.shape)}')
    import torch
    hidden = hidden.float()
    if method == 'last':
        vec = hidden[-1]
    elif method == 'mean':
        vec = hidden.mean(dim=0)
    elif method == 'cls':
        vec = hidden[0]
    else:
        raise ValueError(f'pooling {method!r} is unknown: expected one of {", ".join(POOLING_TYPES)}')
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec.clone()


def embedding(hidden: torch.Tensor, config: PoolerConfig, dimensions: int | None = None) -> torch.Tensor:
    """float32 [dimensions or H]: ``hidden`` [n, H] pooled as ``config`` says, cut to its first
    ``dimensions`` values (checked by ``PoolerConfig.check_dimensions``) and then normalized."""
    import torch
    config.check_dimensions(dimensions, hidden.shape[-1])
    vec = pool(hidden, config.pooling_type, normalize=False)
    if dimensions is not None:
        vec = vec[:dimensions]
    return torch.nn.functional.normalize(vec, dim=-1) if config.normalize else vec


def pooler_config_from_dir(model_dir: str) -> PoolerConfig:
    """The ``PoolerConfig`` a model directory declares (see the module docstring); ModelFormatError for
    sentence-transformers files lmd cannot follow exactly."""
    modules = _read_json(model_dir, 'modules.json')
    normalize, pooling_dir = True, '1_Pooling'
    if modules is not None:
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ModelFormatError(f'{os.path.join(model_dir, "modules.json")}: expected a list of modules')
        kinds = [(str(m.get('type', '')).rsplit('.', 1)[-1], m.get('path', '')) for m in modules]
        other = [k for k, _ in kinds if k not in ('Transformer', 'Pooling', 'Normalize')]
        if other:
            raise ModelFormatError(f'{model_dir}: modules.json lists {", ".join(other)}; lmd embeds with a '
                                   'Transformer, a Pooling and a Normalize module only')
        normalize = any(k == 'Normalize' for k, _ in kinds)
        pooling_dir = next((p for k, p in kinds if k == 'Pooling'), None)
    pooling = _st_pooling(model_dir, pooling_dir) if pooling_dir is not None else 'last'
    config = _read_json(model_dir, 'config.json') or {}
    dims = config.get('matryoshka_dimensions')
    try:
        return PoolerConfig(pooling_type=pooling, normalize=normalize,
                            is_matryoshka=bool(config.get('is_matryoshka')) or dims is not None,
                            matryoshka_dimensions=tuple(dims) if isinstance(dims, list) else dims)
    except ValueError as e:
        raise ModelFormatError(f'{os.path.join(model_dir, "config.json")}: {e}') from None


def _st_pooling(model_dir: str, folder: str) -> str:
    """Our pooling type of sentence-transformers' ``<folder>/config.json`` ('last' if it is absent)."""
    path = os.path.join(folder, 'config.json')
    cfg = _read_json(model_dir, path)
    if cfg is None:
        return 'last'
    mode = cfg.get('pooling_mode')  # sentence-transformers >= 6; before: one flag per mode
    modes = ([mode] if isinstance(mode, str) else list(mode)) if mode else \
        [name for flag, name in _ST_FLAGS.items() if cfg.get(flag)]
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        raise ModelFormatError(f'{os.path.join(model_dir, path)}: pooling {" + ".join(map(str, modes)) or "none"} '
                               'is not one lmd runs: lasttoken, mean or cls')
    return _ST_POOLING[modes[0]]


def _read_json(model_dir: str, name: str):
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelFormatError(f'{path}: not readable JSON ({e})') from None
