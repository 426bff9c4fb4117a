"""model.quant=auto's measured crossing: the rule on given timings, and the measurement on the tiny model."""

from __future__ import annotations

import pytest
import torch

from kernels.wq_cpu import weight_only_kernels_fast
from pipeline.model import w8a8_crossover
from pipeline.model.attention import WholeSequence
from pipeline.model.loader import load_model
from pipeline.model.quant_choice import QuantChoice
from pipeline.model.w8a8_crossover import apply_measured_crossover, crossing, measure_crossover


@pytest.mark.parametrize("seconds,rows", [
    ({1: (1.0, 2.0), 2: (2.0, 2.5), 4: (3.0, 2.9), 8: (5.0, 3.0)}, 4),  # W8A8 wins from 4 on
    ({1: (1.0, 0.5), 2: (2.0, 1.0), 4: (3.0, 2.0)}, 1),  # everywhere
    ({1: (1.0, 2.0), 2: (2.0, 1.0), 4: (3.0, 4.0), 8: (5.0, 4.0)}, 8),  # a win at 2 alone does not count
    ({1: (1.0, 2.0), 2: (2.0, 3.0), 4: (3.0, 4.0)}, None),  # never
    ({1: (1.0, 1.05), 2: (2.0, 2.1)}, 1),  # within the margin: W8A8 throughout (one kind of step)
    ({1: (1.0, 1.2), 2: (2.0, 2.1)}, 2),  # weight-only clearly faster at 1 row only
    ({1: (1.0, 1.2)}, None),
])
def test_crossing_is_where_w8a8_is_within_the_margin_at_every_larger_size(seconds, rows):
    assert crossing(seconds) == rows


def quantized(tiny_model_dir):
    """The tiny model as auto loads a weight-only scheme to time it: both layouts, packed for CPU."""
    return load_model(tiny_model_dir, quant="int4", w8a8_rows=1, quant_lm_head="int8", prefer_speed=True).model


def test_auto_loads_the_packed_kernels_even_without_w8a8_calls(tiny_model_dir):
    """prefer_speed packs a weight-only model for torch's CPU kernels where they are fast, as W8A8 calls
    would; without it (and without W8A8 calls) float32 keeps the exact layout."""
    fast = load_model(tiny_model_dir, quant="int4", w8a8_rows=None, prefer_speed=True).model
    exact = load_model(tiny_model_dir, quant="int4", w8a8_rows=None).model
    assert (fast.layers[0].mlp.down_proj.cpu_packed is not None) == weight_only_kernels_fast()
    assert exact.layers[0].mlp.down_proj.cpu_packed is None


def test_measurement_times_both_kinds_at_every_size_and_keeps_the_model(tiny_model_dir):
    model = quantized(tiny_model_dir)
    choice = model.kernel_choice
    ids = torch.tensor([5, 9, 2])
    with torch.inference_mode():
        before = model.compute_logits(model(ids, torch.arange(3), WholeSequence(model.scale)))
    steps = dict(choice.steps)
    crossover = measure_crossover(model, 12)
    assert sorted(crossover.step_seconds) == [1, 2, 4, 8]
    assert all(wo > 0 and w8 > 0 for wo, w8 in crossover.step_seconds.values())
    assert crossover.w8a8_rows == crossing(crossover.step_seconds)
    # the model is left as it was: same kernel choice, no steps counted, same logits
    assert model.kernel_choice is choice and choice.w8a8_rows == 1 and dict(choice.steps) == steps
    with torch.inference_mode():
        assert torch.equal(model.compute_logits(model(ids, torch.arange(3), WholeSequence(model.scale))), before)
    assert "weight-only vs W8A8" in crossover.describe()


def test_apply_measured_crossover_keeps_a_roofline_crossing_beyond_the_sizes_timed(tiny_model_dir, monkeypatch):
    model = quantized(tiny_model_dir)
    roofline = QuantChoice("int4", 48, "int8", "roofline figures")
    never = {1: (1.0, 2.0), 2: (1.0, 2.0)}
    monkeypatch.setattr(w8a8_crossover, "measure_crossover",
                        lambda m, rows: w8a8_crossover.Crossover(crossing(never), never))
    assert apply_measured_crossover(roofline, model, 256)[0].w8a8_rows == 48  # W8A8 may still win past 2 rows
    assert model.kernel_choice.w8a8_rows == 48
    within = QuantChoice("int4", 2, "int8", "roofline figures")
    chosen = apply_measured_crossover(within, model, 256)[0]
    assert chosen.w8a8_rows is None  # timed at 2, and it did not win there
    assert chosen.reason.startswith("roofline figures; measured W8A8 never")


def test_w8a8_from_one_row_frees_the_weight_only_layouts(tiny_model_dir, monkeypatch):
    """Measured faster from 1 row, every step is W8A8 (as quant=w8a8): the weight-only layouts are freed and
    the model computes what it computed before, when its calls of 3 rows were W8A8 already."""
    model = quantized(tiny_model_dir)
    ids = torch.tensor([5, 9, 2])
    with torch.inference_mode():
        before = model.compute_logits(model(ids, torch.arange(3), WholeSequence(model.scale)))
    bytes_before = sum(b.numel() * b.element_size() for b in model.buffers())
    early = {1: (2.0, 1.0), 2: (2.0, 1.0)}
    monkeypatch.setattr(w8a8_crossover, "measure_crossover",
                        lambda m, rows: w8a8_crossover.Crossover(crossing(early), early))
    chosen = apply_measured_crossover(QuantChoice("int4", 6, "int8", "roofline figures"), model, 256)[0]
    assert chosen.w8a8_rows == 1 and "weight-only layouts freed" in chosen.reason
    assert model.kernel_choice.weight_only == "" and model.kernel_choice.uses_w8a8(1)
    linear = model.layers[0].mlp.down_proj
    assert linear.packed_weight is None and linear.qweight is None
    assert linear.w8a8_weight is not None or linear.w8a8_packed is not None  # the W8A8 layout, plain or packed
    assert sum(b.numel() * b.element_size() for b in model.buffers()) < bytes_before
    with torch.inference_mode():
        assert torch.equal(model.compute_logits(model(ids, torch.arange(3), WholeSequence(model.scale))), before)


def test_measurement_needs_both_layouts(tiny_model_dir):
    with pytest.raises(ValueError, match="W8A8 layouts attached"):
        measure_crossover(load_model(tiny_model_dir, quant="int4").model, 4)
