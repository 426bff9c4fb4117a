"""The engine under tensor parallelism: rank 0 schedules and samples, every rank runs the same step.

`open_model(...)` starts the N-1 workers (or joins the ranks `torchrun` started), loads rank 0's shard and
waits until every worker holds its own; it hands the engine a `ShardedModel` whose `make_runner` builds a
`TPRunner`. Each step `TPRunner` broadcasts the `StepBatch` (a handful of int tensors, one
broadcast) and runs rank 0's half; the workers' `RunnerWorker` runs the same batch on its shard and its
own KV pools (holding its KV heads only). Logits are all-gathered inside the LM head; only rank 0 samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.engine.runner import Runner, StepBatch
from pipeline.model.collectives import SINGLE, TPGroup
from pipeline.model.llama import LlamaModel
from pipeline.model.loader import LoadedModel, load_model, open_model_file
from pipeline.model.startup_cache import StartupCache
from pipeline.parallel.pool import WorkerPool, rank_device
from pipeline.parallel.torchrun import TorchrunDriver, TorchrunEnv, join_torchrun
from pipeline.parallel.wire import StepDriver, run_worker

_BATCH_FIELDS = [f.name for f in dataclasses.fields(StepBatch)]


def pack_batch(batch: StepBatch) -> list[torch.Tensor]:
    """The batch as a list of tensors in field order (`num_decodes` as a 0-d tensor)."""
    return [torch.tensor(v) if isinstance(v, int) else v for v in (getattr(batch, f) for f in _BATCH_FIELDS)]


def unpack_batch(tensors: list[torch.Tensor]) -> StepBatch:
    values = dict(zip(_BATCH_FIELDS, tensors, strict=True))
    values["num_decodes"] = int(values["num_decodes"])
    return StepBatch(**values)


@dataclass(frozen=True)
class ShardSpec:
    """How a worker loads its shard: the same checkpoint, dtype and quantization as rank 0."""

    path: str
    dtype: torch.dtype = torch.float32
    quant: str = "none"
    quant_group_size: int = 32
    w8a8_rows: int | None = None
    quant_lm_head: str = "int8"
    kv_dtype: torch.dtype | None = None
    prefer_speed: bool = False

    def load(self, group: TPGroup, device: str, startup_cache: StartupCache | None = None) -> LoadedModel:
        return load_model(self.path, self.dtype, group, device, self.quant, self.quant_group_size,
                          self.w8a8_rows, self.quant_lm_head, self.kv_dtype, self.prefer_speed, startup_cache)

    def build(self, group: TPGroup, device: str) -> RunnerWorker:
        return RunnerWorker(self.load(group, device).model, torch.device(device))


def pack_adapter(slot: int, path: str, slots: int) -> list[torch.Tensor]:
    """A LoRA adapter load as a two-tensor message: (slot, slots) and the folder's path as UTF-8 bytes."""
    return [torch.tensor([slot, slots]), torch.frombuffer(bytearray(path.encode()), dtype=torch.uint8)]


class RunnerWorker:
    """A worker's executor. A one-tensor message (re)sizes the KV pools as rank 0's new engine sized them
    (only rank 0 knows the engine config); a two-tensor message loads a LoRA adapter into a slot
    (`pack_adapter`: every rank reads the folder rank 0 checked and keeps its own shard); every other
    message is one `StepBatch` to run. One engine at a time per tensor-parallel model."""

    def __init__(self, model: LlamaModel, device: torch.device):
        self.model = model
        self.device = device
        self.runner: Runner | None = None

    def execute(self, inputs: list[torch.Tensor]) -> None:
        if len(inputs) == 1:
            num_blocks, block_size = inputs[0].tolist()
            self.runner = None  # free the old pools before allocating the new ones
            self.runner = Runner(self.model, num_blocks, block_size, self.device)
        elif len(inputs) == 2:
            (slot, slots), path = inputs[0].tolist(), bytes(inputs[1].cpu().numpy()).decode()
            self.runner.load_adapter(slot, path, slots)
        else:
            self.runner.execute(unpack_batch([t.to(self.device) for t in inputs]))


class TPRunner:
    """Rank 0's runner: the same interface as `Runner` (`execute`, `attn`, `model`); each step first goes
    to the workers, then runs here. Worker failures surface as `WorkerFailed` naming the rank."""

    def __init__(self, driver: StepDriver, model: LlamaModel, num_blocks: int, block_size: int,
                 device: torch.device):
        self.driver = driver
        self.local = Runner(model, num_blocks, block_size, device)
        self.model = model
        self.attn = self.local.attn
        self.driver.send([torch.tensor([num_blocks, block_size])])

    def execute(self, batch: StepBatch) -> torch.Tensor:
        return self.driver.step(pack_batch(batch), lambda: self.local.execute(batch))

    def execute_greedy(self, batch: StepBatch) -> torch.Tensor:
        """The workers run the step as always; here the head gathers the vocabulary slices and takes the
        argmax (`LMHead.greedy` under tensor parallelism)."""
        return self.driver.step(pack_batch(batch), lambda: self.local.execute_greedy(batch))

    def load_adapter(self, slot: int, path: str, slots: int) -> None:
        """Every rank places its shard of the adapter in `slot`."""
        self.driver.send(pack_adapter(slot, path, slots))
        self.local.load_adapter(slot, path, slots)


