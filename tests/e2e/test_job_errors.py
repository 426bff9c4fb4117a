"""Job-level errors: a clear message naming the file, column or key, before the model loads.

In-process for each kind of mistake; as a subprocess for what the user sees (exit status, one line on
stderr, no traceback).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_job_config
from pipeline.errors import JobError
from pipeline.job import run
from tests.test_config import compose_job

REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def inputs(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"], "count": [3, 4]}), d / "good.parquet")
    return d


def fails(tmp_path, *overrides) -> str:
    cfg = load_job_config(compose_job(f"output.path={tmp_path}/out", "model.quant=none", *overrides))
    with pytest.raises(JobError) as e:
        run(cfg)
    return str(e.value)


def test_no_file_matches(tmp_path):
    assert fails(tmp_path, f"input.path={tmp_path}/nothing/*.parquet") == (
        f"input.path '{tmp_path}/nothing/*.parquet' matches no files")


def test_corrupt_parquet(tmp_path, inputs):
    (inputs / "bad.parquet").write_bytes(b"definitely not parquet")
    assert fails(tmp_path, f"input.path={inputs}").startswith("cannot read Parquet file bad.parquet: ")


def test_missing_prompt_column_lists_the_available_ones(tmp_path, inputs):
    assert fails(tmp_path, f"input.path={inputs}", "input.prompt_column=question") == (
        "good.parquet: no column 'question' (set by input.prompt_column); available columns: id, prompt, count")


def test_missing_passthrough_column(tmp_path, inputs):
    assert "no column 'lang' (set by input.passthrough_columns)" in fails(
        tmp_path, f"input.path={inputs}", "input.passthrough_columns=[lang]")


@pytest.mark.parametrize("override, words", [
    ("input.prompt_column=count", "column 'count' (input.prompt_column) has type int64, expected string"),
    ("input.messages_column=prompt", None),  # JSON text is a valid messages column
    ("input.messages_column=count", "column 'count' (input.messages_column) has type int64, expected list<struct"),
])
def test_wrong_column_type(tmp_path, inputs, override, words):
    if words is None:  # reaches the model check instead
        assert "model file not found" in fails(tmp_path, f"input.path={inputs}", override, "model.path=/no.gguf")
    else:
        assert words in fails(tmp_path, f"input.path={inputs}", override)


def test_wrong_sampling_column_type(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"], "temperature": ["hot"]}), tmp_path / "t.parquet")
    assert "column 'temperature' (input.sampling_columns) has type string, expected a number" in fails(
        tmp_path, f"input.path={tmp_path}/t.parquet")


def test_missing_model_file_fails_before_loading(tmp_path, inputs):
    assert fails(tmp_path, f"input.path={inputs}", "model.path=/models/nope.gguf") == (
        "model file not found: model.path='/models/nope.gguf'")
    assert not (tmp_path / "out").exists()  # checked before the output was touched


def test_id_column_in_some_files_only(tmp_path, inputs):
    pq.write_table(pa.table({"prompt": ["c"]}), inputs / "other.parquet")
    assert fails(tmp_path, f"input.path={inputs}") == (
        "other.parquet: no id column 'id' (input.id_column) although good.parquet has one")


def test_output_path_is_a_file(tmp_path, inputs):
    (tmp_path / "out").write_text("")
    assert "is a file" in fails(tmp_path, f"input.path={inputs}")


@pytest.fixture
def no_model_load(monkeypatch):
    """The weights must never load: these mistakes are found from the model's shape and tokenizer alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("pipeline.parallel.runner.open_model", refuse)


