"""One run: Parquet shards in -> prompts -> engine -> Parquet parts out, with progress and metrics.

Everything that can be checked without the model (config, input listing and columns, output path, model
file) is checked first, so a mistake fails in a second rather than after the model has loaded.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TextIO

import pyarrow as pa

from pipeline import __version__
from pipeline.config import JobConfig, on_cuda, resolve_kv_dtype
from pipeline.engine.request import Request, Result
from pipeline.errors import JobError
from pipeline.faults import fault_point
from pipeline.output.commit import UnitWriter
from pipeline.output.formats import make_sink
from pipeline.output.run_state import RunState
from pipeline.output.signals import GracefulStop, Interrupted
from pipeline.output.sink import Sink, metrics_name, report_dir_name
from pipeline.perf.progress import make_progress, prefill_efficiency, summary
from pipeline.plan.rows import rows_to_do
from pipeline.plan.units import InputFile, Unit, WorkPlan
from pipeline.plan.window import PrefillLowerBound, WindowPlanner
from pipeline.preflight import check_filesystems, check_model_values, check_room
from pipeline.source.columns import column_specs, job_columns
from pipeline.source.formats import Source, open_source
from pipeline.task import RowBuilder, RowTask, row_builder, row_task

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pipeline.engine.batch_tuning import BatchChoice
    from pipeline.engine.engine import Engine
    from pipeline.model.cpu_kernels import CpuKernels
    from pipeline.model.llama import LlamaModel
    from pipeline.model.loader import LoadedModel
    from pipeline.model.quant_choice import QuantChoice
    from pipeline.model.roofline import HardwareProfile, Roofline
    from pipeline.model.startup_cache import StartupCache
    from pipeline.parallel.runner import ShardedModel
    from pipeline.perf.probe import ProbeResult
    from pipeline.perf.report import RunRecorder

log = logging.getLogger("pipeline")


def _model_path(cfg: JobConfig) -> tuple[str, str]:
    """The local checkpoint to load (the default model, `model.path`, or a remote model's cached copy) and
    the model's name (`model.name`, else the checkpoint's own)."""
    from pipeline.model.loader import checkpoint_name, local_model_path

    try:
        path = local_model_path(cfg.model.path, cfg.model.cache_dir)
    except FileNotFoundError as e:
        what = "model.path is null and the default model is missing" if cfg.model.path is None else "model.path"
        raise JobError(f"{what}: {e}") from None
    except OSError as e:
        raise JobError(f"cannot copy model.path={cfg.model.path!r} into the local cache: {e}") from None
    if not path.exists():
        raise JobError(f"model file not found: model.path={cfg.model.path!r}")
    return str(path), cfg.model.name or checkpoint_name(path)


def _model_options(cfg: JobConfig, quant: QuantChoice | None = None, measure: bool = False) -> dict[str, Any]:
    """How every rank loads the model (the job's rank 0, its workers, or torchrun's ranks); `quant` is
    what model.quant=auto resolved to; `measure`: its crossing will be timed on the model
    (`_measures_crossover`), so the W8A8 layouts are loaded whatever the roofline's crossing."""
    import torch

    scheme, rows, head = cfg.model.quant, cfg.model.quant_w8a8_rows, cfg.model.quant_lm_head
    if quant is not None:
        from pipeline.model.w8a8_crossover import rows_to_load

        scheme, rows, head = quant.scheme, rows_to_load(quant, measure), quant.lm_head if head == "auto" else head
    elif head == "auto":
        head = "bf16" if _fast_bf16(cfg.engine.device, "native_bf16") else "int8"
    # auto's int8 cache goes with the quantized model it chose, not with float weights
    setting = "none" if scheme == "none" else cfg.model.quant
    kv_dtype = resolve_kv_dtype(cfg.model.kv_cache_dtype, setting, cfg.model_dtype, cfg.engine.device)
    return {"dtype": getattr(torch, cfg.model_dtype), "device": cfg.engine.device, "quant": scheme,
            "quant_group_size": cfg.model.quant_group_size, "tensor_parallel": cfg.engine.tensor_parallel,
            "w8a8_rows": rows, "quant_lm_head": head, "kv_dtype": getattr(torch, kv_dtype),
            "prefer_speed": quant is not None}