@dataclass
class ShardedModel:
    """A model held by every rank: rank 0's `LoadedModel` and the driver that sends each step to the
    other ranks (None for one rank). Pass `make_runner` to the engine."""

    loaded: LoadedModel
    driver: StepDriver | None = None

    def make_runner(self, model: LlamaModel, num_blocks: int, block_size: int,
                    device: torch.device) -> Runner | TPRunner:
        if self.driver is None:
            return Runner(model, num_blocks, block_size, device)
        return TPRunner(self.driver, model, num_blocks, block_size, device)


@contextlib.contextmanager
def open_model(
    path: str | Path,
    device: str = "cpu",
    tensor_parallel: int = 1,
    threads: int | None = None,
    timeout_s: float = 300.0,
    startup_cache: StartupCache | None = None,
    **load: Any,
) -> Iterator[ShardedModel]:
    """Load the model for `tensor_parallel` ranks and keep the workers alive for the `with` block.

    `load` is how every rank loads it: `ShardSpec`'s fields (dtype, quant, quant_group_size, w8a8_rows,
    quant_lm_head, kv_dtype, prefer_speed). device "auto" means CUDA when available. tensor_parallel=1 is plain `load_model` and the
    plain runner. Otherwise the head counts are checked before any process starts; under `torchrun` (its RANK/WORLD_SIZE in the
    environment) the ranks it started are joined instead of spawning, and ranks > 0 serve steps here and
    then exit the process (SystemExit 0). Leaving the block normally stops the workers in order; an
    exception terminates them. A one-rank load may read and store its quantized model in `startup_cache`.
    """
    device = _resolve_device(device)
    spec = ShardSpec(str(path), **load)
    if tensor_parallel == 1:
        yield ShardedModel(spec.load(SINGLE, device, startup_cache))
        return
    open_model_file(path).config.check_tensor_parallel(tensor_parallel)
    env = TorchrunEnv.from_env()
    driver: StepDriver
    if env is None:
        pool = WorkerPool(tensor_parallel, spec, device, threads, timeout_s)
        group, driver = pool.group, pool
    elif env.rank > 0:
        _serve_torchrun(env, spec, tensor_parallel, device, threads, timeout_s)
        raise SystemExit(0)
    else:
        group = _join_torchrun(env, tensor_parallel, device, threads, timeout_s)
        driver = TorchrunDriver(group, rank_device(device, env.local_rank))
    ok = False
    try:
        device = rank_device(device, env.local_rank if env else 0)
        loaded = spec.load(group, device)
        driver.wait_ready()
        yield ShardedModel(loaded, driver)
        ok = True
    finally:
        driver.close(graceful=ok)


def serve_as_torchrun_worker(
    path: str | Path,
    device: str = "cpu",
    tensor_parallel: int = 1,
    threads: int | None = None,
    timeout_s: float = 300.0,
    **load: Any,
) -> bool:
    """Under torchrun, ranks > 0 only hold a shard: load it, serve rank 0's steps until it stops, then
    return True. Returns False at once on rank 0 and outside torchrun (the caller runs the job).

    Call it before the job touches its output, so that only rank 0 reads input and writes results.
    `load` as for `open_model`.
    """
    env = TorchrunEnv.from_env()
    if env is None or env.rank == 0 or tensor_parallel == 1:
        return False
    open_model_file(path).config.check_tensor_parallel(tensor_parallel)
    spec = ShardSpec(str(path), **load)
    _serve_torchrun(env, spec, tensor_parallel, _resolve_device(device), threads, timeout_s)
    return True


def _resolve_device(device: str) -> str:
    """Device "auto" -> CUDA when available, else CPU; anything else unchanged."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _join_torchrun(env: TorchrunEnv, tensor_parallel: int, device: str, threads: int | None,
                   timeout_s: float) -> TPGroup:
    if env.world_size != tensor_parallel:
        raise ValueError(f"engine.tensor_parallel={tensor_parallel} but torchrun started {env.world_size} processes")
    return join_torchrun(env, device, threads, timeout_s)


def _serve_torchrun(env: TorchrunEnv, spec: ShardSpec, tensor_parallel: int, device: str, threads: int | None,
                    timeout_s: float) -> None:
    """A torchrun rank > 0's life: join the group, load its shard, serve rank 0's steps until it stops.
    Ctrl-C is rank 0's to handle (it then stops us)."""
    group = _join_torchrun(env, tensor_parallel, device, threads, timeout_s)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_worker(group, rank_device(device, env.local_rank), spec)
    torch.distributed.destroy_process_group()
