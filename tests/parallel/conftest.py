"""Process-tree checks shared by the tensor-parallel tests."""

from __future__ import annotations

import psutil
import pytest


def stray_children() -> list[psutil.Process]:
    """Live descendants of this process other than multiprocessing's resource tracker (one per parent,
    shared by every pool, it exits with us)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def no_orphans():
    """Fail the test if it leaves any worker process behind."""
    before = {p.pid for p in stray_children()}
    yield
    left = [p for p in stray_children() if p.pid not in before]
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
