"""The low-rank deltas of one step: each linear's base output gets, for the tokens of each adapter,
x @ A^T @ B^T (scaled) added to their rows.

Why segmented, not a merged weight per adapter: the base GEMM runs once for every token of the step,
whatever its quantization, and an adapter costs only its two thin GEMMs over its own tokens, so many
fine-tunes share one batch. The runner orders a step's tokens so that the decodes of one adapter are one run
(`pipeline.engine.runner.build_batch`). Short runs (decodes, short chunks) of several adapters are
multiplied together: their tokens gathered into one [adapters, longest, in] block, two batched matmuls
against the adapters' stacked pairs, and one scatter-add, so a step of many adapters costs a handful of
operations per linear, not a pair per adapter (small matmuls are mostly call overhead on a CPU). Long runs
(prefill chunks) get a matmul pair each at their adapter's own rank.

A step binds its `LoraStep` for the length of a forward pass (`bound_lora`), as attention binds its backend;
`ParallelLinear.forward` calls `add_lora` after its base product. Outside such a step it returns the base
output untouched, so base-only steps (compiled graphs, CUDA graphs) never see it. On a CPU whose build has
the native decoder layers, a linear's deltas are one native pass over its rows (`cpu_decode_layers.lora_delta`,
where torch's gather, batched matmuls and scatter-add passed over the activations several times); the native
W8A8 decoder layers (`pipeline.model.native_decode`) add the same deltas inside their own loops (on AMX's
bfloat16 tiles where the CPU has them, else on AVX-512 BF16's dot products where it has those).

On CUDA (where Triton imports) a linear's deltas are two Triton launches for all of the step's adapters
(`kernels.triton_lora`, SGMV shrink then expand): the runs are cut into 16-row tiles of one slot once per
step (`tiles`), and each program multiplies its tile by its slot's stacked pair, so the GPU never pays a
launch per adapter nor pads runs to the longest; `apply` updates y in place, `added` on a copy.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from kernels import cpu_decode_layers
from kernels.ops import define_op

# (first token, end token, slot) of each run of consecutive tokens with the same adapter
Segment = tuple[int, int, int]

# Runs of at most this many tokens are multiplied together (batched); longer ones alone.
SHORT_RUN = 32


class Pairs(Protocol):
    """The resident pairs a step multiplies by (`pipeline.model.lora.table.LoraTable`), per linear:
    A^T stacked [slots, in, R] and B^T scaled [slots, R, out] (zero past each slot's own rank, and for a
    slot whose adapter does not target the linear), and each slot's rank (0: not targeted)."""

    a: list[torch.Tensor | None]
    b: list[torch.Tensor | None]
    ranks: list[list[int]]


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


class LoraStep:
    """One step's adapter tokens: long runs, each alone, and the short runs gathered per slot into one
    padded block (`rows` [S, L] token indices, padded with token 0); `order` picks each short-run token's
    row of the block's flattened output, in token order, to add to `tokens` (a contiguous range where the
    runner's layout makes it one: the decodes)."""

    def __init__(self, pairs: Pairs, segments: list[Segment], device: torch.device):
        self.pairs = pairs
        self.calls = 0  # linears of the forward pass so far (each one's lora_id)
        # each token's slot up to the last adapter token (-1: none), for the native kernels
        self.row_slots = torch.full((segments[-1][1] if segments else 0,), -1, dtype=torch.int64)
        for start, end, slot in segments:
            self.row_slots[start:end] = slot
        self.native = device.type == "cpu" and cpu_decode_layers.unavailable_reason() is None
        # on CUDA, the runs as the Triton kernel's row tiles (None: the torch paths below)
        self.tiles: torch.Tensor | None = None
        if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            from kernels.triton_lora import segment_tiles

            self.tiles = segment_tiles(segments, device)
        short = [s for s in segments if s[1] - s[0] <= SHORT_RUN]
        tokens: dict[int, list[int]] = {}
        for start, end, slot in short:
            tokens.setdefault(slot, []).extend(range(start, end))
        self.long = [s for s in segments if s[1] - s[0] > SHORT_RUN]
        if len(tokens) < 2:  # one adapter's short runs: as cheap alone
            self.long += short
            tokens = {}
        self.slots = sorted(tokens)
        width = max((len(t) for t in tokens.values()), default=0)
        rows = [tokens[s] + [0] * (width - len(tokens[s])) for s in self.slots]
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        at = {t: i * width + j for i, s in enumerate(self.slots) for j, t in enumerate(tokens[s])}
        ordered = sorted(at)
        self.order = torch.tensor([at[t] for t in ordered], dtype=torch.long, device=device)
        contiguous = bool(ordered) and ordered[-1] - ordered[0] + 1 == len(ordered)
        self.tokens: slice | torch.Tensor = slice(ordered[0], ordered[-1] + 1) if contiguous else \
            torch.tensor(ordered, dtype=torch.long, device=device)
        # the slots' stacked pairs: a view where the slots are consecutive, else gathered per linear
        consecutive = bool(self.slots) and self.slots[-1] - self.slots[0] + 1 == len(self.slots)
        self.slot_pick: slice | torch.Tensor = slice(self.slots[0], self.slots[-1] + 1) if consecutive else \
            torch.tensor(self.slots, dtype=torch.long, device=device)

    def added(self, lora_id: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A new tensor: y plus the step's deltas, in one native pass over the rows where it runs (float32 on
        a CPU with the native decoder layers' build), else `apply` on a copy."""
        a, b = self.pairs.a[lora_id], self.pairs.b[lora_id]
        if self.native and a is not None and x.dtype == y.dtype == a.dtype == torch.float32 and x.dim() == 2:
            return cpu_decode_layers.lora_delta(x, y, self.row_slots, a, b)
        return self.apply(lora_id, x, y.clone())

    def apply(self, lora_id: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the linear's base output [T, out], updated in place) plus the step's deltas."""
        a, b, ranks = self.pairs.a[lora_id], self.pairs.b[lora_id], self.pairs.ranks[lora_id]
        if a is None:
            return y
        if self.tiles is not None:
            from kernels.triton_lora import lora_add_

            return lora_add_(x, y, a, b, self.tiles)
        for start, end, slot in self.long:
            r = ranks[slot]
            if r:
                y[start:end].addmm_(x[start:end] @ a[slot, :, :r], b[slot, :r])
        if self.slots and any(ranks[s] for s in self.slots):
            a, b = a[self.slot_pick], b[self.slot_pick]
            delta = torch.bmm(torch.bmm(x[self.rows], a), b)  # [S, L, out]
            delta = delta.view(-1, delta.shape[-1]).index_select(0, self.order)  # the tokens' rows, in order
            if isinstance(self.tokens, slice):
                y[self.tokens] += delta
            else:  # index_put_ accumulates row by row far faster than index_add_ does on a CPU
                y.index_put_((self.tokens,), delta, accumulate=True)
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


def _delta(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    step = _bound[-1]
    lora_id = step.calls
    step.calls += 1
    return step.added(lora_id, x, y)


def _delta_shape(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return y.new_empty(y.shape)


# The bound step's deltas for the next linear of the forward pass (its `lora_id` is the count of linears
# before it: `LoraTable` numbers the layers' linears in the order a forward pass calls them), as an operator:
# compiled layer graphs call it without tracing into it, so adapter steps run compiled too.
lora_delta = define_op("lora_delta", "(Tensor x, Tensor y) -> Tensor", _delta, _delta_shape)


def add_lora(linear: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`linear`'s base output y with the bound step's deltas added (y itself outside an adapter step)."""
    if not _bound:
        return y
    return lora_delta(x, y)
