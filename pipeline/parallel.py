"""Tensor parallelism across processes: the group, its start-up, the per-step broadcast and failures.

Rank 0 is the process that runs the job (scheduling, I/O, sampling). Ranks 1..N-1 are workers that hold
their shard of the model and replay every step rank 0 runs: rank 0 broadcasts the step's input tensors
(`StepChannel`), then all ranks run the same forward pass, meeting in the all-reduces of the row-parallel
linears. Workers are either spawned by rank 0 (`WorkerPool`, torch.multiprocessing) or started by
`torchrun` (`TorchrunEnv`); gloo serves CPU tensors, NCCL CUDA ones.

Failure policy: a worker that raises writes its traceback into the rendezvous store and exits; a monitor
thread on rank 0 sees any worker exit, stops the other workers (which makes rank 0's pending collective
fail at once) and `WorkerPool.check`/`translate` raise `WorkerFailed` naming the rank. Workers die with
rank 0 (Linux parent-death signal) and ignore Ctrl-C, which rank 0 turns into an orderly stop.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing.connection
import os
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.errors import JobError


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel position of this process. `size == 1` means no communication at all.

    On rank 0 of a multi-process group, `driver` is what sends each step to the workers (a `WorkerPool`
    or a `TorchrunDriver`); the engine finds it here through the model's `tp`.
    """

    rank: int = 0
    size: int = 1
    driver: StepDriver | None = field(default=None, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's slice along the last dimension (used for vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


class WorkerFailed(JobError):
    """A tensor-parallel worker raised, crashed or was killed; the message names the rank (a JobError, so
    `python -m pipeline` ends with that message rather than a traceback of rank 0's broken collective)."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


# ----------------------------------------------------------------------------------------------------
# Placement: backend, device, threads


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_rank(size: int, cores: int | None = None) -> int:
    """Default intra-op threads for each of `size` ranks sharing this machine: cores / size, at least 1."""
    return max(1, (cores or cpu_cores()) // size)


def backend_for(device: str) -> str:
    """gloo moves CPU tensors, NCCL CUDA tensors."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """Each rank on a CUDA machine gets its own GPU; on CPU every rank shares `cpu`."""
    return f"cuda:{local_rank}" if torch.device(device).type == "cuda" else "cpu"


# ----------------------------------------------------------------------------------------------------
# torchrun


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
    """Join the process group torchrun set up (env:// rendezvous); rank 0's group carries its driver."""
    device = rank_device(device, env.local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    torch.set_num_threads(threads or threads_per_rank(env.world_size))
    dist.init_process_group(
        backend_for(device), init_method="env://", rank=env.rank, world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if env.rank > 0:
        return TPGroup(env.rank, env.world_size)
    return TPGroup(0, env.world_size, driver=TorchrunDriver(TPGroup(0, env.world_size), device))


# ----------------------------------------------------------------------------------------------------
# The per-step broadcast

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


# ----------------------------------------------------------------------------------------------------
# Workers


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


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when its parent dies, so a crashed rank 0 leaves no orphans."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


_STORE_PREFIX = "tp/"


def _worker_main(
    rank: int, size: int, host: str, port: int, device: str, spec: WorkerSpec, threads: int,
    timeout_s: float, parent_pid: int,
) -> None:
    """Entry point of a spawned worker process."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    torch.set_num_threads(threads)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))
    try:
        device = rank_device(device, rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        store.add(_STORE_PREFIX + "joined", 1)
        dist.init_process_group(
            backend_for(device), store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
        )
        run_worker(TPGroup(rank, size), device, spec)
    except BaseException as e:  # report anything, including KeyboardInterrupt, before dying
        with contextlib.suppress(Exception):  # rank 0 may be gone already
            store.set(f"{_STORE_PREFIX}error/{rank}", "".join(traceback.format_exception(e))[-4000:])
        sys.stderr.write(f"tensor-parallel rank {rank} failed: {e!r}\n")
        sys.stderr.flush()
        os._exit(1)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class WorkerPool:
    """Rank 0's handle on the N-1 worker processes it spawned; joins the process group as rank 0.

    Use as a context manager: `close()` stops the workers in order after a clean run and terminates
    them (SIGTERM, then SIGKILL) after an error, so no process outlives the pool.
    """

    def __init__(
        self,
        size: int,
        spec: WorkerSpec,
        device: str = "cpu",
        threads: int | None = None,
        timeout_s: float = 300.0,
        host: str = "127.0.0.1",
    ):
        if size < 2:
            raise ValueError(f"a worker pool needs tensor_parallel >= 2, got {size}")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group is already active in this process")
        self.size = size
        self.device = rank_device(device, 0)
        self.threads = threads or threads_per_rank(size)
        self._closing = False
        self._failure: WorkerFailed | None = None
        self._failed = threading.Event()
        self._reaping = threading.Lock()
        self._store = dist.TCPStore(
            host, 0, size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self._threads_before = torch.get_num_threads()
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, size, host, self._store.port, device, spec, self.threads, timeout_s, os.getpid()),
                name=f"tp-rank-{r}",
                daemon=True,
            )
            for r in range(1, size)
        ]
        try:
            for p in self.procs:
                p.start()
            self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
            self._monitor.start()
            self._wait_joined(timeout_s)
            torch.set_num_threads(self.threads)
            dist.init_process_group(
                backend_for(self.device), store=self._store, rank=0, world_size=size,
                timeout=timedelta(seconds=timeout_s),
            )
        except BaseException as e:
            failure = self.failure_for(e, wait_s=1.0)
            self._closing = True
            self._terminate_all()
            torch.set_num_threads(self._threads_before)
            if failure is None or failure is e:
                raise
            raise failure from e
        self.group = TPGroup(0, size, driver=self)
        self.channel = StepChannel(self.group, self.device)

    # -- start-up and failure detection --------------------------------------------------------------

    def _wait_joined(self, timeout_s: float) -> None:
        """Wait (polling, so a worker that dies while importing is noticed) until every worker checked in."""
        deadline = time.monotonic() + timeout_s
        while self._store.add(_STORE_PREFIX + "joined", 0) < self.size - 1:
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not start within {timeout_s:.0f} s")
            time.sleep(0.02)

    def _watch(self) -> None:
        """Monitor thread: the first worker exit that rank 0 did not ask for is a failure."""
        alive = {p.sentinel: p for p in self.procs}
        while alive:
            ready = multiprocessing.connection.wait(list(alive), timeout=0.5)
            for sentinel in ready:
                proc = alive.pop(sentinel)
                proc.join()
                if self._closing or self._failed.is_set():
                    continue
                rank = self.procs.index(proc) + 1
                self._failure = WorkerFailed(rank, self._describe_exit(rank, proc.exitcode))
                self._failed.set()
                self._terminate_all()  # wakes rank 0 from any collective with a connection error

    def _describe_exit(self, rank: int, code: int | None) -> str:
        key = f"{_STORE_PREFIX}error/{rank}"
        detail = ""
        with contextlib.suppress(Exception):
            if self._store.check([key]):
                detail = "\n" + self._store.get(key).decode(errors="replace")
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}" + (" (raised an exception)" if detail else "")
        return f"tensor-parallel worker rank {rank} (of {self.size}) {how}; the job stops.{detail}"

    def check(self) -> None:
        """Raise WorkerFailed if any worker has died."""
        if self._failed.is_set():
            raise self._failure

    def failure_for(self, exc: BaseException, wait_s: float = 5.0) -> WorkerFailed | None:
        """The worker failure behind `exc` (caught around a collective), if a worker failed.

        A dead peer makes gloo raise a bare connection error; the monitor names the rank a moment later.
        """
        if isinstance(exc, WorkerFailed):
            return exc
        if self._closing or not isinstance(exc, RuntimeError | TimeoutError):
            return self._failure
        self._failed.wait(wait_s)
        return self._failure

    @contextlib.contextmanager
    def _naming_failures(self) -> Iterator[None]:
        """Turn an error caused by a failed worker into that worker's `WorkerFailed`."""
        try:
            yield
        except Exception as e:
            failure = self.failure_for(e)
            if failure is None or failure is e:
                raise
            raise failure from e

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    # -- steps ---------------------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Block until every worker built its executor (a worker's load error surfaces here)."""
        with self._naming_failures():
            self.check()
            dist.barrier()

    def send(self, inputs: Sequence[torch.Tensor]) -> None:
        """Broadcast one message to every worker (a step's inputs, or a set-up message)."""
        with self._naming_failures():
            self.check()
            self.channel.send(OP_STEP, inputs)

    def step(self, inputs: Sequence[torch.Tensor], run: Callable[[], T]) -> T:
        """Send the step's inputs to every worker, then run rank 0's half (`run`) and return its result."""
        self.send(inputs)
        with self._naming_failures():
            return run()

    # -- shutdown ------------------------------------------------------------------------------------

    def _terminate_all(self, grace_s: float = 5.0) -> None:
        with self._reaping:  # the monitor thread and the main thread may both get here
            self._terminate_locked(grace_s)

    def _terminate_locked(self, grace_s: float) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()

    def close(self, graceful: bool = True) -> None:
        """Stop every worker and leave the process group. Graceful: tell workers to stop after the last
        step; otherwise (after an error, mid-step) terminate them."""
        if self._closing:
            return
        self._closing = True  # from here on, worker exits are expected
        if graceful and not self._failed.is_set():
            try:
                self.channel.send(OP_STOP)
                for p in self.procs:
                    p.join(10.0)
            except Exception:  # a worker died at the last moment: fall through to terminate
                pass
        self._terminate_all()
        self._monitor.join(5.0)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(graceful=exc_type is None)


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
