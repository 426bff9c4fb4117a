"""The per-step message from rank 0 to the workers, and the worker's replay loop.

Rank 0 broadcasts each step's input tensors; every worker unpacks them and runs the same forward pass on its
shard, meeting rank 0 in the model's all-reduces.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from pipeline.model.collectives import TPGroup

OP_STOP = 0
OP_STEP = 1

_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
           torch.float32, torch.float16, torch.bfloat16, torch.float64]
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_HEAD = struct.Struct("<qq")  # op, payload bytes


def pack_tensors(tensors: Sequence[torch.Tensor]) -> bytes:
    """Meta (count, then dtype, ndim, shape per tensor) + each tensor's raw bytes, 8-byte aligned."""
    meta = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPE_CODE:
            raise TypeError(f"cannot send a {t.dtype} tensor to tensor-parallel workers")
        meta += [_DTYPE_CODE[t.dtype], t.dim(), *t.shape]
    out = bytearray(struct.pack(f"<{len(meta)}q", *meta))
    for t in tensors:
        out += t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        out += bytes(-len(out) % 8)
    return bytes(out)


def unpack_tensors(buf: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `pack_tensors` over a uint8 tensor (on any device); returns views into `buf`."""
    words = buf.cpu()
    count = words[:8].view(torch.int64).item()
    pos, specs = 8, []  # walk the meta words: dtype, ndim, shape per tensor
    for _ in range(count):
        code, ndim = words[pos : pos + 16].view(torch.int64).tolist()
        shape = words[pos + 16 : pos + 16 + 8 * ndim].view(torch.int64).tolist()
        specs.append((_DTYPES[code], shape))
        pos += 16 + 8 * ndim
    tensors = []
    for dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append(buf[pos : pos + nbytes].view(dtype).view(shape))
        pos += nbytes + (-nbytes % 8)
    return tensors


class StepChannel:
    """Rank 0 broadcasts (op, tensors) to every worker.

    One fixed-size broadcast carries the header and, when it fits, the whole payload (a decode step of
    dozens of sequences is a few KiB); a larger payload follows in a second broadcast. On loopback gloo a
    call costs ~0.5 ms whatever its size up to tens of KiB, so fewer calls beat smaller ones.
    """

    def __init__(self, group: TPGroup, device: str = "cpu", capacity: int = 64 * 1024):
        self.group = group
        self.device = torch.device(device)
        self.capacity = capacity
        self._buf = torch.empty(capacity, dtype=torch.uint8, device=self.device)

    def send(self, op: int, tensors: Sequence[torch.Tensor] = ()) -> None:
        assert self.group.rank == 0, "only rank 0 sends steps"
        payload = pack_tensors(tensors) if op == OP_STEP else b""
        message = _HEAD.pack(op, len(payload)) + payload
        first = torch.frombuffer(bytearray(message[: self.capacity]), dtype=torch.uint8)
        self._buf[: first.numel()].copy_(first)
        dist.broadcast(self._buf, src=0)
        if len(message) > self.capacity:
            rest = torch.frombuffer(bytearray(message[self.capacity :]), dtype=torch.uint8)
            dist.broadcast(rest.to(self.device), src=0)

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        dist.broadcast(self._buf, src=0)
        op, size = _HEAD.unpack(self._buf[: _HEAD.size].cpu().numpy().tobytes())
        if op != OP_STEP:
            return op, []
        total = _HEAD.size + size
        if total <= self.capacity:
            payload = self._buf[_HEAD.size : total].clone()
        else:
            rest = torch.empty(total - self.capacity, dtype=torch.uint8, device=self.device)
            dist.broadcast(rest, src=0)
            payload = torch.cat([self._buf[_HEAD.size :], rest])
        return op, unpack_tensors(payload)



class StepExecutor(Protocol):
    """A worker's half of one step: run the forward pass on these inputs (its outputs are not needed)."""

    def execute(self, inputs: list[torch.Tensor]) -> object: ...


class WorkerSpec(Protocol):
    """Picklable recipe a worker uses to build its executor (model shard, KV cache, runner)."""

    def build(self, group: TPGroup, device: str) -> StepExecutor: ...


T = TypeVar("T")


class StepDriver(Protocol):
    """Rank 0's link to the workers: every step's inputs go out before rank 0 runs its own half."""

    def send(self, inputs: Sequence[torch.Tensor]) -> None: ...

    def step(self, inputs: Sequence[torch.Tensor], run: Callable[[], T]) -> T: ...

    def wait_ready(self) -> None: ...

    def close(self, graceful: bool = True) -> None: ...


def serve(channel: StepChannel, executor: StepExecutor) -> None:
    """A worker's loop: replay every step rank 0 broadcasts until it says stop."""
    while True:
        op, tensors = channel.recv()
        if op == OP_STOP:
            return
        executor.execute(tensors)


def run_worker(group: TPGroup, device: str, spec: WorkerSpec) -> None:
    """A worker's life after joining the group: build its shard, say ready (barrier), serve steps."""
    executor = spec.build(group, device)
    dist.barrier()
    serve(StepChannel(group, device), executor)
