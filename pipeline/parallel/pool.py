"""Tensor parallelism across processes: rank 0 spawns the workers, drives their steps, notices failures.

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
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.errors import JobError
from pipeline.model.collectives import TPGroup
from pipeline.parallel.wire import OP_STEP, OP_STOP, StepChannel, T, WorkerSpec, run_worker


class WorkerFailed(JobError):
    """A tensor-parallel worker raised, crashed or was killed; the message names the rank (a JobError, so
    `python -m pipeline` ends with that message rather than a traceback of rank 0's broken collective)."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank



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
    """Each rank on a CUDA machine gets its own GPU, counted from the index the user gave (`cuda:2` puts
    ranks 0, 1 on GPUs 2, 3); on CPU every rank shares `cpu`."""
    dev = torch.device(device)
    return f"cuda:{(dev.index or 0) + local_rank}" if dev.type == "cuda" else "cpu"


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
        self.group = TPGroup(0, size)
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
