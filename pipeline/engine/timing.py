"""Step interval timing that measures work, not kernel launches.

On CPU a stamp is the wall clock. On CUDA it is also an event recorded on the current stream; intervals
between events are read once the step has synchronized anyway (the sampler copies the sampled ids to the
host), so timing adds no sync of its own and `model_time` is the device's time from the step's first
kernel to its last, not how long the host took to queue them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Stamp:
    wall: float
    event: torch.cuda.Event | None


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self) -> Stamp:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return Stamp(time.perf_counter(), event)

    @staticmethod
    def seconds(start: Stamp, end: Stamp) -> float:
        """Device seconds between two CUDA stamps (waits for `end`: call after the step's own sync), else
        wall seconds."""
        if start.event is None or end.event is None:
            return end.wall - start.wall
        end.event.synchronize()
        return start.event.elapsed_time(end.event) / 1e3
