"""Which input columns a job reads and the types each accepts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.source.files import ColumnSpec
from pipeline.source.prefill_prompts import is_candidates_type
from pipeline.source.sampling_columns import column_type


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t: pa.DataType) -> bool:
    """list<struct<role: string, content: string>>, or JSON text of that list."""
    if _is_text(t):
        return True
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    fields = {f.name: f.type for f in t.value_type}
    return all(_is_text(fields.get(k, pa.null())) for k in ("role", "content"))


def column_specs(cfg: JobConfig) -> list[ColumnSpec]:
    """The columns this job reads, each with the config key that chose it and the types it accepts."""
    inp = cfg.input
    if inp.messages_column:
        prompt = ColumnSpec(inp.messages_column, "input.messages_column", _is_messages,
                            "list<struct<role: string, content: string>> or JSON text")
    else:
        prompt = ColumnSpec(inp.prompt_column, "input.prompt_column", _is_text, "string")
    specs = [prompt, ColumnSpec(inp.id_column, "input.id_column", lambda t: True, "any", required=False)]
    specs += [ColumnSpec(c, "input.passthrough_columns", lambda t: True, "any") for c in inp.passthrough_columns]
    specs += [
        ColumnSpec(c, "input.sampling_columns", *column_type(c), required=False) for c in inp.sampling_columns
    ]
    if inp.lora_column:
        specs.append(ColumnSpec(inp.lora_column, "input.lora_column", _is_text, "string"))
    if cfg.task == "score":
        specs.append(ColumnSpec(inp.candidates_column, "input.candidates_column", is_candidates_type,
                                "string or list<string>"))
    return specs


def read_columns(inp: Mapping[str, Any]) -> list[str]:
    """The columns a job reads, in the order its batches carry them (prompt or messages, id, passthrough,
    sampling, LoRA adapter, candidates; each once). `inp`: the resolved `input` section, as the job and its
    fingerprint hold it."""
    return list(dict.fromkeys([inp["messages_column"] or inp["prompt_column"], inp["id_column"],
                               *inp["passthrough_columns"], *inp["sampling_columns"],
                               *([inp["lora_column"]] if inp.get("lora_column") else []),
                               *([inp["candidates_column"]] if inp.get("candidates_column") else [])]))


def job_columns(cfg: JobConfig) -> list[str]:
    """The columns `cfg`'s job reads: `read_columns` of its input section as its fingerprint holds it, which
    names the candidates column under task=score only (`JobConfig.fingerprint`)."""
    inp = cfg.resolved["input"]
    return read_columns(inp if cfg.task == "score" else {k: v for k, v in inp.items() if k != "candidates_column"})
