"""W8A8 linears and per-call kernel choice on the tiny model, against plain-torch references."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import vnni_gemm
from kernels.dispatch import w8a8_matmul, w8a8_weight_bound
from kernels.packed_int8 import pack_int8_weight, pack_native_int8_weight
from kernels.w8a8_reference import w8a8_matmul_reference
from kernels.wq_reference import quantize_int8, wq_matmul_reference
from pipeline.model import loader
from pipeline.model import quant as quant_module
from pipeline.model.calibration import LinearInput, calibrate, calibration_ids
from pipeline.model.gptq import gptq_int8
from pipeline.model.layers import LMHead
from pipeline.model.llama import cpp_compiler
from pipeline.model.loader import load_model
from pipeline.model.quant import (
    MAX_COPIES,
    KernelChoice,
    QuantLinear,
    QuantLMHead,
    attach_w8a8,
    column_absmax,
    column_copies,
    head_layout,
    smoothing_factors,
)
from tests.reference import prompt_logits

IDS = [1, 504, 3459, 314, 260, 1789, 28, 1017, 7, 42, 9000, 17]
BOUND = w8a8_weight_bound(torch.device("cpu"))  # the |int8 weight| this CPU's W8A8 layouts hold


@pytest.fixture
def plain_int8_layouts(monkeypatch):
    """Loads keep the W8A8 weights as int8 tensors (not packed for oneDNN, opaque), for tests that read them."""
    monkeypatch.setattr(loader, "choose_int8_gemm", lambda model, known=None: {})


def _logits(loaded, ids):
    return prompt_logits(loaded.model, ids)


@pytest.fixture(scope="module")
def tiny_float(tiny_model_dir):
    return load_model(tiny_model_dir)


def _measured_independently(tiny_model_dir, **load):
    """(model, what entered each linear with its Gram matrix, final hidden maxima): a model loaded without
    W8A8 calls and the calibration text run through it, its products as the load's pass takes them (on the
    dequantized weights, in `product_dtype`: checked against float32 products below)."""
    loaded = load_model(tiny_model_dir, **load)
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    inputs = {}
    final = calibrate(loaded.model, calibration_ids(loaded.tokenizer), linears, inputs.__setitem__, grams=True,
                      weights=QuantLinear.dequantize)
    return loaded.model, inputs, final


def test_calibration_pass_products_keep_the_float32_passs_ranges(tiny_model_dir):
    """The load's pass (products on each weight dequantized once, bfloat16 where the CPU has it) sees the
    ranges the model's own float32 forward does: the first linear's input exactly (nothing multiplied before
    it), every other within 2% of the largest range, and the final maxima likewise; each visit gets the
    weight its product used."""
    loaded = load_model(tiny_model_dir, quant="int4")
    model, ids = loaded.model, calibration_ids(loaded.tokenizer)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    exact, fast = {}, {}
    exact_final = calibrate(model, ids, linears, exact.__setitem__)

    def keep(m: QuantLinear, seen: LinearInput) -> None:  # the visit's weight is in a buffer the next one reuses
        fast[m] = replace(seen, weight=seen.weight.clone())

    fast_final = calibrate(model, ids, linears, keep, weights=QuantLinear.dequantize)
    first = model.layers[0].self_attn.qkv_proj
    x = model.layers[0].input_layernorm(model.embed_tokens(torch.tensor(ids)))
    assert torch.equal(fast[first].absmax, x.abs().amax(0)) and torch.equal(exact[first].absmax, fast[first].absmax)
    for m in linears:
        assert exact[m].weight is None and torch.equal(fast[m].weight, m.dequantize())
        torch.testing.assert_close(fast[m].absmax, exact[m].absmax, rtol=0, atol=0.02 * exact[m].absmax.max().item())
    torch.testing.assert_close(fast_final, exact_final, rtol=0, atol=0.02 * exact_final.max().item())


def _expected_roundings(tiny_model_dir, module_path: str, bound: int, **load):
    """(smoothing factors, nearest, gptq) for one linear's W8A8 layout within `bound`: `smoothing_factors`
    of the ranges seen and the linear's weight, then the smoothed weight rounded to nearest and by
    `gptq_int8` against the smoothed inputs' Gram matrix, each as (int8 weight, scales)."""
    plain, inputs, _ = _measured_independently(tiny_model_dir, **load)
    lin = plain.get_submodule(module_path)
    seen, weight = inputs[lin], lin.dequantize()
    smooth = smoothing_factors(seen.absmax, weight)
    nearest = quantize_int8(weight * smooth, bound=bound)
    return smooth, nearest, gptq_int8(weight * smooth, seen.gram / torch.outer(smooth, smooth), bound)