def _measures_crossover(cfg: JobConfig, quant: QuantChoice | None) -> bool:
    """Whether auto's W8A8 crossing is timed on the loaded model (`pipeline.model.w8a8_crossover`): a
    weight-only scheme on CPU, with the hardware probed (given figures are taken as they are)."""
    import torch

    on_cpu = cfg.engine.device == "cpu" or not torch.cuda.is_available()
    return (quant is not None and quant.scheme not in ("w8a8", "none") and on_cpu
            and bool(cfg.resolved["hardware"].get("probe")))


def _fast_bf16(device: str, on_cpu: str) -> bool:
    """Whether bfloat16 work is fast on the run's device: CUDA's bf16 support, or on CPU the `kernels.wq_cpu`
    test named `on_cpu` (`native_bf16` for bf16 matmuls, `weight_only_kernels_fast` for the weight-only
    kernels, which are fast on more CPUs than native bf16 is)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    import kernels.wq_cpu

    return getattr(kernels.wq_cpu, on_cpu)()


def _auto_keeps_float(cfg: JobConfig) -> str | None:
    """Why model.quant=auto loads the model's float weights here, or None where it chooses by regime (one CPU
    rank)."""
    if on_cuda(cfg.engine.device):
        return "on a GPU the float weights run on tensor cores (model.quant=w8a8, fp8 or int4 to quantize)"
    if cfg.engine.tensor_parallel > 1:
        return "under tensor_parallel > 1 the ranks would time kernels apart (name a scheme to quantize)"
    return None


def _choose_quant(cfg: JobConfig, model_path: str, hw: HardwareProfile | None) -> QuantChoice:
    """Resolve model.quant=auto: on one CPU rank, by regime from the hardware profile's peaks (the probe's);
    elsewhere the model's float weights (`_auto_keeps_float`). Logged with why."""
    from pipeline.model.loader import open_model_file
    from pipeline.model.quant_choice import QuantChoice, choose_quant

    why = _auto_keeps_float(cfg)
    if why:
        log.info("model.quant=auto -> none: %s", why)
        return QuantChoice("none", None, "none", why)
    weight_only = "gguf" if model_path.endswith(".gguf") else "int4"
    kernels_fast = _fast_bf16(cfg.engine.device, "weight_only_kernels_fast")
    choice = choose_quant(open_model_file(model_path).config, hw, weight_only, kernels_fast, cfg.engine.batch_limit)
    log.info("model.quant=auto -> %s (W8A8 from %s rows, LM head %s): %s", choice.scheme, choice.w8a8_rows,
             choice.lm_head, choice.reason)
    return choice


def _startup_cache(cfg: JobConfig) -> StartupCache | None:
    """The startup cache of a quantized one-rank job (`model.startup_cache`), else None."""
    if not cfg.model.startup_cache or cfg.model.quant == "none" or cfg.engine.tensor_parallel > 1:
        return None
    from pipeline.engine.config import parse_bytes
    from pipeline.model.startup_cache import StartupCache

    size = parse_bytes(cfg.model.startup_cache_max_size, "model.startup_cache_max_size")
    return StartupCache(cfg.model.startup_cache_dir, size)


def _cached_probe(cache: StartupCache) -> Callable[[], ProbeResult]:
    """The hardware probe, measured at this machine's first start and read from `cache` after."""
    import torch

    from pipeline.perf.probe import ProbeResult, probe

    def measure() -> ProbeResult:
        key = cache.key("probe", threads=torch.get_num_threads())
        return ProbeResult(**cache.fetch_timing(key, lambda: asdict(probe())))

    return measure


def _cached_crossover(cache: StartupCache | None, model_key: str | None) -> Callable | None:
    """auto's measured W8A8 crossing (`pipeline.model.w8a8_crossover`), timed once per cached model."""
    if cache is None or model_key is None:
        return None
    from pipeline.model.w8a8_crossover import Crossover, measure_crossover

    def measure(model: Any, rows: int) -> Crossover:
        return Crossover.from_json(cache.fetch_timing(f"{model_key}.crossover-{rows}",
                                                      lambda: measure_crossover(model, rows).as_json()))

    return measure


