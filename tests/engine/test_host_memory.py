"""The CPU runner's heap setting: a freed step-sized buffer is reused, not faulted in again."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from pipeline.engine.host_memory import keep_step_buffers

LARGE = (256, 49_152)  # the LM head's int32 sums at 256 rows: 50 MB, above glibc's own mmap threshold cap


def faults_of_a_fresh_buffer() -> int:
    """Page faults taken allocating and filling a LARGE buffer, which is then freed."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = torch.empty(LARGE, dtype=torch.int32)
    buf.fill_(1)
    del buf
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's (mallopt)")
def test_a_freed_step_buffer_is_reused_without_page_faults():
    pages = LARGE[0] * LARGE[1] * 4 // resource.getpagesize()
    assert keep_step_buffers()
    faults = [faults_of_a_fresh_buffer() for _ in range(4)]  # the first ones may grow the heap
    assert faults[-1] < pages // 20, faults  # reused; glibc's own policy maps and faults in every page again
