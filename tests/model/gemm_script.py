"""Scripted timings for the int8 GEMM chosen at load (`pipeline.model.w8a8_gemm`): tests pick the winner."""

from __future__ import annotations

import pytest

from kernels import vnni_gemm
from pipeline.model import w8a8_gemm
from pipeline.model.w8a8_gemm import NATIVE, PACKED, PLAIN

NATIVE_OFF = "off in this test"


def script_gemm_choice(monkeypatch, winners: dict[str, str], native: bool = False) -> None:
    """Timings where each part's winner (in the order the parts are timed) is the fastest; the native GEMM
    is a candidate only with `native` (skipped where this CPU has none)."""
    why = vnni_gemm.unavailable_reason()
    if native and why:
        pytest.skip(f"no native int8 GEMM here: {why}")
    monkeypatch.setattr(w8a8_gemm, "native_unavailable", lambda: None if native else NATIVE_OFF)
    names = [PLAIN, PACKED, NATIVE]
    verdicts = iter(winners.values())
    monkeypatch.setattr(w8a8_gemm, "best_seconds", lambda fn, reps: 1.0)  # the screening calls tie

    def timings(fns, rounds, reps):  # the candidates come in the order of `names`
        winner = next(verdicts)
        return [1.0 if name == winner else 2.0 for name in names[: len(fns)]]

    monkeypatch.setattr(w8a8_gemm, "alternating_best", timings)
