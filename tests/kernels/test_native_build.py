"""The native kernels' build cache (`kernels.native_build`): a library is rebuilt when anything it is built
from changes, its local headers included."""

from __future__ import annotations

import ctypes

import pytest

from kernels.native_build import NATIVE_PARTS, SWITCH, built_library, c_compiler, machine_reason, native_parts


def test_a_changed_header_rebuilds_the_library(tmp_path, monkeypatch):
    compiler = c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("PIPELINE_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "answer.c"
    source.write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')
    header = tmp_path / "answer.h"
    answers = {}
    for value in (41, 42, 41):
        header.write_text(f"#define ANSWER {value}\n")
        library = built_library(compiler, source)
        answers[library] = ctypes.CDLL(str(library)).answer()
    assert sorted(answers.values()) == [41, 42]  # two builds, the first found again in the cache
    assert all(path.parent == tmp_path / "cache" for path in answers)


@pytest.mark.parametrize("value,kept", [(None, NATIVE_PARTS), ("on", NATIVE_PARTS), ("off", ()),
                                        ("attention, GEMM", ("gemm", "attention")), ("decode", ("decode",))])
def test_one_switch_keeps_the_native_kernels_it_names(monkeypatch, value, kept):
    if value is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, value)
    assert native_parts() == kept
    for part in NATIVE_PARTS:
        why = machine_reason(part, "avx2", "AVX2")
        assert (why == f"PIPELINE_NATIVE={value} leaves out the native {part}") == (part not in kept), why


def test_the_switch_refuses_a_word_it_does_not_know(monkeypatch):
    monkeypatch.setenv(SWITCH, "gemm,attn")
    with pytest.raises(ValueError, match="PIPELINE_NATIVE=gemm,attn: 'attn' is not a native kernel"):
        native_parts()
