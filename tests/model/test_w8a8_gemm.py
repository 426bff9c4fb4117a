"""The int8 GEMM chosen per part at load (`pipeline.model.w8a8_gemm`): the choice follows the timings and
never changes a logit."""

from __future__ import annotations

import re

import pytest
import torch

from kernels import packed_int8, vnni_gemm
from kernels.packed_int8 import packed_gemm_name
from pipeline.model import w8a8_gemm
from pipeline.model.cpu_kernels import CpuFeatures, int8_gemm_rule
from pipeline.model.llama import cpp_compiler
from pipeline.model.loader import load_model
from pipeline.model.w8a8_gemm import NATIVE, PACKED, PLAIN, int8_parts
from tests.model.gemm_script import NATIVE_OFF, script_gemm_choice, stand_in_for_amx
from tests.reference import greedy_decode, prompt_logits

IDS = [1, 504, 3459, 314, 260, 1789, 28, 1017, 7, 42, 9000, 17]
PROMPTS = [IDS, IDS[:5], [1, 77, 5000, 12, 900, 33, 2, 8]]


def _load(tiny_model_dir, **load):
    return load_model(tiny_model_dir, quant="w8a8", quant_lm_head="int8", **load)


@pytest.mark.parametrize("winners", [{"layers": PACKED, "lm_head": PACKED}, {"layers": PACKED, "lm_head": PLAIN},
                                     {"layers": PLAIN, "lm_head": PACKED}, {"layers": PLAIN, "lm_head": PLAIN},
                                     {"layers": NATIVE, "lm_head": PACKED}, {"layers": PLAIN, "lm_head": NATIVE}])
def test_each_part_keeps_the_fastest_gemm_and_the_logits_stay_bit_for_bit(tiny_model_dir, monkeypatch, winners):
    script_gemm_choice(monkeypatch, {"layers": PLAIN, "lm_head": PLAIN})
    plain = _load(tiny_model_dir)
    assert all(m.int8_layout[2] is None for part in int8_parts(plain.model).values() for m in part)
    native = NATIVE in winners.values()
    script_gemm_choice(monkeypatch, winners, native=native)
    monkeypatch.setattr(w8a8_gemm, "TIMED_LAYERS", 1)  # of the tiny model's 2: the other is packed untimed
    before = set(packed_int8._packed)
    loaded = _load(tiny_model_dir)
    chosen = loaded.model.kernel_choice.int8_gemm
    assert list(chosen) == ["layers", "lm_head"]
    linears = len(int8_parts(loaded.model)["layers"])
    assert f"for {linears // 2} of its {linears} weights" in chosen["layers"] and "for 1 of its 1" in chosen["lm_head"]
    for part, modules in int8_parts(loaded.model).items():
        winner = winners[part]
        assert chosen[part].startswith(f"{winner} ("), chosen[part]
        assert f"1000.00 ms {winner}" in chosen[part] and "2000.00 ms" in chosen[part]
        assert (f"ms {NATIVE}" in chosen[part]) == native and (f"no {NATIVE} GEMM here: {NATIVE_OFF}" in chosen[part]) != native
        for m in modules:
            weight, _, handle = m.int8_layout
            assert (weight is None) == (winner != PLAIN) and (handle is not None) == (winner != PLAIN)
            assert handle is None or packed_gemm_name(handle) == winner
    handles = [m.int8_layout[2] for part in int8_parts(loaded.model).values() for m in part]
    handles = [int(h) for h in handles if h is not None]
    assert set(packed_int8._packed) - before == set(handles)  # the losers' packed copies are freed
    # each packed copy replaces a plain one and is counted as its bytes; the handles are 8 bytes each
    assert loaded.weight_bytes == plain.weight_bytes + 8 * len(handles)
    assert torch.equal(prompt_logits(loaded.model, IDS), prompt_logits(plain.model, IDS))
    assert greedy_decode(loaded.model, PROMPTS, 5) == greedy_decode(plain.model, PROMPTS, 5)


def test_compiled_steps_on_packed_weights_equal_those_on_plain_ones(tiny_model_dir, monkeypatch):
    if cpp_compiler() is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    models = {}
    for gemm in (PLAIN, PACKED, NATIVE):
        script_gemm_choice(monkeypatch, {"layers": gemm, "lm_head": gemm}, native=gemm == NATIVE)
        models[gemm] = _load(tiny_model_dir).model
        models[gemm].compile_layers()
    for gemm in (PACKED, NATIVE):
        assert torch.equal(prompt_logits(models[gemm], IDS), prompt_logits(models[PLAIN], IDS))
        assert greedy_decode(models[gemm], PROMPTS, 5) == greedy_decode(models[PLAIN], PROMPTS, 5)


