"""The native kernels' builds: for this CPU (`-march=native`), and with AVX-512 switched off, so that the
AVX2 paths compile and run their reference tests on AVX-512 machines (CI's), which never build them
otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kernels import cpu_attention, cpu_decode_layers, cpu_quantize, cpu_w4a8, native_build, vnni_gemm

BUILDS = {"native": "", "avx2": "-mno-avx512f"}  # extra compiler flags of each build


def forget_loaded_kernels() -> None:
    """Each module loads its kernels once per process: forgotten, the next call builds them again under
    the flags in force (or finds them in the disk cache)."""
    for cached in (cpu_attention._kernel_or_reason, vnni_gemm._library_or_reason,
                   cpu_decode_layers._library_or_reason, cpu_w4a8._library_or_reason,
                   cpu_quantize._library_or_reason):
        cached.cache_clear()


@pytest.fixture(params=list(BUILDS))
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test runs once per build (its name is the value); after it, kernels load as before it."""
    monkeypatch.setenv(native_build.EXTRA_FLAGS, BUILDS[request.param])
    forget_loaded_kernels()
    yield request.param
    forget_loaded_kernels()
