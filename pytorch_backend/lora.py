"""LoRA adapters in the PyTorch engine: served beside the base weights, many in one step.

``lmd.lora`` fuses each adapter once at load as the model's matmuls are fused (qkv, o, gate_up,
down: A [R, K], B [N, R] with the scale folded in). Here they sit in slots (``AdapterSlot.slot``),
in the model's dtype and device, and a step adds, to each matmul's output, ``(x A^T) B^T`` for the
rows of the sequences that run an adapter.

All the adapters of a step run in one grouped pass per matmul, however many there are, with no
per-adapter loop and nothing merged into the base weights: the step's adapters' A are stacked along
the rank (``A_cat`` [sum R, K]) and their B side by side (``B_cat`` [N, sum R]); each row's shrink
``x A_cat^T`` [T, sum R] keeps only the columns of its own adapter (a 0/1 mask by slot) before the
expand ``h B_cat^T``. A step of one adapter skips the mask. The stacks are built once per set of
adapters (keyed by their uids, so an unload or a reload is never served stale) and reused while
that set keeps running.
"""
from __future__ import annotations

import torch

from lmd.lora import FUSED, LoraAdapter

# the stacked weights of at most this many distinct sets of adapters are kept
_MAX_GROUPS = 8


class _Group:
    """The stacked weights of one set of adapters, per layer and fused matmul: (A_cat, B_cat, the slot
    of each rank column), or None where no adapter of the set adapts that matmul."""

    def __init__(self, slots: tuple[int, ...], weights: dict[int, list[dict[str, tuple]]], num_layers: int):
        self.layers: list[dict[str, tuple | None]] = []
        for layer in range(num_layers):
            per_name: dict[str, tuple | None] = {}
            for name in FUSED:
                parts = [(s, weights[s][layer][name]) for s in slots if name in weights[s][layer]]
                if not parts:
                    per_name[name] = None
                    continue
                a = torch.cat([ab[0] for _, ab in parts])
                b = torch.cat([ab[1] for _, ab in parts], dim=1)
                cols = torch.cat([torch.full((ab[0].shape[0],), s, dtype=torch.int32, device=a.device)
                                  for s, ab in parts])
                per_name[name] = (a, b, cols)
            self.layers.append(per_name)


class LoraStep:
    """One step's adapters: ``add`` puts each row's adapter delta onto a matmul's output."""

    def __init__(self, group: _Group, row_slots: torch.Tensor | None):
        self.group = group
        self.row_slots = row_slots  # int32 [T, 1]; None: every row runs the group's one adapter
        self._masks: dict[int, torch.Tensor] = {}  # per column layout (id of its cols tensor)

    def add(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, N] += each row's (x A^T) B^T for matmul ``name`` of ``layer`` (x [T, K])."""
        w = self.group.layers[layer][name]
        if w is None:
            return
        a, b, cols = w
        h = x @ a.t()
        if self.row_slots is not None:
            mask = self._masks.get(id(cols))
            if mask is None:
                mask = self._masks[id(cols)] = (self.row_slots == cols[None, :]).to(h.dtype)
            h.mul_(mask)
        y.add_(h @ b.t())


class ModelLora:
    """The adapters loaded into one model, by slot; each engine thread's step asks ``step`` for its own."""

    def __init__(self, num_layers: int, dtype: torch.dtype, device: torch.device):
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self._slots: dict[int, tuple[int, list[dict[str, tuple]]]] = {}  # slot -> (uid, per layer weights)
        self._groups: dict[tuple[int, ...], _Group] = {}

    def prepare(self, adapter: LoraAdapter) -> list[dict[str, tuple]]:
        """``adapter``'s weights as this model runs them, in its dtype and on its device (``lmd.lora.check_fits``
        first). Any thread."""
        return [{name: (w.a.to(self.device, self.dtype).contiguous(), w.b.to(self.device, self.dtype).contiguous())
                 for name, w in fused.items()} for fused in adapter.layers]

    def install(self, slot: int, uid: int, weights: list[dict[str, tuple]]) -> None:
        """Engine thread, between steps."""
        self._slots[slot] = (uid, weights)
        self._groups = {k: g for k, g in self._groups.items() if slot not in k}

    def remove(self, slot: int) -> None:
        """Engine thread, between steps."""
        self._slots.pop(slot, None)
        self._groups = {k: g for k, g in self._groups.items() if slot not in k}

    def step(self, row_slots: list[int]) -> LoraStep | None:
        """The adapters of a step whose row i runs slot ``row_slots[i]`` (-1: none); None when no row does."""
        active = sorted(set(row_slots) - {-1})
        if not active:
            return None
        key = tuple(active)
        group = self._groups.get(key)
        if group is None:
            if len(self._groups) >= _MAX_GROUPS:
                self._groups.pop(next(iter(self._groups)))
            group = self._groups[key] = _Group(key, {s: self._slots[s][1] for s in key}, self.num_layers)
        uniform = len(active) == 1 and row_slots[0] != -1 and row_slots.count(row_slots[0]) == len(row_slots)
        rows = None if uniform else torch.tensor(row_slots, dtype=torch.int32, device=self.device)[:, None]
        return LoraStep(group, rows)