def _vector_isa_soon(cfg: JobConfig, options: dict[str, Any], cache: StartupCache | None) -> Future | None:
    """torch.compile's check of the CPU's vector instructions (`_pin_vector_isa`), answered from `cache` after
    the first start, started in a thread now where the engine may compile the layers (engine.compile not off,
    one CPU rank, W8A8 steps loaded): on a first start its builds and child processes (3-4 s) run beside the
    model's load instead of after it."""
    w8a8 = options["quant"] == "w8a8" or (options["quant"] != "none" and options["w8a8_rows"] is not None)
    if cache is None or cfg.engine.compile == "off" or on_cuda(cfg.engine.device) \
            or options["tensor_parallel"] != 1 or not (w8a8 or cfg.engine.compile == "on"):
        return None
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.model.layers import vector_isa_ok
    from pipeline.model.llama import cpp_compiler
    from pipeline.model.startup_cache import JSON_ENTRY

    pool = ThreadPoolExecutor(1, thread_name_prefix="vector-isa")
    soon = pool.submit(cache.fetch, cache.key("vector-isa", compiler=cpp_compiler()), vector_isa_ok, *JSON_ENTRY)
    pool.shutdown(wait=False)  # its one thread ends with the check
    return soon


def _pin_vector_isa(cfg: JobConfig, model: Any, cache: StartupCache | None, soon: Future | None) -> None:
    """Where the engine will compile the layers, torch.compile's check of the CPU's vector instructions
    (`pipeline.model.layers.pin_vector_isa`, 3-4 s) answered from `cache` after the first start, or by
    `soon` (`_vector_isa_soon`) where it was started."""
    from pipeline.engine.engine import compile_layers_wanted

    if cache is None or not compile_layers_wanted(cfg.engine.compile, model, model.norm.weight.device):
        return
    from pipeline.model.layers import pin_vector_isa, vector_isa_ok
    from pipeline.model.llama import cpp_compiler
    from pipeline.model.startup_cache import JSON_ENTRY

    pin_vector_isa(soon.result if soon is not None else
                   lambda: cache.fetch(cache.key("vector-isa", compiler=cpp_compiler()), vector_isa_ok, *JSON_ENTRY))


def _draft_model(cfg: JobConfig, model_path: str, loaded: Any) -> Any:
    """The draft model of speculative.method=draft (None otherwise); its path defaults to the model's own."""
    spec = cfg.speculative
    if spec.method != "draft":
        return None
    draft = spec.draft
    path = draft.path or model_path
    if path == model_path and (draft.dtype, draft.quant) == (cfg.model_dtype, cfg.model.quant) \
            and cfg.engine.tensor_parallel == 1:
        return loaded.model  # drafting with the model itself: exact, no second copy (checks, not speed)
    import torch

    from pipeline.model.loader import load_model

    try:
        return load_model(path, getattr(torch, draft.dtype), quant=draft.quant,
                          quant_group_size=cfg.model.quant_group_size).model
    except (OSError, ValueError, KeyError) as e:
        raise JobError(f"cannot load draft model {path}: {e}") from None


@dataclass
class _Pending:
    """An input row whose requests are still in the engine."""

    base: dict[str, Any]  # id and passthrough values
    unit: Unit
    position: int  # row position inside its unit
    results: list[Result | None]  # its requests' samples, in request order, then sample order
    where: str  # `row 3 of in.parquet (id 7)`, for an error the engine reports
    prompt_tokens: int
    remaining: int


