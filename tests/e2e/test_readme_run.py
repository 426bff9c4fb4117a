"""The README's quick-start command, as a user runs it: a subprocess on the real SmolLM2 and data/sample;
every row comes back once, in the default (fast) mode and in the exact one, whose first rows' tokens are the
plain greedy decode of their chat prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from pipeline.model.loader import load_model
from tests.reference import assert_only_near_ties, greedy_decode

REPO = Path(__file__).resolve().parents[2]


def readme_run(tmp_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The README's command on data/sample, 4 greedy tokens per row, with `extra` overrides."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "input.path=data/sample/*.parquet", f"output.path={out}",
         "model=smollm2-135m", "sampling.max_tokens=4", "sampling.temperature=0", "engine.max_batch_size=64",
         "output.token_ids=true", f"hydra.run.dir={tmp_path}/hydra", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )


def first_tokens_reference(want: pl.DataFrame, smollm2_path: Path) -> tuple[dict, object]:
    """The float model's plain greedy decode of the first 6 sample rows' chat prompts, by id."""
    loaded = load_model(smollm2_path)
    tok = loaded.tokenizer
    first = want.head(6)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in first["prompt"]]
    return dict(zip(first["id"], greedy_decode(loaded.model, prompts, 4, tok.eos_token_ids))), loaded


@pytest.mark.slow
def test_readme_command_on_smollm2(tmp_path, smollm2_path):
    """The defaults (model.quant=auto): every row once, the mode and its reason in the metrics and the log;
    then model.quant=none: the float model's tokens but for near-ties, and the first tokens of most rows
    the fast run's."""
    out = tmp_path / "run1"
    done = readme_run(tmp_path, out)
    assert done.returncode == 0, done.stderr[-3000:]
    got = pl.read_parquet(out / "*.parquet").sort("id")
    want = pl.read_parquet(REPO / "data/sample/*.parquet").sort("id")
    assert got["id"].to_list() == want["id"].to_list()  # every row once, same ids
    assert got["error"].null_count() == len(got) and (got["completion_tokens"] >= 1).all()
    reference, loaded = first_tokens_reference(want, smollm2_path)
    tok = loaded.tokenizer
    assert got["text"].to_list() == [tok.decode(ids) for ids in got["token_ids"].to_list()]
    metrics = json.loads((out / "_metrics.json").read_text())
    assert metrics["rows"] == len(want) and metrics["generated_tokens"] == got["completion_tokens"].sum()
    assert metrics["model"]["quant_auto"]["reason"] and metrics["model"]["quant"] != "none"
    assert "model.quant=auto -> " in done.stdout  # the log goes to stdout with the progress lines
    fast = got["token_ids"].to_list()
    # stdout is a pipe, not a terminal: plain progress lines, then the summary table
    assert f"rows {len(want)}/{len(want)} (100.0%)" in done.stdout
    assert "weight-read bw" in done.stdout

    exact = tmp_path / "exact"
    done = readme_run(tmp_path, exact, "model.quant=none")
    assert done.returncode == 0, done.stderr[-3000:]
    got = pl.read_parquet(exact / "*.parquet").sort("id")
    assert_only_near_ties(reference, dict(zip(got["id"], got["token_ids"].to_list())), epsilon=1e-3)
    # quantized weights, activations and KV cache: most rows still start as the float model's do (176 of
    # the 200 sample rows on a Xeon with AMX)
    same_first = sum(a[0] == b[0] for a, b in zip(fast, got["token_ids"].to_list()))
    assert same_first >= 0.75 * len(fast)