def _calibrated_layout(tiny_model_dir, module_path: str, **load):
    """(smoothing factors, int8 weight, scales) the layout should have on this CPU: rounded to nearest at
    8 bits, by GPTQ at 7 (`BOUND` 63)."""
    smooth, nearest, gptq = _expected_roundings(tiny_model_dir, module_path, BOUND, **load)
    return smooth, *(nearest if BOUND == 127 else gptq)


def test_w8a8_linear_equals_reference_from_float_weight_smoothed_and_rounded_against_its_inputs(tiny_model_dir):
    q = load_model(tiny_model_dir, quant="w8a8")
    lin = q.model.layers[1].mlp.down_proj
    assert isinstance(lin, QuantLinear) and lin.choice.uses_w8a8(1)
    assert lin.qweight is None  # quant=w8a8: the smoothed layout replaced the original
    assert lin(torch.randn(0, lin.in_features)).shape == (0, lin.out_features)  # no rows: still W8A8
    # float weight -> int8 per channel (the load, as quant=int8's) -> smoothed and rounded (the calibration)
    smooth, qweight, scales = _calibrated_layout(tiny_model_dir, "layers.1.mlp.down_proj", quant="int8")
    x = torch.randn(7, lin.in_features)
    expected = w8a8_matmul_reference(x / smooth, qweight, scales)
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("bound", [63, 127])
def test_7_bit_weights_are_gptq_rounded_against_the_calibration_8_bit_ones_to_nearest(
        tiny_model_dir, plain_int8_layouts, monkeypatch, bound):
    monkeypatch.setattr(quant_module, "w8a8_weight_bound", lambda device: bound)  # without VNNI: 63, whatever this CPU
    lin = load_model(tiny_model_dir, quant="w8a8").model.layers[0].mlp.gate_up_proj
    _, nearest, gptq = _expected_roundings(tiny_model_dir, "layers.0.mlp.gate_up_proj", bound, quant="int8")
    assert not torch.equal(gptq[0], nearest[0])
    q, scales = gptq if bound < 127 else nearest
    assert torch.equal(lin.w8a8_weight, q) and torch.equal(lin.w8a8_scales, scales)


def test_smoothing_factors_balance_activation_and_weight_ranges():
    weight = torch.tensor([[1.0, -8.0, 0.5], [-2.0, 2.0, 0.25]])
    absmax = torch.tensor([4.0, 2.0, 0.0])
    s = smoothing_factors(absmax, weight)
    # alpha 0.5: s = sqrt(max|x| / max|w|), so both become sqrt(max|x| * max|w|); zero ranges stay finite
    torch.testing.assert_close(s[:2], torch.tensor([(4 / 2) ** 0.5, (2 / 8) ** 0.5]))
    torch.testing.assert_close(absmax[:2] / s[:2], weight.abs().amax(0)[:2] * s[:2])
    assert torch.isfinite(s).all() and (s > 0).all()