class _Run:
    """The state of one run while rows stream through the engine."""

    def __init__(self, cfg: JobConfig, source: Source, state: RunState, writer: UnitWriter,
                 builder: RowBuilder, id_column: str | None, task: RowTask) -> None:
        self.cfg = cfg
        self.source = source
        self.state = state
        self.writer = writer
        self.id_column = id_column
        self.builder = builder
        self.task = task
        self.pending: dict[int, _Pending] = {}
        self.planner = WindowPlanner(builder.prepare, cfg.plan.prefix_sort)  # tokenizes each row once
        self.bound = PrefillLowerBound()
        self.rows = 0
        self.error_rows = 0  # input rows rejected before the engine or failed in it

    def requests(self) -> Iterator[Request]:
        """Read the rows still to do lazily (the engine pulls only what it can admit); reject bad rows at once.

        Admission ends early when a stop signal arrives (`rows_to_do` stops yielding)."""
        inp = self.cfg.input
        seq = 0
        state = self.state
        for unit, position, file, row_index, planned in rows_to_do(
                self.source, state.plan, state.todo, job_columns(self.cfg), inp.batch_rows,
                self.writer.digests, self.writer.rows, self.planner, lambda: state.stop.stopping):
            row, prepared = planned.row, planned.prepared
            row_id = row.get(self.id_column) if self.id_column else f"{file.name}:{row_index}"
            base = {"id": row_id, **{c: row.get(c) for c in (*inp.passthrough_columns, *self.source.carried)}}
            error = prepared.error or ("id is null" if row_id is None else None)
            if error:
                self._reject(base, unit, position, error, prepared.prompt_tokens)
                continue
            where = f"row {row_index} of {file.name}" + (f" (id {row_id!r})" if self.id_column else "")
            requests = self.task.requests(prepared)  # one, or one per candidate (task=score)
            samples = self.cfg.sampling.n
            self.pending[seq] = _Pending(base, unit, position, [None] * (len(requests) * samples), where,
                                         prepared.prompt_tokens, len(requests) * samples)
            sampling = self.builder.seeded(prepared, row_id)
            for j, (token_ids, prefill) in enumerate(requests):
                self.bound.add(unit.window, token_ids, prepared.adapter)
                fault_point("row.admit")  # crash tests: killed while the engine prefills/decodes others
                yield Request((seq, j), token_ids, sampling, prefill, adapter=prepared.adapter)
            seq += 1

    def _reject(self, base: dict[str, Any], unit: Unit, position: int, error: str, prompt_tokens: int) -> None:
        for row in self.task.error_rows(base, error, prompt_tokens):
            self.writer.add(unit, position, row)
        self.rows += 1
        self.error_rows += 1

    def accept(self, result: Result) -> None:
        """Keep a sample's result; once the row has all of them, write its output rows."""
        fault_point("row.result")  # crash tests: killed mid-decode of the other running rows
        seq, j = result.id
        entry = self.pending[seq]
        entry.results[j * self.cfg.sampling.n + result.sample_index] = result
        entry.remaining -= 1
        if entry.remaining:
            return
        del self.pending[seq]
        for row in self.task.rows(entry.base, entry.results, entry.prompt_tokens, entry.where):
            self.writer.add(entry.unit, entry.position, row)
        self.rows += 1
        self.error_rows += any(r.finish_reason == "error" for r in entry.results)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass(frozen=True)
class _Input:
    """The checked input and model file."""

    source: Source
    types: dict[str, pa.DataType]  # each input column's type
    ids: tuple[str, pa.DataType] | None  # the rows' id key and the id's type; None: ids are `<file>:<row>`
    schema: pa.Schema  # the output's
    model_path: str
    model_name: str
    task: RowTask


@dataclass(frozen=True)
class _Output:
    """This shard's output: its run state (lease, units to do) and sink."""

    stop: GracefulStop
    run_state: RunState
    sink: Sink
    status: str  # `RunState.start`'s: "run", else why there is nothing to do
    fingerprint: str  # the manifest's digest


@dataclass(frozen=True)
class _Model:
    """The loaded model and its engine, with what loading resolved (logged and kept in `_metrics.json`)."""

    sharded: ShardedModel
    engine: Engine
    quant: QuantChoice | None  # what model.quant=auto resolved to, after its measured crossing
    options: dict[str, Any]  # how every rank loaded it (`_model_options`)
    hardware: HardwareProfile | None  # probed (or cached) for model.quant=auto and output.report
    cache: StartupCache | None
    kv_dtype: str
    batch_choice: BatchChoice | None  # engine.max_batch_size=auto's

    @property
    def loaded(self) -> LoadedModel:
        return self.sharded.loaded


@dataclass(frozen=True)
class _KernelReport:
    """What the model's kernels are and what they counted, as logged and kept in `_metrics.json`: a snapshot
    (the step counts grow while the rows run). The float model has no `kernel_choice`: nothing chosen."""

    int8_gemm: dict[str, str]  # the W8A8 int8 GEMM per part, on CPU
    weight_bound: int | None  # the W8A8 weights' largest |int8|
    steps: dict[str, int]  # forward passes per matmul kernel
    native_layer_steps: int  # steps (W8A8 or weight-only) whose decoder layers ran in one native call
    compiled: bool  # the decoder layers run through torch.compile

    @classmethod
    def of(cls, model: LlamaModel) -> _KernelReport:
        choice = model.kernel_choice
        if choice is None:
            return cls({}, None, {}, 0, model.compiled)
        return cls(dict(choice.int8_gemm), choice.weight_bound, dict(choice.steps), choice.native_layer_steps,
                   model.compiled)


