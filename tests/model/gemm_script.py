"""Scripted timings for the int8 GEMM chosen at load (`pipeline.model.w8a8_gemm`): tests pick the winner."""

from __future__ import annotations

import pytest

from kernels import vnni_gemm
from pipeline.model import w8a8_gemm
from pipeline.model.cpu_kernels import CpuFeatures
from pipeline.model.w8a8_gemm import NATIVE, PACKED, PLAIN

NATIVE_OFF = "off in this test"
AMX_FLAGS = frozenset({"amx_int8", "avx512_vnni", "avx512f", "avx_vnni", "avx2"})


def stand_in_for_amx(monkeypatch, native: bool = False) -> None:
    """Choose the int8 GEMMs as on an AMX CPU, where they are timed: all three with `native` (skipped where
    this CPU has no native GEMM), else `torch._int_mm` and oneDNN's packed one."""
    why = vnni_gemm.unavailable_reason()
    if native and why:
        pytest.skip(f"no native int8 GEMM here: {why}")
    monkeypatch.setattr(w8a8_gemm, "cpu_features", lambda: CpuFeatures(AMX_FLAGS, None if native else NATIVE_OFF))


def script_gemm_choice(monkeypatch, winners: dict[str, str], native: bool = False) -> None:
    """Timings, as on an AMX CPU (`stand_in_for_amx`), where each part's winner (in the order the parts are
    timed) is the fastest."""
    stand_in_for_amx(monkeypatch, native)
    names = [PLAIN, PACKED, NATIVE]
    verdicts = iter(winners.values())
    monkeypatch.setattr(w8a8_gemm, "best_seconds", lambda fn, reps: 1.0)  # the screening calls tie

    def timings(fns, rounds, reps):  # the candidates come in the order of `names`
        winner = next(verdicts)
        return [1.0 if name == winner else 2.0 for name in names[: len(fns)]]

    monkeypatch.setattr(w8a8_gemm, "alternating_best", timings)