@pytest.mark.parametrize("rows", [64, 96, 33, 1])
def test_column_absmax_is_the_largest_magnitude_of_each_column_in_blocks_or_not(rows):
    weight = torch.randn(rows, 48)
    weight[rows // 2, 5] = -50.0  # a negative outlier counts by its magnitude
    assert torch.equal(column_absmax(weight), weight.abs().amax(0))
    assert torch.equal(column_absmax(weight.bfloat16()), weight.bfloat16().abs().amax(0))


def test_smoothing_moves_an_outlier_channel_out_of_the_int8_step():
    torch.manual_seed(0)
    weight = torch.randn(256, 64)
    x = torch.randn(16, 64)
    x[:, 3] *= 50
    s = smoothing_factors(x.abs().amax(0), weight)
    exact = x @ weight.T
    plain = w8a8_matmul_reference(x, *quantize_int8(weight))
    smoothed = w8a8_matmul_reference(x / s, *quantize_int8(weight * s))
    assert (smoothed - exact).norm() < (plain - exact).norm() / 2


@pytest.mark.parametrize("lm_head", ["int8", "bf16", "none"])
def test_w8a8_tiny_model_close_to_float(tiny_model_dir, tiny_float, lm_head):
    ref = _logits(tiny_float, IDS)
    q = load_model(tiny_model_dir, quant="w8a8", quant_lm_head=lm_head)
    assert isinstance(q.model.lm_head, QuantLMHead) == (lm_head != "none")
    assert torch.equal(q.model.lm_head.weight, tiny_float.model.lm_head.weight)  # the float head is kept
    out = _logits(q, IDS)
    assert (out - ref).norm() / ref.norm() < 0.05  # int8 alone (quant=int8, weights only) stays under 0.02
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    assert q.model.kernel_choice.steps == {"w8a8": 1}


def test_weight_only_switches_to_w8a8_from_a_batch_size(tiny_model_dir):
    exact = load_model(tiny_model_dir, quant="int4", quant_group_size=32).model.layers[0].self_attn.qkv_proj
    q = load_model(tiny_model_dir, quant="int4", quant_group_size=32, w8a8_rows=4)
    lin = q.model.layers[0].self_attn.qkv_proj
    small, large = torch.randn(3, lin.in_features), torch.randn(4, lin.in_features)
    ref_small = wq_matmul_reference(small, exact.qweight, exact.scales, exact.mins, 4)
    # Packed for torch's CPU kernels where bf16 is native: bfloat16 activations, else the exact path.
    tol = 2**-7 if lin.cpu_packed is not None else 1e-6
    torch.testing.assert_close(lin(small), ref_small, rtol=tol, atol=tol * ref_small.abs().max().item())
    smooth, qweight, scales = _calibrated_layout(tiny_model_dir, "layers.0.self_attn.qkv_proj", quant="int4",
                                                 quant_group_size=32)
    expected = w8a8_matmul_reference(large / smooth, qweight, scales)
    torch.testing.assert_close(lin(large), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    _logits(q, IDS)  # 12 rows: W8A8
    _logits(q, IDS[:2])  # 2 rows: weight-only
    assert q.model.kernel_choice.steps == {"w8a8": 1, "int4": 1}
    assert isinstance(q.model.lm_head, QuantLMHead)


def test_auto_runs_the_compact_lm_head_below_the_switch_too(tiny_model_dir):
    """Under prefer_speed (model.quant=auto) the LM head takes its int8 copy at every row count while the
    linears stay weight-only below the switch; a named scheme keeps the float head there."""
    hidden = torch.randn(2, load_model(tiny_model_dir).config.hidden_size)
    for speed in (True, False):
        q = load_model(tiny_model_dir, quant="int4", w8a8_rows=4, quant_lm_head="int8", prefer_speed=speed).model
        head, choice = q.lm_head, q.kernel_choice
        assert choice.head_rows == (1 if speed else None) and not choice.uses_w8a8(2)
        float_logits = hidden @ head.weight.T
        int8_logits = w8a8_matmul(head._int8_input(hidden), *head.int8_layout[:2], head.int8_layout[2]).float()
        expected = int8_logits if speed else float_logits
        torch.testing.assert_close(head(hidden), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        assert torch.equal(head.greedy(hidden), expected.argmax(-1))


def test_uncalibrated_int8_w8a8_layout_shares_the_weight_where_it_fits_the_bound(tiny_model_dir, plain_int8_layouts):
    q = load_model(tiny_model_dir, quant="int8")
    attach_w8a8(q.model, "int8", 16, "none")  # no calibration ids (as under tensor parallelism): no smoothing
    lin = q.model.layers[0].mlp.gate_up_proj
    assert lin.w8a8_smooth is None
    if BOUND == 127:
        assert lin.w8a8_weight.data_ptr() == lin.qweight.data_ptr()
    else:  # requantized within this CPU's bound, from the int8 weight's values
        assert int(lin.w8a8_weight.abs().max()) == BOUND
        assert torch.equal(lin.w8a8_weight, quantize_int8(lin.dequantize(), bound=BOUND)[0])
    calibrated = load_model(tiny_model_dir, quant="int8", w8a8_rows=16).model.layers[0].mlp.gate_up_proj
    assert calibrated.w8a8_smooth is not None and not torch.equal(calibrated.w8a8_weight, lin.w8a8_weight)


def test_bf16_lm_head_matches_bfloat16_matmul(tiny_model_dir):
    q = load_model(tiny_model_dir, quant="w8a8", quant_lm_head="bf16")
    h = torch.randn(5, q.config.hidden_size)
    w = q.model.lm_head.weight
    expected = (h.bfloat16().float() @ w.bfloat16().float().T)
    torch.testing.assert_close(q.model.lm_head(h), expected, rtol=2**-7, atol=1e-2)


def test_without_w8a8_rows_nothing_changes(tiny_model_dir):
    q = load_model(tiny_model_dir, quant="int8")
    assert type(q.model.lm_head) is LMHead and q.model.layers[0].mlp.down_proj.w8a8_weight is None
    _logits(q, IDS)
    assert q.model.kernel_choice.steps == {"int8": 1}


def test_bad_w8a8_rows(tiny_model_dir):
    q = load_model(tiny_model_dir, quant="int8")
    with pytest.raises(ValueError, match="w8a8_rows must be >= 1"):
        attach_w8a8(q.model, "int8", 0, lm_head="none")
    with pytest.raises(ValueError, match="quant_lm_head='fp8'"):
        attach_w8a8(q.model, "int8", 4, lm_head="fp8")


def test_column_copies_split_only_the_outlier_channels():
    absmax = torch.tensor([1.0, 60.0, 2.0, 9.5, 3.0, 0.5, 10.0, 2.5])
    copies = column_copies(absmax, outliers=3)
    # the 3 largest (60, 10, 9.5) over the 4th (3.0): 20 capped, ceil(3.3), ceil(3.2); the rest one
    assert MAX_COPIES < 20
    assert copies.tolist() == [1, MAX_COPIES, 1, 4, 1, 1, 4, 1]
    assert column_copies(torch.full((8,), 2.0), outliers=3).tolist() == [1] * 8  # nothing stands out
    assert column_copies(torch.zeros(8), outliers=3).tolist() == [1] * 8
    assert column_copies(absmax, outliers=8).tolist() == [1] * 8  # no channel left to compare with


def test_split_int8_head_is_the_w8a8_product_of_the_split_columns_and_beats_plain_int8():
    torch.manual_seed(0)
    vocab, hidden = 512, 64
    head = LMHead(vocab, hidden)
    head.weight.data.normal_()
    x = torch.randn(16, hidden)
    x[:, 5] *= 40  # outlier channels, as a final hidden state has them
    x[:, 9] *= 25
    copies = column_copies(x.abs().amax(0), outliers=4)
    split = QuantLMHead(head, KernelChoice("", 1), "int8", copies)
    plain = QuantLMHead(head, KernelChoice("", 1), "int8")
    columns = torch.repeat_interleave(torch.arange(hidden), copies)
    q, s = quantize_int8(head.weight.data, bound=BOUND)
    expected = w8a8_matmul_reference(x[:, columns] / copies[columns], q[:, columns], s)
    torch.testing.assert_close(split(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # the activations' share of the error: against the int8 weights with float activations
    exact = x @ (q.float() * s).T
    split_err, plain_err = (split(x) - exact).norm(), (plain(x) - exact).norm()
    assert split_err < plain_err / 3


def test_smoothed_int8_head_is_the_w8a8_product_of_the_smoothed_split_columns():
    """`head_layout`'s smoothing: input channel j divided by s_j and weight column j multiplied by it before
    the per-row int8 rounding, then the outliers left split; the logits are that W8A8 product, closer to the
    float head's, in fewer columns, than splitting as many channels without smoothing."""
    g = torch.Generator().manual_seed(1)
    vocab, hidden = 512, 64
    head = LMHead(vocab, hidden)
    head.weight.data.normal_(generator=g)
    x = torch.randn(32, hidden, generator=g)
    for channel, factor in ((5, 40), (9, 25), (17, 12), (30, 8), (41, 6)):  # outlier channels
        x[:, channel] *= factor
    absmax = x.abs().amax(0)
    smooth, copies = head_layout(absmax, head.weight.data)
    assert not torch.equal(smooth, torch.ones(hidden))
    smoothed = QuantLMHead(head, KernelChoice("", 1), "int8", copies, smooth)
    columns = torch.repeat_interleave(torch.arange(hidden), copies)
    q, s = quantize_int8(head.weight.data * smooth, bound=BOUND)
    expected = w8a8_matmul_reference((x / smooth)[:, columns] / copies[columns], q[:, columns], s)
    torch.testing.assert_close(smoothed(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    split_only = QuantLMHead(head, KernelChoice("", 1), "int8", column_copies(absmax))
    exact = x @ head.weight.data.T
    assert (smoothed(x) - exact).norm() < (split_only(x) - exact).norm()
    assert smoothed.in_features < split_only.in_features


def _pack_head(head: QuantLMHead, gemm: str) -> None:
    """Put the int8 head on `gemm`: "int_mm" (its plain int8 weight), "onednn" or "native" (packed)."""
    if gemm == "native" and vnni_gemm.unavailable_reason():
        pytest.skip(f"no native int8 GEMM here: {vnni_gemm.unavailable_reason()}")
    pack = {"onednn": pack_int8_weight, "native": pack_native_int8_weight}.get(gemm)
    if pack is not None:
        head.use_packed_int8(pack(head, head.fast_weight))


@pytest.mark.parametrize("gemm", ["int_mm", "onednn", "native"])
@pytest.mark.parametrize("vocab,split,compiled", [
    (49152, True, False),  # whole chunks, outlier channels split
    (49152, False, True),  # the compiled head, as the engine runs it
    (5000, True, False),  # a ragged tail past the last whole chunk
    (1500, False, False),  # under two chunks: the plain argmax of the logits
])
def test_int8_head_greedy_is_the_argmax_of_its_logits(vocab, split, compiled, gemm):
    """`greedy` never writes the int8 head's logits (the native GEMM keeps each row's best column in its own
    pass; the others take chunk maxima from the GEMM's outputs); the tokens are the logits' argmax all the
    same, ties (two equal weight rows: the first id) included."""
    if compiled and cpp_compiler() is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    g = torch.Generator().manual_seed(vocab)
    hidden = 64
    head = LMHead(vocab, hidden)
    head.weight.data.normal_(generator=g)
    x = torch.randn(12, hidden, generator=g)
    x[:, 5] *= 30
    head.weight.data[vocab - 3] = head.weight.data[700]  # equal logits in two chunks (or chunk and tail)
    head.weight.data[701] = head.weight.data[702]  # and inside one chunk
    x[0] = head.weight.data[700] * 4
    x[1] = head.weight.data[701] * 4
    copies = column_copies(x.abs().amax(0), outliers=4) if split else None
    q = QuantLMHead(head, KernelChoice("", 1), "int8", copies)
    _pack_head(q, gemm)
    if compiled:
        q.compile(dynamic=True)
    logits = q(x)
    assert logits.argmax(-1)[:2].tolist() == [700, 701]  # the planted ties are the rows' maxima
    assert torch.equal(q.greedy(x), logits.argmax(-1))


@pytest.mark.parametrize("gemm", ["onednn", "native"])
def test_int8_head_greedy_of_a_non_finite_row_is_still_the_logits_argmax(gemm):
    """A row with inf or NaN makes NaN logits, where torch's argmax picks the first NaN: the fused paths
    stand aside for such a step, and its finite rows get their tokens all the same."""
    g = torch.Generator().manual_seed(3)
    head = LMHead(4096, 32)
    head.weight.data.normal_(generator=g)
    q = QuantLMHead(head, KernelChoice("", 1), "int8")
    _pack_head(q, gemm)
    x = torch.randn(5, 32, generator=g)
    x[1, 3], x[3, 0] = float("nan"), float("inf")
    logits = q(x)
    assert logits[1].isnan().any() and logits[3].isnan().any()
    assert torch.equal(q.greedy(x), logits.argmax(-1))


def test_engine_greedy_steps_skip_the_logits_and_emit_the_same_tokens(tiny_model_dir, monkeypatch):
    """Steps where every row is plain greedy take the runner's argmaxes (the int8 head's fused path); the
    same requests asking for logprobs, which need the logits, emit the same tokens."""
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.engine import Engine
    from pipeline.engine.request import Request, SamplingParams

    loaded = load_model(tiny_model_dir, quant="w8a8", quant_lm_head="int8")
    fused = []
    greedy = QuantLMHead.greedy
    monkeypatch.setattr(QuantLMHead, "greedy", lambda head, hidden: fused.append(len(hidden)) or greedy(head, hidden))
    prompts = [[1 + (7 * i + j) % 900 for j in range(5 + i)] for i in range(6)]
    outputs = {}
    for logprobs in (0, 1):
        engine = Engine(loaded, EngineConfig(kv_cache_memory="16MiB"))
        sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=logprobs)
        outputs[logprobs] = {r.id: r.token_ids for r in engine.generate(Request(i, p, sp) for i, p in enumerate(prompts))}
        assert bool(fused) == (logprobs == 0)
        fused.clear()
    assert outputs[0] == outputs[1]


def test_calibration_gives_the_same_layouts_every_load_and_splits_the_measured_head_channels(tiny_model_dir,
                                                                                          plain_int8_layouts):
    first = load_model(tiny_model_dir, quant="int4", w8a8_rows=4).model
    second = load_model(tiny_model_dir, quant="int4", w8a8_rows=4).model
    a, b = first.layers[1].mlp.down_proj, second.layers[1].mlp.down_proj
    assert torch.equal(a.w8a8_weight, b.w8a8_weight) and torch.equal(a.w8a8_smooth, b.w8a8_smooth)
    assert torch.equal(first.lm_head.columns, second.lm_head.columns)
    _, _, final = _measured_independently(tiny_model_dir, quant="int4")
    _, copies = head_layout(final, first.lm_head.weight.data)
    assert torch.equal(first.lm_head.columns, torch.repeat_interleave(torch.arange(copies.numel()), copies))
    assert first.lm_head.columns.numel() > first.config.hidden_size  # the tiny model has outliers to split