def run(cfg: JobConfig, stdout: TextIO | None = None) -> dict[str, Any]:
    """Run the job; returns the metrics also written to `_metrics.json`. Raises JobError for job-level errors."""
    with contextlib.ExitStack() as resources:  # tensor-parallel workers live as long as the run
        return _run(cfg, stdout or sys.stdout, resources)


def _run(cfg: JobConfig, stdout: TextIO, resources: contextlib.ExitStack) -> dict[str, Any]:
    """`run`'s steps; `resources` keeps what must last until the end (stop handlers, lease, workers)."""
    t_start = time.perf_counter()
    inp = _check_input(cfg)
    if _served_steps_as_worker(cfg, inp.model_path):
        return {"rows": 0, "status": "tensor-parallel worker"}
    out = _open_output(cfg, inp, resources)
    if out.status != "run":  # nothing left to do: no model load
        return _nothing_to_do(cfg, out, stdout)
    model = _load_model(cfg, inp.model_path, inp.types, out.run_state.todo_rows * cfg.sampling.n, resources)
    from pipeline.perf.report import RunRecorder

    recorder = RunRecorder(_roofline(cfg, model), interval_s=cfg.output.report_interval_s)
    t_loaded = time.perf_counter()
    _log_loaded(model, t_loaded - t_start)
    state = _run_rows(cfg, inp, out, model, recorder, stdout)
    metrics = _metrics(cfg, inp, out, model, state, recorder, (t_start, t_loaded, time.perf_counter()))
    _write_metrics(cfg, out, metrics, inp.model_name, stdout)
    return metrics


def _run_rows(cfg: JobConfig, inp: _Input, out: _Output, model: _Model, recorder: RunRecorder,
              stdout: TextIO) -> _Run:
    """Stream the rows still to do through the engine into the output's units, with progress; Interrupted
    when a stop request ended admission before every unit was committed."""
    engine, run_state, stop = model.engine, out.run_state, out.stop
    builder = row_builder(cfg, model.loaded.tokenizer, engine.max_model_len)
    writer = UnitWriter(run_state, out.sink, cfg.sampling.n)
    progress = make_progress(cfg.progress.mode, run_state.todo_rows, cfg.progress.log_every_s, stdout, log.info)
    state = _Run(cfg, inp.source, run_state, writer, builder, inp.ids[0] if inp.ids else None, inp.task)
    stats = engine.stats

    def observe() -> None:  # after every step: the first line and sample come before the first row finishes
        progress.update(state.rows, stats, state.bound.total)
        recorder.observe(state.rows, stats)

    for result in engine.generate(state.requests(), on_step=observe):
        state.accept(result)
    recorder.observe(state.rows, stats, force=True)
    progress.update(state.rows, stats, state.bound.total)
    progress.close()
    if writer.committed_units < len(run_state.todo):
        if not stop.stopping:  # every row of every unit was admitted: results went missing
            raise RuntimeError(f"{len(run_state.todo) - writer.committed_units} units incomplete with no stop")
        # Only a stop request ends admission early; the units it left open are redone on resume.
        raise Interrupted(f"{stop.reason or 'stopped'}: {writer.committed_units} of {len(run_state.todo)} "
                          "units committed; run the same command again to resume")
    return state


