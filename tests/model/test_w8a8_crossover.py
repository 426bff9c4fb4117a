"""model.quant=auto's measured crossing: the rule on given timings, and the measurement on the tiny model."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_w4a8
from kernels.wq_cpu import pack_for_cpu, weight_only_kernels_fast
from pipeline.model import w8a8_crossover
from pipeline.model.attention import WholeSequence
from pipeline.model.loader import load_model
from pipeline.model.quant import pack_torch_int4_where_read
from pipeline.model.quant_choice import QuantChoice
from pipeline.model.w8a8_crossover import apply_measured_crossover, crossing, measure_crossover
from tests.reference import assert_only_near_ties, greedy_decode


@pytest.mark.parametrize("seconds,rows", [
    ({1: (1.0, 2.0), 2: (2.0, 2.5), 4: (3.0, 2.9), 8: (5.0, 3.0)}, 4),  # W8A8 wins from 4 on
    ({1: (1.0, 0.5), 2: (2.0, 1.0), 4: (3.0, 2.0)}, 1),  # everywhere
    ({1: (1.0, 2.0), 2: (2.0, 1.0), 4: (3.0, 4.0), 8: (5.0, 4.0)}, 8),  # a win at 2 alone does not count
    ({1: (1.0, 2.0), 2: (2.0, 3.0), 4: (3.0, 4.0)}, None),  # never
    ({1: (1.0, 1.05), 2: (2.0, 2.1)}, 1),  # within the margin: W8A8 throughout (one kind of step)
    ({1: (1.0, 1.2), 2: (2.0, 2.1)}, 2),  # weight-only clearly faster at 1 row only
    ({1: (1.0, 1.2)}, None),
    # the margin grows with the rows (10%, 20%, 30% at 1, 2, 4): a 4-row near-tie runs W8A8, not 8 rows more
    ({1: (1.0, 1.5), 2: (2.0, 2.3), 4: (3.0, 3.8), 8: (5.0, 4.0)}, 2),
    ({16: (1.0, 1.29)}, 16),  # 30% at most
    ({16: (1.0, 1.31)}, None),
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


@pytest.mark.parametrize("seconds,done", [
    ({1: (1.0, 2.0), 2: (1.5, 1.4), 4: (2.0, 1.5)}, True),  # W8A8 no slower at the last two sizes
    ({1: (1.0, 2.0), 2: (1.5, 1.4), 4: (2.0, 2.1)}, False),  # slower again at 4: go on
    ({1: (2.0, 1.0)}, False),  # one size is no trend
    ({1: (2.0, 1.0), 2: (2.0, 2.0)}, True),  # a tie counts for W8A8
])
def test_timing_stops_once_w8a8_won_at_two_sizes_in_a_row(seconds, done):
    assert w8a8_crossover.settled(seconds) == done


def test_measurement_times_both_kinds_until_settled_and_keeps_the_model(tiny_model_dir):
    model = quantized(tiny_model_dir)
    choice = model.kernel_choice
    ids = torch.tensor([5, 9, 2])
    with torch.inference_mode():
        before = model.compute_logits(model(ids, torch.arange(3), WholeSequence(model.scale)))
    steps = dict(choice.steps)
    crossover = measure_crossover(model, 12)
    sizes = sorted(crossover.step_seconds)
    assert sizes == [1, 2, 4, 8][: len(sizes)] and len(sizes) >= 2
    assert len(sizes) == 4 or w8a8_crossover.settled(crossover.step_seconds)  # stopped early only once settled
    assert all(wo > 0 and w8 > 0 for wo, w8 in crossover.step_seconds.values())
    assert crossover.w8a8_rows == crossing(crossover.step_seconds)
    # the model is left as it was: same kernel choice, no steps counted, same logits
    assert model.kernel_choice is choice and choice.w8a8_rows == 1 and dict(choice.steps) == steps
    with torch.inference_mode():
        assert torch.equal(model.compute_logits(model(ids, torch.arange(3), WholeSequence(model.scale))), before)
    assert "weight-only vs W8A8" in crossover.describe()


def test_a_step_is_estimated_from_the_distinct_layers_timed_scaled_to_the_model(tiny_model_dir, monkeypatch):
    """Only the first TIMED_LAYERS layers' products are timed (each call once), the head apart: a step is
    num_layers / TIMED_LAYERS x the layers plus the head."""
    model = quantized(tiny_model_dir)
    layers = model.config.num_layers
    assert layers >= 2
    monkeypatch.setattr(w8a8_crossover, "TIMED_LAYERS", 1)
    monkeypatch.setattr(w8a8_crossover, "alternating_best", lambda calls, rounds, reps: [1.0] * len(calls))
    crossover = measure_crossover(model, 1)
    assert crossover.step_seconds == {1: (layers * 1.0 + 1.0, layers * 1.0 + 1.0)}


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


@pytest.mark.parametrize("seconds,below", [
    ({1: (2.0, 1.0), 2: (2.0, 1.5), 4: (2.0, 2.5), 8: (3.0, 2.0)}, 4),  # faster at 1 and 2: below 4
    ({1: (2.0, 1.0), 2: (2.0, 1.0)}, 3),  # faster at every size timed
    ({1: (1.0, 2.0), 2: (2.0, 1.0)}, None),  # slower at 1 row: never
    ({}, None),  # not timed
])
def test_w4a8_runs_below_the_first_size_where_it_is_not_faster(seconds, below):
    assert w8a8_crossover.w4a8_limit(seconds) == below


def one_step_logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor([7]), torch.tensor([0]), WholeSequence(model.scale)))


def test_auto_keeps_a_w4a8_copy_of_the_int4_linears_where_the_kernel_runs(tiny_model_dir):
    """Weight-only calls below `w4a8_below` rows run the native GEMM: the linear's products are the W4A8
    arithmetic on the load's own int4 weights (the same ones torch's layout holds), counted as w4a8 steps."""
    model = quantized(tiny_model_dir)
    linear = model.layers[0].mlp.down_proj
    if cpu_w4a8.unavailable_reason() is not None:
        assert linear.w4a8_packed is None
        pytest.skip(cpu_w4a8.unavailable_reason())
    plain = load_model(tiny_model_dir, quant="int4").model.layers[0].mlp.down_proj  # the original layout
    choice = model.kernel_choice
    choice.w8a8_rows, choice.w4a8_below = 16, 4
    pack_torch_int4_where_read(model)  # 4-15 rows read torch's layout
    x = torch.randn(3, linear.in_features)
    with torch.inference_mode():
        y = linear(x)
        reference = cpu_w4a8.w4a8_reference(x, plain.qweight, plain.scales, plain.mins)
        assert torch.allclose(y, reference, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(linear(torch.cat([x, x])), reference.repeat(2, 1), rtol=1e-5, atol=1e-5)
    choice.clear()
    one_step_logits(model)
    assert choice.steps == {"w4a8": 1}


def test_torchs_int4_layout_is_made_from_the_w4a8_copy_where_a_call_reads_it(tiny_model_dir):
    """Loaded to time the switch, an int4 linear with the W4A8 copy has no torch int4 layout; once a weight-only
    call would read it (W4A8 not chosen: 1-7 rows on torch's kernel), it is made, and it is the layout torch's
    packing makes of the load's own int4 weights."""
    if cpu_w4a8.unavailable_reason() is not None:
        pytest.skip(cpu_w4a8.unavailable_reason())
    model = quantized(tiny_model_dir)
    linear = model.layers[1].mlp.down_proj
    assert linear.w4a8_packed is not None and linear.packed_weight is None
    pack_torch_int4_where_read(model)  # W8A8 from 1 row until the switch is timed: nothing reads it
    assert linear.packed_weight is None
    model.kernel_choice.w8a8_rows = 8
    pack_torch_int4_where_read(model)
    plain = load_model(tiny_model_dir, quant="int4").model.layers[1].mlp.down_proj
    expected = pack_for_cpu(plain.qweight, plain.scales, plain.mins, 4)
    assert torch.equal(linear.packed_weight, expected.weight) and torch.equal(linear.packed_scales, expected.scales)
    assert linear.packed_group == expected.group_size


def test_measurement_times_w4a8_where_the_linears_have_it(tiny_model_dir):
    model = quantized(tiny_model_dir)
    crossover = measure_crossover(model, 4)
    if cpu_w4a8.unavailable_reason() is not None:
        assert crossover.w4a8_seconds == {} and crossover.w4a8_below is None
        return
    assert sorted(crossover.w4a8_seconds) == sorted(crossover.step_seconds)  # each size timed, up to settled
    assert sorted(crossover.w4a8_seconds) == [1, 2, 4][:len(crossover.w4a8_seconds)]
    assert crossover.w4a8_below == w8a8_crossover.w4a8_limit(crossover.w4a8_seconds)
    assert "native W4A8 GEMM" in crossover.describe()
    assert w8a8_crossover.Crossover.from_json(crossover.as_json()) == crossover


@pytest.mark.parametrize("below,kept", [(None, "torch"), (2, "both"), (8, "w4a8")])
def test_the_int4_layout_no_step_runs_is_freed(tiny_model_dir, monkeypatch, below, kept):
    """W8A8 from 4 rows: W4A8 never (its copy freed), below 2 rows (both kept) or below 8 (torch's freed);
    the step's logits are those of the kernel each leaves running."""
    if cpu_w4a8.unavailable_reason() is not None:
        pytest.skip(cpu_w4a8.unavailable_reason())
    model = quantized(tiny_model_dir)
    model.kernel_choice.w8a8_rows, model.kernel_choice.w4a8_below = None, below
    pack_torch_int4_where_read(model)
    before = one_step_logits(model)
    timed = {1: (1.0, 2.0), 2: (1.0, 2.0), 4: (2.0, 1.0)}
    monkeypatch.setattr(w8a8_crossover, "measure_crossover",
                        lambda m, rows: w8a8_crossover.Crossover(crossing(timed), timed, {}, below))
    chosen = apply_measured_crossover(QuantChoice("int4", 4, "int8", "roofline"), model, 256)[0]
    assert chosen.w8a8_rows == 4 and model.kernel_choice.w4a8_below == below
    linear = model.layers[0].self_attn.o_proj
    assert (linear.w4a8_packed is not None, linear.packed_weight is not None) == {
        "torch": (False, True), "both": (True, True), "w4a8": (True, False)}[kept]
    assert ("int4 layouts no step runs freed" in chosen.reason) == (kept != "both")
    assert torch.equal(one_step_logits(model), before)


def test_without_the_kernel_auto_keeps_torchs_int4_kernel(tiny_model_dir, monkeypatch):
    """The unavailable branch at load: no W4A8 copy, nothing timed for it, weight-only steps on torch's."""
    monkeypatch.setattr(cpu_w4a8, "unavailable_reason", lambda: "no AVX-512 VNNI here")
    model = quantized(tiny_model_dir)
    assert all(m.w4a8_packed is None for m in model.modules() if hasattr(m, "w4a8_packed"))
    crossover = measure_crossover(model, 2)
    assert crossover.w4a8_seconds == {} and crossover.w4a8_below is None


def test_compiled_layers_run_w4a8_steps_as_eager_ones(tiny_model_dir):
    """The W4A8 GEMM is one operator in the compiled layer graphs: decode steps (1-3 rows, W4A8) of compiled
    layers give the eager model's tokens, up to near-ties."""
    if cpu_w4a8.unavailable_reason() is not None:
        pytest.skip(cpu_w4a8.unavailable_reason())
    eager, compiled = quantized(tiny_model_dir), quantized(tiny_model_dir)
    for model in (eager, compiled):
        model.kernel_choice.w8a8_rows, model.kernel_choice.w4a8_below = 8, 4
    compiled.compile_layers()
    prompts = [[1, 504, 3459, 314, 260, 1789, 28, 1017, 7, 42], [1, 77, 5000, 12], [5, 9, 2, 8, 800]]
    reference = dict(enumerate(greedy_decode(eager, prompts, 6)))
    compiled.kernel_choice.clear()
    assert_only_near_ties(reference, {i: d.tokens for i, d in enumerate(greedy_decode(compiled, prompts, 6))})
    assert compiled.kernel_choice.steps["w4a8"] > 0


def test_a_timed_start_loads_w8a8_from_one_row_whatever_the_roofline_says():
    """Where the crossing will be timed, the model loads with W8A8 from 1 row (the timing then sets it), so its
    startup-cache key does not follow the probe's figures; untimed, the roofline's crossing is loaded."""
    choices = [QuantChoice("int4", rows, "int8", "roofline") for rows in (None, 3, 5)]
    assert [w8a8_crossover.rows_to_load(c, timed=True) for c in choices] == [1, 1, 1]
    assert [w8a8_crossover.rows_to_load(c, timed=False) for c in choices] == [None, 3, 5]
