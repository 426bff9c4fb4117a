"""The low-rank deltas of one step: each linear's base output gets, for every run of tokens that share an
adapter, x[run] @ A^T @ B^T (scaled) added to the run's rows.

Why segmented, not a merged weight per adapter: the base GEMM runs once for every token of the step,
whatever its quantization, and an adapter costs only its two thin GEMMs over its own tokens, so many
fine-tunes share one batch. The runner orders a step's tokens so that the decodes of one adapter are one
run (`pipeline.engine.runner.build_batch`).

A step binds its `LoraStep` for the length of a forward pass (`bound_lora`), as attention binds its backend;
`ParallelLinear.forward` calls `add_lora` after its base product. Outside such a step it returns the base
output untouched, so base-only steps (compiled graphs, CUDA graphs, the native decoder layers) never see it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

# (first token, end token, slot) of each run of consecutive tokens with the same adapter
Segment = tuple[int, int, int]


def segments_of(slots: torch.Tensor) -> list[Segment]:
    """Runs of equal slot values in `slots` [T] (a host tensor; -1 = no adapter), those with an adapter."""
    values = slots.tolist()
    out: list[Segment] = []
    start = 0
    for t in range(1, len(values) + 1):
        if t == len(values) or values[t] != values[start]:
            if values[start] >= 0:
                out.append((start, t, values[start]))
            start = t
    return out


@dataclass
class LoraStep:
    """One step's runs of adapter tokens and the resident pairs (`LoraTable.pairs`) they multiply by."""

    pairs: list[list[tuple[torch.Tensor, torch.Tensor] | None]]
    segments: list[Segment]

    def apply(self, lora_id: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the linear's base output [T, out], updated in place) plus each run's delta."""
        row = self.pairs[lora_id]
        for start, end, slot in self.segments:
            pair = row[slot]
            if pair is not None:
                a_t, b_t = pair
                y[start:end].addmm_(x[start:end] @ a_t, b_t)
        return y


_bound: list[LoraStep] = []


@contextmanager
def bound_lora(step: LoraStep | None) -> Iterator[None]:
    """Apply `step`'s deltas in the linears while the block runs (None: nothing to apply)."""
    if step is None:
        yield
        return
    _bound.append(step)
    try:
        yield
    finally:
        _bound.pop()


def add_lora(linear: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`linear`'s base output y with the bound step's deltas added (y itself when none applies)."""
    if not _bound:
        return y
    lora_id = getattr(linear, "lora_id", None)
    return y if lora_id is None else _bound[-1].apply(lora_id, x, y)