def _metrics(cfg: JobConfig, inp: _Input, out: _Output, model: _Model, state: _Run, recorder: RunRecorder,
             times: tuple[float, float, float]) -> dict[str, Any]:
    """`_metrics.json`: the run's counts and rates, the engine's statistics, the model, the shard. `times`:
    `time.perf_counter()` at the start, once the model was loaded, at the end."""
    import torch

    t_start, t_loaded, t_end = times
    stats, loaded, run_state, writer = model.engine.stats, model.loaded, out.run_state, state.writer
    generate_s = t_end - t_loaded
    return {
        "task": cfg.task,
        "rows": state.rows,
        "output_rows": writer.rows_written,
        "error_rows": state.error_rows,
        "retried_error_rows": run_state.retry_rows,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "computed_prompt_tokens": stats.prefill_tokens,
        "prefill_lower_bound_tokens": state.bound.total,
        "prefill_efficiency": prefill_efficiency(state.bound.total, stats.prefill_tokens),
        "generated_tokens": stats.decode_tokens,
        "wall_time_s": t_end - t_start,
        "model_load_s": t_loaded - t_start,
        "generate_time_s": generate_s,
        "generated_tokens_per_s": stats.decode_tokens / generate_s,
        "total_tokens_per_s": (stats.prefill_tokens + stats.decode_tokens) / generate_s,
        "mean_batch": stats.mean_running_batch,
        "max_batch_size": model.engine.max_batch_size,
        "max_batch_size_auto": None if model.batch_choice is None else model.batch_choice.as_dict(),
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "evictions": stats.evictions,
        "lora": None if model.engine.adapters is None else {
            "adapters": stats.adapters, "loads": model.engine.adapters.loads,
            "evictions": model.engine.adapters.evictions},
        "speculative": {"method": cfg.speculative.method, "proposed": stats.spec_proposed,
                        "accepted": stats.spec_accepted, "acceptance_rate": stats.spec_acceptance_rate,
                        "mean_accepted": stats.spec_mean_accepted, "forwards_saved": stats.spec_accepted,
                        "step_share": stats.spec_step_share},
        "plan": {"window_rows": cfg.plan.window_rows, "prefix_sort": cfg.plan.prefix_sort,
                 "windows": state.planner.windows},
        "peak_memory_bytes": _peak_rss_bytes(),
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "weight_bytes": loaded.weight_bytes,
        "weight_bytes_read_per_step": loaded.bytes_read_per_token,
        "weight_read_bandwidth_gb_s": (loaded.bytes_read_per_token * stats.steps / stats.model_time / 1e9
                                       if stats.model_time else 0.0),
        "engine": stats.as_dict(),
        "model": _model_metrics(cfg, inp, model),
        "units_committed": writer.committed_units,
        "units_done_before": len(run_state.mine) - len(run_state.todo),
        "shard": {"index": run_state.shard_index, "count": run_state.num_shards},
        "config_fingerprint": out.fingerprint,
        "version": __version__,
        "config": cfg.resolved,
        "timeseries": recorder.to_json(),
    }


def _model_metrics(cfg: JobConfig, inp: _Input, model: _Model) -> dict[str, Any]:
    """`_metrics.json`'s model: what was loaded, as what model.quant resolved to, and what its kernels ran."""
    loaded, options = model.loaded, model.options
    kernels = _KernelReport.of(loaded.model)  # the run's step counts
    cpu = _cpu_kernels(loaded.model)
    return {"name": inp.model_name, "path": inp.model_path, "loaded_name": loaded.name,
            "dtype": cfg.model_dtype, "quant": options["quant"], "w8a8_rows": options["w8a8_rows"],
            "quant_lm_head": options["quant_lm_head"],
            "kv_cache_dtype": model.kv_dtype,
            "quant_auto": None if model.quant is None else model.quant.as_dict(),
            "kernel_steps": kernels.steps,
            "int8_gemm": kernels.int8_gemm,
            "int8_weight_bound": kernels.weight_bound,
            "native_layer_steps": kernels.native_layer_steps,
            "compiled_layers": kernels.compiled,
            "cpu_kernels": None if cpu is None else cpu.as_dict(),
            "startup_cache": None if model.cache is None else model.cache.as_dict()}


def _write_metrics(cfg: JobConfig, out: _Output, metrics: dict[str, Any], model_name: str,
                   stdout: TextIO) -> None:
    """Write `_metrics.json` (and output.report's report), then `_SUCCESS` once every shard's units are
    committed, and print the summary."""
    from pipeline.perf.report import write_report

    run_state = out.run_state
    out.sink.finish(metrics, metrics_name(run_state.num_shards, run_state.shard_index))
    if cfg.output.report:
        folder = f"{cfg.output.path.rstrip('/')}/{report_dir_name(run_state.num_shards, run_state.shard_index)}"
        keys = ("rows", "prompt_tokens", "computed_prompt_tokens", "cached_tokens", "prefill_lower_bound_tokens",
                "prefill_efficiency", "generated_tokens", "generated_tokens_per_s", "wall_time_s", "mean_batch",
                "preemptions", "evictions", "speculative")
        write_report(folder, metrics["timeseries"], title=f"{model_name}: {cfg.output.path}",
                     summary={k: metrics[k] for k in keys})
    if not run_state.finish():  # `_SUCCESS` once every shard's units are committed
        log.info("%sdone; the output is complete when the other shards are", run_state.shard_label)
    print(summary(metrics), file=stdout, flush=True)


