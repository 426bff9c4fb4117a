"""A step's LoRA deltas against a plain per-token reference (y[t] += x[t] @ A_s^T @ B_s^T at slot s's own
rank), for token layouts that take every path: long runs alone, short runs of several adapters batched
(slots consecutive or not, tokens contiguous or not), slots whose adapter does not target the linear."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import cpu_decode_layers
from pipeline.model.lora.delta import SHORT_RUN, LoraStep, segments_of

SLOTS, IN, OUT, R = 4, 24, 40, 8


def pairs(ranks: list[int], seed: int = 0, features: tuple[int, int] = (IN, OUT)) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    width = max(ranks)
    a = torch.zeros(SLOTS, features[0], width)
    b = torch.zeros(SLOTS, width, features[1])
    for slot, r in enumerate(ranks):
        a[slot, :, :r] = torch.randn(features[0], r, generator=gen)
        b[slot, :r] = torch.randn(r, features[1], generator=gen)
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


@pytest.fixture(params=["native pass", "torch ops"])
def native(request, monkeypatch) -> bool:
    """Where the native pass is not built, a step's deltas are torch's operations (`apply` on a copy)."""
    if request.param == "native pass":
        if cpu_decode_layers.unavailable_reason():
            pytest.skip(f"no native decode layers here: {cpu_decode_layers.unavailable_reason()}")
        return True
    monkeypatch.setattr(cpu_decode_layers, "unavailable_reason", lambda: "not built")
    return False


@pytest.mark.parametrize("layout", LAYOUTS)
def test_added_deltas_are_a_new_tensor_of_the_reference(layout, native):
    slots = LAYOUTS[layout]
    p = pairs([8, 0, 5, 2])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(len(slots), IN, generator=gen), torch.randn(len(slots), OUT, generator=gen)
    before = y.clone()
    step = LoraStep(p, segments_of(torch.tensor(slots)), torch.device("cpu"))
    assert step.native == native
    got = step.added(0, x, y)
    assert torch.equal(y, before)
    torch.testing.assert_close(got, reference(p, slots, x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [[64, 16, 0, 64], [8, 8, 3, 8]])
def test_added_deltas_of_many_rows_split_between_threads(ranks, native):
    """80 rows of wide linears (widths off the vectors' 16 lanes) at ranks up to 64: enough work that the
    native pass splits the rows between two threads."""
    slots = [s for s in (0, 1, -1, 3, 2) for _ in range(16)]
    p = pairs(ranks, features=(200, 300))
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(len(slots), 200, generator=gen), torch.randn(len(slots), 300, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = LoraStep(p, segments_of(torch.tensor(slots)), torch.device("cpu")).added(0, x, y)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, reference(p, slots, x, y), rtol=1e-4, atol=1e-4)
