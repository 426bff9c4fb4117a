"""Host memory for CPU steps: a step's large buffers are reused by the next step instead of faulted in anew.

glibc serves an allocation above its mmap threshold (which it adjusts by itself up to 32 MB) with fresh pages
from the kernel and gives them back on free. A CPU decode step allocates the LM head's [rows, vocab] outputs
every step: at 256 rows, 50 MB of int32 sums (and as much again for the logits where a step needs them),
each time ~12,000 page faults and zeroing by the kernel, ~15 ms of a ~160 ms step. Raising the mmap and trim
thresholds keeps such buffers in the heap, where the next step finds them. glibc's aligned allocation (torch
aligns its buffers) cannot take a freed chunk of exactly its own size, so the first few steps may still
grow the heap until freed neighbours merge; from then on the steps reuse it.

Set when a CPU runner is built, after the model is loaded, so that the loader's temporaries still go back
to the system.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
REUSE_UP_TO = 1 << 30  # bytes: allocations up to this size come from (and return to) the heap


def keep_step_buffers(limit: int = REUSE_UP_TO) -> bool:
    """Serve allocations up to `limit` bytes from the heap and keep up to `limit` freed bytes at its top for
    reuse. Returns whether it applied: glibc only; elsewhere the allocator keeps its own policy."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    return bool(libc.mallopt(M_MMAP_THRESHOLD, limit)) and bool(libc.mallopt(M_TRIM_THRESHOLD, limit))