def _check_input(cfg: JobConfig) -> _Input:
    """Everything that can be checked before the output is touched and the weights load: the filesystems,
    the input's files and columns, the model file, and the rows' values the model must accept."""
    check_filesystems(cfg)
    source = open_source(cfg, cfg.task)
    types = source.check_columns(column_specs(cfg))
    ids = source.id_field(cfg.input.id_column, types)
    log.info("input: %d rows in %d files", source.total_rows, len(source.files))
    passthrough = {c: types[c] for c in cfg.input.passthrough_columns}
    model_path, model_name = _model_path(cfg)
    task = row_task(cfg, types, model_path)
    schema = task.schema(ids[1] if ids else pa.string(), passthrough)
    check_model_values(cfg, model_path, types)  # before the output folder is touched and the weights load
    return _Input(source, types, ids, schema, model_path, model_name, task)


def _served_steps_as_worker(cfg: JobConfig, model_path: str) -> bool:
    """Under torchrun, ranks > 0 only serve model steps to rank 0: True once this rank has."""
    if cfg.engine.tensor_parallel <= 1:
        return False
    from pipeline.parallel.runner import serve_as_torchrun_worker

    return serve_as_torchrun_worker(model_path, **_model_options(cfg))


def _open_output(cfg: JobConfig, inp: _Input, resources: contextlib.ExitStack) -> _Output:
    """Take this shard's lease on the output and find its units still to do (`RunState.start`)."""
    source, model_path = inp.source, inp.model_path
    stop = resources.enter_context(GracefulStop(cfg.runtime.grace_s))
    plan = WorkPlan(tuple(InputFile(f.name, f.size, f.num_rows) for f in source.files),
                    window_rows=cfg.plan.window_rows, rows_per_part=cfg.output.rows_per_part)
    columns, batch_rows = job_columns(cfg), cfg.input.batch_rows
    run_state = RunState(cfg.output.path, plan, {**cfg.fingerprint(model_path), "input_content": source.content()},
                         num_shards=cfg.runtime.num_shards, shard_index=cfg.runtime.shard_index,
                         lease_timeout_s=cfg.output.lease_timeout_s, stop=stop,
                         read_input=lambda: ((f.name, b) for f, _, b in source.batches(columns, batch_rows)),
                         on_input_change=cfg.output.on_input_change, inputs=source.urls(),
                         retry_errors=cfg.output.retry_errors)
    fingerprint = run_state.manifest["digest"]
    metadata = {"pipeline.model": inp.model_name, "pipeline.model_path": cfg.model.path or model_path,
                "pipeline.config_fingerprint": fingerprint, "pipeline.version": __version__}
    sink = make_sink(cfg, inp.schema, metadata)
    status = run_state.start(cfg.output.mode)
    resources.callback(run_state.close)  # releases the lease, also on errors and interruptions
    return _Output(stop, run_state, sink, status, fingerprint)


def _nothing_to_do(cfg: JobConfig, out: _Output, stdout: TextIO) -> dict[str, Any]:
    """The end of a run that found this shard's units all committed: `_SUCCESS` if every shard's are."""
    run_state, status = out.run_state, out.status
    done = status == "complete" or run_state.finish()
    if status == "idle":  # e.g. the previous run was killed after its last commit: metrics were not written
        out.sink.finish_once({"rows": 0, "units_committed": 0, "units_done_before": len(run_state.mine),
                              "shard": {"index": run_state.shard_index, "count": run_state.num_shards},
                              "config_fingerprint": out.fingerprint, "version": __version__,
                              "config": cfg.resolved},
                             metrics_name(run_state.num_shards, run_state.shard_index))
    print(f"{run_state.shard_label}nothing to do: "
          f"{'the output is complete' if done else 'this shard is done; other shards are not'}",
          file=stdout, flush=True)
    return {"rows": 0, "status": status, "complete": done}


