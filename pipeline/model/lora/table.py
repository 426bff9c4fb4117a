"""The adapters resident on one model (one rank's shard of it): for each projection and slot, the low-rank
pair this rank multiplies by, laid out for its fused, tensor-parallel linear.

Why per linear rather than per checkpoint module: the decoder fuses q/k/v and gate/up into one linear each,
and under tensor parallelism a linear holds a slice. A pair is therefore stored as the linear computes
it: for a column-parallel linear (fused q/k/v, gate/up) A stacks the parts' A matrices in full and B is
block-diagonal, each part's B cut to this rank's output rows; for a row-parallel linear (o, down) A is cut
to this rank's input columns and B is whole, so each rank's partial delta joins the layer's partial sums
in the existing all-reduce and the delta is added once. The scale is folded into B.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.model.layers import ParallelLinear
from pipeline.model.lora.delta import LoraStep, segments_of
from pipeline.model.lora.peft_file import Adapter

# The fused linear of each checkpoint module, and the module's part index in it.
LINEAR_OF = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
             "down_proj": ("down_proj", 0)}

# A pair as a step multiplies: (A^T [in, r], B^T scaled [r, out]).
Pair = tuple[torch.Tensor, torch.Tensor]


def layer_linears(layer: nn.Module) -> dict[str, ParallelLinear]:
    """A decoder layer's four linears by name."""
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj, "gate_up_proj": mlp.gate_up_proj,
            "down_proj": mlp.down_proj}


def linear_pair(linear: ParallelLinear, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], scale: float,
                dtype: torch.dtype, device: torch.device) -> Pair:
    """This rank's pair for `linear` from the full (A, B) of its targeted parts (part index -> pair)."""
    order = sorted(parts)
    if linear.shard_dim == 1:  # row-parallel, never fused: A by this rank's input columns, B whole
        a, b = parts[0]
        a_local, b_local = linear.shard_of(a), b
    else:
        a_local = torch.cat([parts[p][0] for p in order])
        b_local = torch.zeros(linear.out_features, a_local.shape[0])
        column = 0
        for p in order:
            b_part = parts[p][1]
            start, n = linear.local_rows(p)
            b_local[start : start + n, column : column + b_part.shape[1]] = linear.shard_of(b_part, p)
            column += b_part.shape[1]
    a_t = a_local.t().contiguous().to(device=device, dtype=dtype)
    b_t = (b_local * scale).t().contiguous().to(device=device, dtype=dtype)
    return a_t, b_t


class LoraTable:
    """`slots` places for adapters on `model`'s linears. Each linear of a decoder layer gets `lora_id`, its
    index here; `a[lora_id]` [slots, in, R] and `b[lora_id]` [slots, R, out] stack the slots' pairs (R the
    largest rank placed so far, zero past each slot's own and for slots whose adapter does not target the
    linear), `ranks[lora_id][slot]` the slot's own (0: not targeted)."""

    def __init__(self, model: nn.Module, slots: int):
        self.model = model
        self.slots = slots
        self.linears: list[ParallelLinear] = []
        for layer in model.layers:
            for linear in layer_linears(layer).values():
                linear.lora_id = len(self.linears)
                self.linears.append(linear)
        self.a: list[torch.Tensor | None] = [None] * len(self.linears)
        self.b: list[torch.Tensor | None] = [None] * len(self.linears)
        self.ranks: list[list[int]] = [[0] * slots for _ in self.linears]
        self.loaded_slots: list[int] = []  # the slot of each load so far (the native layers pack those since theirs)

    def load(self, slot: int, adapter: Adapter) -> None:
        """Place `adapter` in `slot` (whatever was there is dropped)."""
        grouped: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), pair in adapter.pairs.items():
            linear, part = LINEAR_OF[module]
            grouped.setdefault((layer, linear), {})[part] = pair
        dtype, device = self.model.dtype, self.model.norm.weight.device
        for i, layer in enumerate(self.model.layers):
            for name, linear in layer_linears(layer).items():
                parts = grouped.get((i, name))
                pair = linear_pair(linear, parts, adapter.scale, dtype, device) if parts else None
                self._place(linear.lora_id, slot, pair)
        self.loaded_slots.append(slot)

    @property
    def version(self) -> int:
        """Loads so far: a stack may be a new tensor after one (widened), and a slot's values change."""
        return len(self.loaded_slots)

    def _place(self, lora_id: int, slot: int, pair: Pair | None) -> None:
        """Write `pair` (None: nothing) into the stacks of linear `lora_id`, widening them to its rank."""
        rank = 0 if pair is None else pair[0].shape[1]
        self.ranks[lora_id][slot] = rank
        a, b = self.a[lora_id], self.b[lora_id]
        if pair is None and a is None:
            return
        if a is None or a.shape[2] < rank:
            a_t, b_t = pair
            wider_a = a_t.new_zeros(self.slots, a_t.shape[0], rank)
            wider_b = b_t.new_zeros(self.slots, rank, b_t.shape[1])
            if a is not None:
                wider_a[:, :, : a.shape[2]] = a
                wider_b[:, : b.shape[1]] = b
            a, b = self.a[lora_id], self.b[lora_id] = wider_a, wider_b
        a[slot].zero_()
        b[slot].zero_()
        if pair is not None:
            a[slot, :, :rank] = pair[0]
            b[slot, :rank] = pair[1]

    def step(self, slots: torch.Tensor) -> LoraStep | None:
        """The step whose token t runs the adapter in slot `slots[t]` (-1: the base model alone), or None
        when no token has one. `slots` is on the host."""
        segments = segments_of(slots)
        return LoraStep(self, segments, self.model.norm.weight.device) if segments else None
