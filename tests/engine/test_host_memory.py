"""The CPU runner's heap setting: a freed step-sized buffer is reused, not faulted in again.

Each measurement runs in a fresh interpreter: the heap of a long test session (holes left by earlier tests,
small allocations landing after a freed buffer) decides where the next large buffer goes, so the same check
inside the suite's process passed or failed by the order of the tests before it.
"""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys

import pytest

LARGE = (256, 49_152)  # the LM head's int32 sums at 256 rows: 50 MB, above glibc's own mmap threshold cap
ROUNDS = 16

_MEASURE = f"""
import json, resource, sys
import torch
from pipeline.engine.host_memory import keep_step_buffers

def faults_of_a_fresh_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = torch.empty({LARGE}, dtype=torch.int32)
    buf.fill_(1)
    del buf
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

torch.ones(1 << 16).add_(1)  # start the thread pool first: its own allocations are not the buffer's
applied = keep_step_buffers() if sys.argv[1] == "keep" else False
print(json.dumps([applied, [faults_of_a_fresh_buffer() for _ in range({ROUNDS})]]))
"""


def page_faults_per_round(policy: str) -> tuple[bool, list[int]]:
    """Whether the setting applied, and the page faults of each round of allocating, filling and freeing a
    LARGE buffer, in a fresh interpreter under `policy` ("keep": the runner's setting; "default": glibc's)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, policy], capture_output=True, text=True, check=True)
    applied, faults = json.loads(out.stdout)
    return applied, faults


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's (mallopt)")
def test_a_freed_step_buffer_is_reused_without_page_faults():
    pages = LARGE[0] * LARGE[1] * 4 // resource.getpagesize()
    applied, faults = page_faults_per_round("keep")
    assert applied
    # glibc's aligned allocation cannot take a freed chunk of exactly its own size (it asks for room to
    # align), so the first rounds may grow the heap until freed neighbours merge; then every round reuses.
    assert all(f < pages // 20 for f in faults[-4:]), faults


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's (mallopt)")
def test_without_the_setting_every_round_faults_the_buffer_in_again():
    pages = LARGE[0] * LARGE[1] * 4 // resource.getpagesize()
    applied, faults = page_faults_per_round("default")
    assert not applied
    assert all(f > pages // 2 for f in faults), faults  # mapped on allocation, unmapped on free
