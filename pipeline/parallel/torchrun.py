"""Ranks started by `torchrun`: read its environment, join its process group, drive the other ranks."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeline.model.collectives import TPGroup
from pipeline.parallel.pool import backend_for, rank_device, threads_per_rank
from pipeline.parallel.wire import OP_STEP, OP_STOP, StepChannel, T


@dataclass(frozen=True)
class TorchrunEnv:
    """What `torchrun` tells each process it starts."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TorchrunEnv | None:
        """The torchrun environment, or None when this process was not started by a launcher."""
        env = dict(os.environ) if env is None else env
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return None
        values = {}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            if key not in env:
                raise ValueError(f"torchrun environment is incomplete: {key} is not set")
            values[key] = env[key]
        try:
            rank, world, local, port = (
                int(values[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
            )
        except ValueError as e:
            raise ValueError(f"torchrun environment has a non-integer value: {e}") from None
        if not 0 <= rank < world:
            raise ValueError(f"torchrun environment: RANK={rank} is outside WORLD_SIZE={world}")
        return cls(rank, world, local, values["MASTER_ADDR"], port)


def join_torchrun(env: TorchrunEnv, device: str, threads: int | None = None, timeout_s: float = 300.0) -> TPGroup:
    """Join the process group torchrun set up (env:// rendezvous)."""
    device = rank_device(device, env.local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    torch.set_num_threads(threads or threads_per_rank(env.world_size))
    dist.init_process_group(
        backend_for(device), init_method="env://", rank=env.rank, world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TPGroup(env.rank, env.world_size)


class TorchrunDriver:
    """Rank 0's driver when `torchrun` started every rank: the launcher watches the processes (it stops
    all ranks when one fails), so this only broadcasts the steps."""

    def __init__(self, group: TPGroup, device: str):
        self.channel = StepChannel(group, device)

    def send(self, inputs: Sequence[torch.Tensor]) -> None:
        self.channel.send(OP_STEP, inputs)

    def step(self, inputs: Sequence[torch.Tensor], run: Callable[[], T]) -> T:
        self.send(inputs)
        return run()

    def wait_ready(self) -> None:
        dist.barrier()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            self.channel.send(OP_STOP)
        dist.destroy_process_group()
