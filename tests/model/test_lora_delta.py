"""A step's LoRA deltas against a plain per-token reference (y[t] += x[t] @ A_s^T @ B_s^T at slot s's own
rank), for token layouts that take every path: long runs alone, short runs of several adapters batched
(slots consecutive or not, tokens contiguous or not), slots whose adapter does not target the linear."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.model.lora.delta import SHORT_RUN, LoraStep, segments_of

SLOTS, IN, OUT, R = 4, 24, 40, 8


def pairs(ranks: list[int], seed: int = 0) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    a = torch.zeros(SLOTS, IN, R)
    b = torch.zeros(SLOTS, R, OUT)
    for slot, r in enumerate(ranks):
        a[slot, :, :r] = torch.randn(IN, r, generator=gen)
        b[slot, :r] = torch.randn(r, OUT, generator=gen)
    return SimpleNamespace(a=[a], b=[b], ranks=[ranks])


def reference(p, slots: list[int], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = y.clone()
    for t, s in enumerate(slots):
        r = p.ranks[0][s] if s >= 0 else 0
        if r:
            out[t] += x[t] @ p.a[0][s, :, :r] @ p.b[0][s, :r]
    return out


LAYOUTS = {
    "decodes of consecutive slots": [0, 0, 1, 1, 1, 2, -1, -1],
    "decodes of slots 0 and 3, then short chunks": [-1, 0, 0, 3, 3, 3, 0, 0, 3, 3, 3],
    "one adapter": [1, 1, 1, -1, 1, 1],
    "long chunks and decodes": [0, 2, 3, *[2] * (SHORT_RUN + 5), *[0] * (SHORT_RUN + 1), -1, 1, 1],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ranks", [[8, 3, 5, 8], [8, 0, 5, 2]])  # slot 1 not targeting the linear
def test_step_deltas_match_per_token_reference(layout, ranks):
    slots = LAYOUTS[layout]
    p = pairs(ranks)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(len(slots), IN, generator=gen), torch.randn(len(slots), OUT, generator=gen)
    step = LoraStep(p, segments_of(torch.tensor(slots)), torch.device("cpu"))
    expected = reference(p, slots, x, y)
    torch.testing.assert_close(step.apply(0, x, y.clone()), expected, rtol=1e-5, atol=1e-5)


def test_segments_skip_the_base_model_tokens():
    assert segments_of(torch.tensor([-1, 2, 2, -1, 0, 0, 0, 2])) == [(1, 3, 2), (4, 7, 0), (7, 8, 2)]