def _load_model(cfg: JobConfig, model_path: str, types: dict[str, pa.DataType], samples: int,
                resources: contextlib.ExitStack) -> _Model:
    """Load the model as model.quant resolves here (with the hardware probed or read from the startup cache)
    and start its engine, its batch size tuned for the run's `samples` (engine.max_batch_size=auto)."""
    from pipeline.engine.engine import Engine
    from pipeline.parallel.runner import open_model

    cache = _startup_cache(cfg)
    hardware = None
    if cfg.output.report or (cfg.model.quant == "auto" and _auto_keeps_float(cfg) is None):
        from pipeline.perf.probe import hardware_profile

        hardware = hardware_profile(cfg.resolved["hardware"], *([_cached_probe(cache)] if cache else []))
    quant = _choose_quant(cfg, model_path, hardware) if cfg.model.quant == "auto" else None
    measure = _measures_crossover(cfg, quant)
    options = _model_options(cfg, quant, measure)
    kv_dtype = str(options["kv_dtype"]).removeprefix("torch.")
    soon = _vector_isa_soon(cfg, options, cache)
    try:
        sharded = resources.enter_context(open_model(model_path, **options, startup_cache=cache))
    except (OSError, ValueError, KeyError) as e:
        raise JobError(f"cannot load model {model_path}: {e}") from None
    loaded = sharded.loaded
    if measure:
        from pipeline.model.w8a8_crossover import apply_measured_crossover

        quant, crossover = apply_measured_crossover(quant, loaded.model, cfg.engine.batch_limit,
                                                    _cached_crossover(cache, loaded.cache_key))
        options["w8a8_rows"] = quant.w8a8_rows
        log.info("model.quant=auto on this CPU: W8A8 from %s rows; %s", quant.w8a8_rows, crossover.describe())
    _pin_vector_isa(cfg, loaded.model, cache, soon)
    try:
        engine = Engine(loaded, cfg.engine, sharded.make_runner, cfg.speculative,
                        _draft_model(cfg, model_path, loaded), cfg.lora)
    except ValueError as e:
        raise JobError(str(e)) from None
    check_room(cfg, types, engine.max_model_len)  # the KV cache may hold fewer positions than the model has
    # score and embed decode nothing: their steps are prefill chunks, which the token budget sizes
    batch_choice = engine.tune_batch_size(cfg.sampling.max_tokens, samples) if cfg.task == "generate" else None
    if batch_choice is not None:
        log.info("engine.max_batch_size=auto: %d (%s)", batch_choice.batch, batch_choice.reason)
    return _Model(sharded, engine, quant, options, hardware, cache, kv_dtype, batch_choice)


def _roofline(cfg: JobConfig, model: _Model) -> Roofline | None:
    """The report's roofline (output.report): at the int8 peak where the run's steps are W8A8."""
    if not cfg.output.report:
        return None
    from pipeline.model.roofline import Roofline

    options = model.options
    int8 = options["quant"] == "w8a8" or (options["quant"] != "none" and options["w8a8_rows"] is not None
                                           and options["w8a8_rows"] <= model.engine.max_batch_size)
    # W8A8 steps: int8 weights and the int8 peak (where the hardware profile has one)
    int8 = int8 and "int8" in model.hardware.flops
    return Roofline.of(model.loaded.config, model.hardware, cfg.model_dtype, tp=cfg.engine.tensor_parallel,
                       weights="int8" if int8 else None, kv_dtype=model.kv_dtype,
                       compute_dtype="int8" if int8 else None)


def _log_loaded(model: _Model, seconds: float) -> None:
    """What was loaded, in `seconds` since the job started, and which kernels it runs."""
    loaded = model.loaded
    log.info("model %s loaded in %.1f s (%d weight bytes)", loaded.name, seconds, loaded.weight_bytes)
    kernels = _cpu_kernels(loaded.model)
    if kernels is not None:
        log.info("CPU kernels: %s", kernels.line())
    cache = model.cache
    if cache is not None:
        log.info("startup cache %s: %d entries read, %d built", cache.root, cache.read, cache.built)


def _cpu_kernels(model: LlamaModel) -> CpuKernels | None:
    """Which CPU kernels the model runs (`pipeline.model.cpu_kernels`); None on a GPU."""
    if model.norm.weight.device.type != "cpu":
        return None
    from pipeline.model.cpu_kernels import CpuFeatures, cpu_kernels

    return cpu_kernels(model, CpuFeatures.here())