def test_a_measured_loser_is_freed_and_its_plain_weights_kept(tiny_model_dir, monkeypatch):
    script_gemm_choice(monkeypatch, {"layers": PLAIN, "lm_head": PLAIN}, native=vnni_gemm.unavailable_reason() is None)
    before = set(packed_int8._packed)
    loaded = _load(tiny_model_dir)
    assert set(packed_int8._packed) <= before
    assert all(m.int8_layout[0] is not None for part in int8_parts(loaded.model).values() for m in part)


def test_without_a_packed_kernel_every_part_stays_on_int_mm(tiny_model_dir, monkeypatch):
    def unavailable(owner, qweight):
        raise RuntimeError("could not create a primitive descriptor for the matmul primitive\nmore detail")

    monkeypatch.setitem(w8a8_gemm.PACKERS, PACKED, unavailable)
    stand_in_for_amx(monkeypatch)
    loaded = _load(tiny_model_dir)
    assert loaded.model.kernel_choice.int8_gemm == {
        part: f"{PLAIN} (no {PACKED} GEMM here: could not create a primitive descriptor for the matmul "
              f"primitive; no {NATIVE} GEMM here: {NATIVE_OFF})"
        for part in ("layers", "lm_head")}
    assert greedy_decode(loaded.model, PROMPTS, 3)  # runs


def test_a_native_gemm_off_by_one_is_refused_on_the_screening_slice(tiny_model_dir, monkeypatch):
    why = vnni_gemm.unavailable_reason()
    if why:
        pytest.skip(f"no native int8 GEMM here: {why}")
    products = vnni_gemm.NativeInt8Weight.products
    monkeypatch.setattr(vnni_gemm.NativeInt8Weight, "products", lambda self, u, s: products(self, u, s) + 1)
    chosen = _load(tiny_model_dir).model.kernel_choice.int8_gemm
    for text in chosen.values():
        assert "native VNNI's products differ from torch._int_mm's exact sums on one weight's slice: not used" in text
        assert not text.startswith(NATIVE) and f"ms {NATIVE}" not in text


def test_a_fallback_packed_kernel_is_screened_out_before_the_full_timing(tiny_model_dir, monkeypatch):
    screened = []

    def screening_call(fn, reps):
        screened.append(fn)
        return 50.0 if len(screened) % 2 else 1.0  # packed first, then plain: 50x slower, a fallback

    def full_timing(fns, rounds, reps):
        raise AssertionError("a screened-out GEMM must not be timed in full")

    monkeypatch.setattr(w8a8_gemm, "best_seconds", screening_call)
    monkeypatch.setattr(w8a8_gemm, "alternating_best", full_timing)
    stand_in_for_amx(monkeypatch)
    before = set(packed_int8._packed)
    loaded = _load(tiny_model_dir)
    chosen = loaded.model.kernel_choice.int8_gemm
    assert len(screened) == 4  # one call of each GEMM for each of the two parts
    for text in chosen.values():
        assert re.fullmatch(r"torch\._int_mm \(50000\.00 ms oneDNN packed vs 1000\.000 torch\._int_mm for \d+ "
                            r"channels of one weight at 128 rows: a fallback kernel, not timed further; no native "
                            r"VNNI GEMM here: off in this test\)", text), text
    assert set(packed_int8._packed) <= before  # the screening slices' packed copies are freed
    assert all(m.int8_layout[2] is None for part in int8_parts(loaded.model).values() for m in part)


