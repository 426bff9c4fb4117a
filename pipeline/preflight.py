"""What a job checks before its model loads and before its output folder is touched.

Why: a config-level value that only the model can judge (a `sampling.regex` against its vocabulary, a
`logit_bias` id, a chat template, `max_tokens` against its length) used to turn every row into an error
row and exit 0, or to fail only once the weights had loaded. The model's shape (GGUF metadata or
config.json) and its tokenizer load in seconds without the weights, so each such mistake is one line and
exit 2 (`JobError`) at start. Values given per row (columns) are still judged per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec

from pipeline.config import JobConfig
from pipeline.errors import JobError
from pipeline.model.config import ModelConfig
from pipeline.source.prompts import chat_tokenizer

if TYPE_CHECKING:
    from pipeline.model.tokenizer import Tokenizer


def _protocols(url: str) -> list[str]:
    """The fsspec protocols a path names: none for a local path, `s3` for `s3://b/k`, both of a chained
    `simplecache::s3://b/k`."""
    *chain, last = url.split("::")
    return [*chain, *([last.split("://", 1)[0]] if "://" in last else [])]


def check_filesystems(cfg: JobConfig) -> None:
    """Every fsspec URL of the job has its backend installed: `s3://` without s3fs is one line naming the
    package, not a traceback from the first read or write."""
    inputs = cfg.input.path if isinstance(cfg.input.path, list) else [cfg.input.path]
    named = [*(("input.path", p) for p in inputs), ("output.path", cfg.output.path), ("model.path", cfg.model.path)]
    for key, url in named:
        for protocol in _protocols(url or ""):
            try:
                fsspec.get_filesystem_class(protocol)
            except (ImportError, ValueError) as e:  # fsspec's message names the package to install
                raise JobError(f"invalid config `{key}`: {url!r}: {e}") from None


def check_model_values(cfg: JobConfig, model_path: str, columns: Mapping[str, Any]) -> None:
    """The config's values against the model's shape and tokenizer (no weights read). `columns` are the
    input columns the job reads: a `max_tokens` column may make room that `sampling.max_tokens` does not."""
    from pipeline.perf.roofline_cli import read_model

    try:
        shape, load_tokenizer = read_model(model_path)
        tokenizer = load_tokenizer()
    except (OSError, ValueError, KeyError) as e:
        raise JobError(f"cannot load model {model_path}: {e}") from None
    _check_kv_budget(cfg, shape)
    max_len = cfg.engine.max_model_len or shape.max_position_embeddings
    if max_len > shape.max_position_embeddings:
        raise JobError(f"engine.max_model_len={max_len} exceeds the model's {shape.max_position_embeddings} "
                       "positions")
    check_room(cfg, columns, max_len)
    _check_sampling(cfg, shape, tokenizer)
    _check_template(cfg, tokenizer)
    _check_adapters(cfg, shape)
    draft = cfg.speculative.draft.path
    if cfg.speculative.method == "draft" and draft is not None and not Path(draft).exists():
        raise JobError(f"draft model file not found: speculative.draft.path={draft!r}")


def check_room(cfg: JobConfig, columns: Mapping[str, Any], max_model_len: int) -> None:
    """`sampling.max_tokens` leaves room for a prompt in `max_model_len`: before the load against the model's
    positions, after it against the engine's length (which the KV cache may shorten). Only generation keeps
    room for tokens after the prompt."""
    if cfg.task == "generate" and cfg.sampling.max_tokens >= max_model_len and "max_tokens" not in columns:
        raise JobError(f"sampling.max_tokens={cfg.sampling.max_tokens} leaves no room for a prompt in "
                       f"max_model_len={max_model_len}: every row would be an error row")


def _check_kv_budget(cfg: JobConfig, shape: ModelConfig) -> None:
    """`engine.kv_cache_memory` must hold at least one block (a typo such as `1KB`)."""
    from pipeline.model.roofline import kv_bytes_per_token

    block = kv_bytes_per_token(shape, cfg.model_dtype, cfg.engine.tensor_parallel) * cfg.engine.block_size
    if cfg.engine.kv_cache_bytes < block:
        raise JobError(f"engine.kv_cache_memory={cfg.engine.kv_cache_memory!r} is less than one KV cache block of "
                       f"this model ({block:,} bytes for engine.block_size={cfg.engine.block_size} tokens)")


def _check_sampling(cfg: JobConfig, shape: ModelConfig, tokenizer: Tokenizer) -> None:
    """Token ids within the vocabulary, a constraint that compiles against it, and `n` samples that fit one
    batch: each a problem the engine would report for every row."""
    sampling = cfg.sampling
    problem = sampling.token_id_problem(shape.vocab_size)
    if problem is None and sampling.constrained:
        from pipeline.engine.constraints import Constraints

        try:
            Constraints(tokenizer.hf.to_str(), shape.vocab_size, tokenizer.eos_token_ids).matcher(sampling)
        except ValueError as e:
            problem = str(e)
    if problem is None and sampling.n > cfg.engine.batch_limit:
        problem = f"n={sampling.n} exceeds engine.max_batch_size={cfg.engine.batch_limit}"
    if problem is not None:
        raise JobError(f"invalid config `sampling`: {problem}")


def _check_template(cfg: JobConfig, tokenizer: Tokenizer) -> None:
    """The job's own template compiles (`chat_tokenizer`), or else the model has one where rows render with it."""
    inp = cfg.input
    if isinstance(inp.chat_template, str):
        chat_tokenizer(tokenizer, inp)
    elif (inp.messages_column or inp.chat_template) and tokenizer.chat_template is None:
        raise JobError(f"{'input.messages_column' if inp.messages_column else 'input.chat_template=true'} renders "
                       "with the model's chat template, and this model has none: give input.chat_template a "
                       "template (or its file), or set input.chat_template=false for raw prompts")


def _check_adapters(cfg: JobConfig, shape: ModelConfig) -> None:
    """Each adapter of model.lora.adapters is a PEFT LoRA checkpoint this model can take (a row's own
    adapter, named by its folder, is judged per row)."""
    from pipeline.engine.adapters import check_adapter
    from pipeline.model.lora.peft_file import AdapterError

    for name, source in (cfg.model.lora.adapters or {}).items():
        try:
            check_adapter(name, source, shape, cfg.model.cache_dir)
        except AdapterError as e:
            raise JobError(f"invalid config `model.lora.adapters`: {e}") from None
