"""The int8 GEMM chosen per part at load (`pipeline.model.int8_gemm`): the choice follows the timings and
never changes a logit."""

from __future__ import annotations

import re

import pytest
import torch

from kernels import int8_cpu
from pipeline.model import int8_gemm
from pipeline.model.int8_gemm import PACKED, PLAIN, int8_parts
from pipeline.model.llama import cpp_compiler
from pipeline.model.loader import load_model
from tests.reference import greedy_decode, prompt_logits

IDS = [1, 504, 3459, 314, 260, 1789, 28, 1017, 7, 42, 9000, 17]
PROMPTS = [IDS, IDS[:5], [1, 77, 5000, 12, 900, 33, 2, 8]]


def _scripted(monkeypatch, packed_faster: dict[str, bool]) -> None:
    """Timings where the packed GEMM wins exactly for the parts marked True (in the order timed)."""
    verdicts = iter(packed_faster.values())
    monkeypatch.setattr(int8_gemm, "best_seconds", lambda fn, reps: 1.0)  # the screening calls tie
    monkeypatch.setattr(int8_gemm, "alternating_best",
                        lambda fns, rounds, reps: [2.0, 1.0] if next(verdicts) else [1.0, 2.0])


def _load(tiny_model_dir, **load):
    return load_model(tiny_model_dir, quant="w8a8", quant_lm_head="int8", **load)


@pytest.mark.parametrize("packed_faster", [{"layers": True, "lm_head": True}, {"layers": True, "lm_head": False},
                                           {"layers": False, "lm_head": True}, {"layers": False, "lm_head": False}])
def test_each_part_keeps_the_faster_gemm_and_the_logits_stay_bit_for_bit(tiny_model_dir, monkeypatch, packed_faster):
    _scripted(monkeypatch, {"layers": False, "lm_head": False})
    plain = _load(tiny_model_dir)
    assert all(m.int8_layout[2] is None for part in int8_parts(plain.model).values() for m in part)
    _scripted(monkeypatch, packed_faster)
    monkeypatch.setattr(int8_gemm, "TIMED_LAYERS", 1)  # of the tiny model's 2: the other is packed untimed
    loaded = _load(tiny_model_dir)
    chosen = loaded.model.kernel_choice.int8_gemm
    assert list(chosen) == ["layers", "lm_head"]
    linears = len(int8_parts(loaded.model)["layers"])
    assert f"for {linears // 2} of its {linears} weights" in chosen["layers"] and "for 1 of its 1" in chosen["lm_head"]
    for part, modules in int8_parts(loaded.model).items():
        assert chosen[part].startswith(PACKED if packed_faster[part] else PLAIN), chosen[part]
        for m in modules:
            weight, _, handle = m.int8_layout
            assert (weight is None) == packed_faster[part] and (handle is not None) == packed_faster[part]
    handles = sum(m.int8_layout[2] is not None for part in int8_parts(loaded.model).values() for m in part)
    # each packed copy replaces a plain one and is counted as its bytes; the handles are 8 bytes each
    assert loaded.weight_bytes == plain.weight_bytes + 8 * handles
    assert torch.equal(prompt_logits(loaded.model, IDS), prompt_logits(plain.model, IDS))
    assert greedy_decode(loaded.model, PROMPTS, 5) == greedy_decode(plain.model, PROMPTS, 5)


def test_compiled_steps_on_packed_weights_equal_those_on_plain_ones(tiny_model_dir, monkeypatch):
    if cpp_compiler() is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    models = {}
    for packed in (False, True):
        _scripted(monkeypatch, {"layers": packed, "lm_head": packed})
        models[packed] = _load(tiny_model_dir).model
        models[packed].compile_layers()
    assert torch.equal(prompt_logits(models[True], IDS), prompt_logits(models[False], IDS))
    assert greedy_decode(models[True], PROMPTS, 5) == greedy_decode(models[False], PROMPTS, 5)


def test_a_measured_loser_is_freed_and_its_plain_weights_kept(tiny_model_dir, monkeypatch):
    _scripted(monkeypatch, {"layers": False, "lm_head": False})
    before = set(int8_cpu._packed)
    loaded = _load(tiny_model_dir)
    assert set(int8_cpu._packed) == before
    assert all(m.int8_layout[0] is not None for part in int8_parts(loaded.model).values() for m in part)


def test_without_a_packed_kernel_every_part_stays_on_int_mm(tiny_model_dir, monkeypatch):
    def unavailable(owner, qweight):
        raise RuntimeError("could not create a primitive descriptor for the matmul primitive\nmore detail")

    monkeypatch.setattr(int8_gemm, "pack_int8_weight", unavailable)
    loaded = _load(tiny_model_dir)
    assert loaded.model.kernel_choice.int8_gemm == {
        part: f"{PLAIN} (no packed oneDNN GEMM here: could not create a primitive descriptor for the matmul primitive)"
        for part in ("layers", "lm_head")}
    assert greedy_decode(loaded.model, PROMPTS, 3)  # runs


def test_a_fallback_packed_kernel_is_screened_out_before_the_full_timing(tiny_model_dir, monkeypatch):
    screened = []

    def screening_call(fn, reps):
        screened.append(fn)
        return 50.0 if len(screened) % 2 else 1.0  # packed first, then plain: 50x slower, a fallback

    def full_timing(fns, rounds, reps):
        raise AssertionError("a screened-out GEMM must not be timed in full")

    monkeypatch.setattr(int8_gemm, "best_seconds", screening_call)
    monkeypatch.setattr(int8_gemm, "alternating_best", full_timing)
    before = set(int8_cpu._packed)
    loaded = _load(tiny_model_dir)
    chosen = loaded.model.kernel_choice.int8_gemm
    assert len(screened) == 4  # one call of each GEMM for each of the two parts
    for text in chosen.values():
        assert re.fullmatch(r"torch\._int_mm \(50000\.00 ms packed vs 1000\.000 plain for \d+ channels of one "
                            r"weight at 128 rows: a fallback kernel, not timed further\)", text), text
    assert set(int8_cpu._packed) == before  # the screening slices' packed copies are freed
    assert all(m.int8_layout[2] is None for part in int8_parts(loaded.model).values() for m in part)


def test_the_measurement_times_both_gemms_on_the_models_own_weights(tiny_model_dir):
    """Unscripted: whichever wins on this machine, its figures (or why there is no packed GEMM) are given."""
    chosen = _load(tiny_model_dir).model.kernel_choice.int8_gemm
    assert set(chosen) == {"layers", "lm_head"}
    for text in chosen.values():
        assert re.fullmatch(r"(oneDNN packed|torch\._int_mm) \([\d.]+ ms packed vs [\d.]+ plain "
                            r"for (\d+) of its (\d+) weights at 128 rows\)"
                            r"|torch\._int_mm \([\d.]+ ms packed vs [\d.]+ plain for \d+ channels of one weight "
                            r"at 128 rows: a fallback kernel, not timed further\)"
                            r"|torch\._int_mm \(no packed oneDNN GEMM here: .+\)", text), text
