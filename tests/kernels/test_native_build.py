"""The native kernels' build cache (`kernels.native_build`): a library is rebuilt when anything it is built
from changes, its local headers included."""

from __future__ import annotations

import ctypes

import pytest

from kernels.native_build import built_library, c_compiler


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