def test_the_measurement_times_each_gemm_on_the_models_own_weights(tiny_model_dir, monkeypatch):
    """Unscripted timings, as on an AMX CPU: whichever wins on this machine, the figures of every GEMM timed
    (and why any other was not) are given."""
    stand_in_for_amx(monkeypatch, native=vnni_gemm.unavailable_reason() is None)
    chosen = _load(tiny_model_dir).model.kernel_choice.int8_gemm
    assert set(chosen) == {"layers", "lm_head"}
    gemm = r"(torch\._int_mm|oneDNN packed|native VNNI)"
    for text in chosen.values():
        timed = re.fullmatch(rf"{gemm} \(([\d.]+ ms {gemm}(?:, [\d.]+ ms {gemm})*) for \d+ of its \d+ weights at "
                             r"128 rows(; .+)?\)", text)
        if timed is None:  # nothing to time against torch._int_mm: both reasons given
            assert re.fullmatch(r"torch\._int_mm \(.+; no native VNNI GEMM here: .+\)", text), text
            continue
        figures = {name: float(ms) for ms, name in re.findall(rf"([\d.]+) ms {gemm}", timed.group(2))}
        # the figures are rounded (the tiny model's products take hundredths of a ms): the winner's may tie
        fastest, winner = min(figures.values()), figures[timed.group(1)]
        if f"{NATIVE} within" in text:  # the layers' preference for the native GEMM, noted where it applied
            assert timed.group(1) == NATIVE and text.startswith(NATIVE) and fastest <= winner
            assert winner <= (1 + w8a8_gemm.NATIVE_LAYERS_MARGIN) * fastest + 0.01
        else:
            assert winner == fastest
        assert PLAIN in figures
        assert (NATIVE in figures) == (vnni_gemm.unavailable_reason() is None)


@pytest.mark.parametrize("flags,native,gemm", [({"avx2"}, False, PACKED), ({"avx2", "avx_vnni"}, False, PACKED),
                                               ({"avx512_vnni", "avx2"}, True, NATIVE), (set(), False, PLAIN)])
def test_where_the_features_decide_nothing_is_timed(tiny_model_dir, monkeypatch, flags, native, gemm):
    if native and vnni_gemm.unavailable_reason():
        pytest.skip(f"no native int8 GEMM here: {vnni_gemm.unavailable_reason()}")
    features = CpuFeatures(frozenset(flags), None if native else NATIVE_OFF)
    monkeypatch.setattr(w8a8_gemm, "cpu_features", lambda: features)

    def timing(*args):
        raise AssertionError("the features name one GEMM: nothing to time")

    monkeypatch.setattr(w8a8_gemm, "alternating_best", timing)
    loaded = _load(tiny_model_dir)
    for part, modules in int8_parts(loaded.model).items():
        assert loaded.model.kernel_choice.int8_gemm[part] == f"{gemm} ({int8_gemm_rule(features, part).why})"
        assert all((m.int8_layout[2] is None) == (gemm == PLAIN) for m in modules)
        assert all(packed_gemm_name(m.int8_layout[2]) == gemm for m in modules if m.int8_layout[2] is not None)
    assert greedy_decode(loaded.model, PROMPTS, 3)  # runs


def test_a_packed_gemm_the_features_name_falls_back_to_int_mm_where_its_products_differ(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(w8a8_gemm, "cpu_features", lambda: CpuFeatures(frozenset({"avx2"}), NATIVE_OFF))
    monkeypatch.setattr(packed_int8.OneDNNWeight, "products", lambda self, u, s: torch.zeros(u.shape[0], s.numel()))
    chosen = _load(tiny_model_dir).model.kernel_choice.int8_gemm
    for text in chosen.values():
        assert text.startswith(f"{PLAIN} (AVX2 without AVX-512 VNNI") and \
            f"{PACKED}'s products differ from {PLAIN}'s exact sums on one weight's slice: not used" in text


@pytest.mark.parametrize("native_ms,why_not,layers", [(1040.0, None, NATIVE), (1200.0, None, PACKED),
                                                     (1040.0, "the layers have biases", PACKED)])
def test_the_layers_take_the_native_gemm_within_the_margin_of_the_fastest(tiny_model_dir, monkeypatch, native_ms,
                                                                          why_not, layers):
    """Within NATIVE_LAYERS_MARGIN of the fastest, the layers run the native GEMM (so the decoder layers can
    run natively), unless the model could not run them natively anyway; the head, which has no such
    layers, keeps the fastest."""
    stand_in_for_amx(monkeypatch, True)
    if why_not:
        monkeypatch.setattr(w8a8_gemm, "native_model_reason", lambda model: why_not)
    monkeypatch.setattr(w8a8_gemm, "best_seconds", lambda fn, reps: 1.0)  # the screening calls tie
    monkeypatch.setattr(w8a8_gemm, "alternating_best", lambda fns, rounds, reps: [2.0, 1.0, native_ms / 1000])
    chosen = _load(tiny_model_dir).model.kernel_choice.int8_gemm
    assert chosen["layers"].startswith(f"{layers} (") and chosen["lm_head"].startswith(f"{PACKED} (")
    assert ("decoder layers run natively" in chosen["layers"]) == (layers == NATIVE)