@pytest.mark.parametrize("overrides, words", [
    (["sampling.regex='[a-'"], "invalid config `sampling`: regex cannot be used: "),
    (["sampling.json_schema='{\"type\": 3}'"], "invalid config `sampling`: json_schema"),
    (["sampling.logit_bias={99999: 1}"], "invalid config `sampling`: logit_bias has token ids outside 0..49151: "
                                         "[99999]"),
    (["sampling.stop_token_ids=[49152]"], "invalid config `sampling`: stop_token_ids has token ids outside"),
    (["sampling.n=8", "engine.max_batch_size=4"], "invalid config `sampling`: n=8 exceeds engine.max_batch_size=4"),
    (["sampling.max_tokens=2048"], "sampling.max_tokens=2048 leaves no room for a prompt in max_model_len=2048: "
                                   "every row would be an error row"),
    (["engine.max_model_len=4096"], "engine.max_model_len=4096 exceeds the model's 2048 positions"),
    (["input.chat_template='{{ oops'"], "invalid config `input.chat_template`: input.chat_template: chat template "
                                        "does not compile: "),
    (["speculative.method=draft", "speculative.draft.path=/no/draft.gguf"],
     "draft model file not found: speculative.draft.path='/no/draft.gguf'"),
])
def test_config_values_the_model_judges_fail_before_it_loads(tmp_path, inputs, tiny_model_dir, no_model_load,
                                                            overrides, words):
    """Each used to make every row an error row (exit 0, `_SUCCESS`) or to fail after the weights loaded."""
    message = fails(tmp_path, f"input.path={inputs}", f"model.path={tiny_model_dir}", *overrides)
    assert message.startswith(words) and "\n" not in message
    assert not (tmp_path / "out").exists()  # nothing created in the output folder


def test_a_model_without_a_chat_template_needs_raw_prompts(tmp_path, inputs, tiny_model_dir, no_model_load):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        (model / f.name).symlink_to(f)
    (model / "tokenizer_config.json").unlink()
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    assert "this model has none" in fails(tmp_path, f"input.path={inputs}", f"model.path={model}")
    assert "this model has none" in fails(tmp_path, f"input.path={inputs}", f"model.path={model}",
                                          "input.chat_template=false", "input.messages_column=prompt")
    assert not (tmp_path / "out").exists()


def test_a_url_whose_fsspec_backend_is_missing_names_the_package(tmp_path, inputs):
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    assert fails(tmp_path, f"input.path={inputs}", "model.path=gs://models/m.gguf") == (
        "invalid config `model.path`: 'gs://models/m.gguf': Please install gcsfs to access Google Storage")
    assert fails(tmp_path, "input.path=[data/a.parquet,gs://b/in/]").startswith(
        "invalid config `input.path`: 'gs://b/in/': Please install gcsfs")
    assert fails(tmp_path, f"input.path={inputs}", "output.path=simplecache::gs://b/out").startswith(
        "invalid config `output.path`: 'simplecache::gs://b/out': Please install gcsfs")


def cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("args, status, words", [
    (["input.path=nowhere/*.parquet"], 2, "error: input.path 'nowhere/*.parquet' matches no files"),
    (["sampling.temperature=-2"], 2, "error: invalid config `sampling`: invalid sampling parameters: "
                                     "temperature must be a finite number >= 0, got -2"),
    (["sampling.tempreature=0.5"], 1, "Key 'tempreature' not in 'SamplingSection'"),
    (["conf=missing.yaml"], 2, "error: job file not found: conf=missing.yaml"),
    ([f"input.path={REPO}/data/sample", "sampling.regex='[a-'", "output.path=out"], 2,
     "error: invalid config `sampling`: regex cannot be used: "),  # llguidance's error spans lines
])
def test_cli_prints_one_clear_message(tmp_path, args, status, words):
    done = cli(*args, cwd=tmp_path)
    assert done.returncode == status, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr + done.stdout
    if status == 2:
        assert done.stderr.strip().count("\n") == 0  # one line
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_job_file_then_overrides(tmp_path, tiny_model_dir):
    """`conf=job.yaml` merges over the defaults; command-line overrides win over the file."""
    pq.write_table(pa.table({"id": [7, 8, 9], "prompt": ["a", "b", "c"]}), tmp_path / "in.parquet")
    (tmp_path / "job.yaml").write_text(
        f"input:\n  path: {tmp_path}/in.parquet\noutput:\n  path: {tmp_path}/out\n"
        f"model:\n  path: {tiny_model_dir}\n  name: tiny\n"
        "sampling:\n  max_tokens: 3\n  ignore_eos: true\nengine:\n  kv_cache_memory: 16MiB\n"
        "progress:\n  log_every_s: 0.001\n")
    done = cli(f"conf={tmp_path}/job.yaml", "sampling.max_tokens=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    df = pl.read_parquet(tmp_path / "out" / "*.parquet").sort("id")
    assert df["id"].to_list() == [7, 8, 9] and df["completion_tokens"].to_list() == [2, 2, 2]
    assert pq.read_metadata(next((tmp_path / "out").glob("part-*.parquet"))).metadata[b"pipeline.model"] == b"tiny"
    assert "rows 3/3 (100.0%)" in done.stdout  # not a terminal: log lines, not a bar
