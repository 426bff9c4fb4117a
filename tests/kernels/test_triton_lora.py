"""Triton segmented LoRA deltas under TRITON_INTERPRET=1 on CPU against the per-token torch reference:
several slots with base-model tokens between them, a slot whose adapter does not target the linear (rank 0,
zero pair), ranks 8 and 64, in/out features not multiples of the blocks, T = 1 and 70, float32 and bfloat16,
split-K shrink, and `LoraStep.apply`/`added` routed to the kernel. Shapes are small: the interpreter costs
about a millisecond per program."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
import kernels.triton_lora as tlr  # noqa: E402
from pipeline.model.lora.delta import LoraStep, segments_of  # noqa: E402

if type(tlr._shrink_kernel).__name__ != "InterpretedFunction":  # imported earlier without the interpreter
    tlr = importlib.reload(tlr)

IN, OUT = 97, 70  # 2 shrink steps and 2 expand column blocks, the last of each partial
CPU = torch.device("cpu")

LAYOUTS = {
    "one decode": [2],
    "decodes of three slots and base tokens": [0, -1, 2, 2, 1, 3, -1, 0],
    "T=70: chunks longer than a tile, a rank-0 slot and base tokens": [
        *[3] * 21, -1, -1, *[0] * 17, 1, 1, 2, *[1] * 5, -1, *[2] * 20, 0,
    ],
}


def stacks(ranks: list[int], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A^T [slots, IN, R] and B^T [slots, R, OUT], zero past each slot's rank (R = the largest)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(ranks)
    a = torch.zeros(len(ranks), IN, width)
    b = torch.zeros(len(ranks), width, OUT)
    for slot, r in enumerate(ranks):
        a[slot, :, :r] = torch.randn(IN, r, generator=gen) / IN**0.5
        b[slot, :r] = torch.randn(r, OUT, generator=gen) / r**0.5
    return a.to(dtype), b.to(dtype)


def activations(t: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, IN, generator=gen).to(dtype), torch.randn(t, OUT, generator=gen).to(dtype)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    eps = {torch.float32: 1e-6, torch.bfloat16: 2**-8}[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert (out.float() - ref.float()).abs().max().item() <= 4 * eps * max(1.0, ref.float().abs().max().item())


def ranks_for(rank: int) -> list[int]:
    """Four slots: two at the full rank, one lower, slot 1 not targeting the linear."""
    return [rank, 0, rank // 2 + 1, rank]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rank", [8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_deltas_match_per_token_reference(layout, rank, dtype):
    slots = LAYOUTS[layout]
    a, b = stacks(ranks_for(rank), dtype)
    x, y = activations(len(slots), dtype)
    tiles = tlr.segment_tiles(segments_of(torch.tensor(slots)), CPU)
    out = tlr.lora_add_(x, y.clone(), a, b, tiles)
    assert_matches(out, tlr.lora_delta_reference(x, y, a, b, slots))


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_partials_add_up(split_k):
    """Shrink's input axis over several programs (an uneven share included), partials added atomically."""
    slots = LAYOUTS["decodes of three slots and base tokens"]
    a, b = stacks(ranks_for(8), torch.float32)
    x, y = activations(len(slots), torch.float32)
    tiles = tlr.segment_tiles(segments_of(torch.tensor(slots)), CPU)
    out = tlr.lora_add_(x, y.clone(), a, b, tiles, split_k=split_k)
    assert_matches(out, tlr.lora_delta_reference(x, y, a, b, slots))


def test_tiles_cut_runs_at_block_rows():
    tiles = tlr.segment_tiles([(0, 1, 2), (3, 3 + 2 * tlr.BLOCK_M + 1, 0)], CPU)
    m = tlr.BLOCK_M
    assert tiles.tolist() == [[0, 3, 3 + m, 3 + 2 * m], [1, 3 + m, 3 + 2 * m, 4 + 2 * m], [2, 0, 0, 0]]
    assert tlr.segment_tiles([], CPU).shape == (3, 0)


def test_lora_step_routes_to_the_kernel():
    """A step given tiles (as on CUDA) adds through the kernel: `apply` in place, `added` on a copy."""
    slots = LAYOUTS["decodes of three slots and base tokens"]
    ranks = ranks_for(8)
    a, b = stacks(ranks, torch.float32)
    x, y = activations(len(slots), torch.float32)
    segments = segments_of(torch.tensor(slots))
    step = LoraStep(SimpleNamespace(a=[a], b=[b], ranks=[ranks]), segments, CPU)
    step.native = False  # the CPU's native pass would take `added` first
    step.tiles = tlr.segment_tiles(segments, CPU)
    ref = tlr.lora_delta_reference(x, y, a, b, slots)
    before = y.clone()
    assert_matches(step.added(0, x, y), ref)
    assert torch.equal(y, before)
    assert step.apply(0, x, y) is y
    assert_matches(y, ref)


def test_mismatched_pairs_are_an_error():
    a, b = stacks(ranks_for(8), torch.float32)
    x, y = activations(2, torch.float32)
    tiles = tlr.segment_tiles([(0, 2, 0)], CPU)
    with pytest.raises(ValueError, match="do not fit"):
        tlr.lora_add_(x[:, :64], y, a, b, tiles)
    with pytest.raises(ValueError, match="share a dtype"):
        tlr.lora_add_(x.bfloat16(), y, a, b, tiles)
