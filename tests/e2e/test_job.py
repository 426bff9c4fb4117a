"""Whole runs of the job on the tiny random model (fast), in-process through `pipeline.job.run`."""

from __future__ import annotations

import io
import json
import logging
import re
import threading

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import kernels.wq_cpu
from kernels.dispatch import w8a8_weight_bound
from pipeline.config import load_job_config, resolve_kv_dtype
from pipeline.engine import batch_tuning
from pipeline.errors import JobError
from pipeline.job import run
from pipeline.model.loader import load_model
from tests.reference import assert_only_near_ties, greedy, greedy_decode, prompt_logits
from tests.test_config import compose_job

# model.quant=none: the exact float job, which the references here reproduce (a test may name a scheme)
FAST = ("engine.kv_cache_memory=16MiB", "sampling.max_tokens=4", "progress.mode=off", "model.quant=none")


def job(tiny_model_dir, input_path, output_path, *overrides):
    return load_job_config(compose_job(
        f"input.path={input_path}", f"output.path={output_path}", f"model.path={tiny_model_dir}", *FAST, *overrides))


def write_shards(directory, rows_per_shard=(4, 3), **extra_columns):
    """Shards of `id`, `prompt`, `topic` (+ extra columns given as lists over all rows)."""
    directory.mkdir(parents=True, exist_ok=True)
    start = 0
    for shard, n in enumerate(rows_per_shard):
        cols = {"id": list(range(start, start + n)),
                "prompt": [f"Question number {i}: what comes next?" for i in range(start, start + n)],
                "topic": [f"topic-{i % 3}" for i in range(start, start + n)]}
        cols.update({k: v[start:start + n] for k, v in extra_columns.items()})
        pq.write_table(pa.table(cols), directory / f"shard-{shard}.parquet")
        start += n
    return start


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_local_run_writes_every_row_once(tmp_path, tiny_model_dir, tiny_loaded, caplog):
    n_rows = write_shards(tmp_path / "in")
    out, stdout = tmp_path / "out", io.StringIO()
    cfg = job(tiny_model_dir, f"{tmp_path}/in/*.parquet", out, "output.token_ids=true",
              "input.passthrough_columns=[topic]", "progress.mode=log", "progress.log_every_s=0.001")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        metrics = run(cfg, stdout=stdout)

    df = pl.read_parquet(out / "*.parquet").sort("id")
    assert df["id"].to_list() == list(range(n_rows)) and df["id"].dtype == pl.Int64
    assert df["topic"].to_list() == [f"topic-{i % 3}" for i in range(n_rows)]
    assert df.schema["token_ids"] == pl.List(pl.Int32) and df.schema["completion_tokens"] == pl.Int32
    assert df["error"].null_count() == n_rows and set(df["finish_reason"]) <= {"stop", "length"}
    tok = tiny_loaded.tokenizer
    for r in df.iter_rows(named=True):
        assert r["completion_tokens"] == len(r["token_ids"]) <= 4
        assert r["text"] == tok.decode(r["token_ids"])
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Question number {r['id']}: "
                                                                                  "what comes next?"}]))
        assert r["prompt_tokens"] == len(prompt)
        if r["id"] in (0, 5):  # results are matched back to the right row
            assert r["token_ids"] == greedy(tiny_loaded.model, prompt, 4, tiny_loaded.tokenizer.eos_token_ids)

    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 1  # 7 rows < output.rows_per_part
    meta = pq.read_metadata(parts[0]).metadata
    assert meta[b"pipeline.model"] == tiny_model_dir.name.encode() and meta[b"pipeline.version"] == b"0.1.0"
    assert meta[b"pipeline.config_fingerprint"].decode() == json.loads((out / "_job.json").read_text())["digest"]
    on_disk = json.loads((out / "_metrics.json").read_text())
    assert (out / "_SUCCESS").exists()
    assert on_disk["rows"] == on_disk["output_rows"] == n_rows and on_disk["error_rows"] == 0
    assert on_disk["generated_tokens"] == df["completion_tokens"].sum() == metrics["generated_tokens"]
    assert on_disk["prompt_tokens"] == df["prompt_tokens"].sum()
    assert on_disk["weight_bytes"] == tiny_loaded.weight_bytes and on_disk["steps"] > 0
    # engine.max_batch_size=auto (the default): 7 rows are no job to measure for; 16 is the only size to try
    assert on_disk["max_batch_size"] == on_disk["max_batch_size_auto"]["batch"] == 16
    assert on_disk["max_batch_size_auto"]["decode_tokens_per_s"] == {}
    for key in ("wall_time_s", "generated_tokens_per_s", "mean_batch", "preemptions", "peak_memory_bytes",
                "weight_read_bandwidth_gb_s", "cached_tokens", "config_fingerprint"):
        assert key in on_disk
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rows ")]
    assert lines[-1].startswith(f"rows {n_rows}/{n_rows} (100.0%) | gen ")
    assert "rows" in stdout.getvalue() and "weight-read bw" in stdout.getvalue()  # the summary table


def test_auto_batch_size_is_measured_and_reported(tmp_path, tiny_model_dir, caplog, monkeypatch):
    """40 rows: sizes 16 and 32 are timed; the pick, its figures and why are in the log and the metrics, and
    the run's own steps start after the measuring ones."""
    monkeypatch.setattr(batch_tuning, "SHORT_RUN_TOKENS", 0)  # a short run is otherwise not measured
    write_shards(tmp_path / "in", rows_per_shard=(20, 20))
    cfg = job(tiny_model_dir, f"{tmp_path}/in/*.parquet", tmp_path / "out")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        metrics = run(cfg, stdout=io.StringIO())
    auto = metrics["max_batch_size_auto"]
    assert set(auto["decode_tokens_per_s"]) == {"16", "32"} and metrics["max_batch_size"] == auto["batch"]
    assert auto["decode_tokens_per_s"][str(auto["batch"])] >= 0.95 * max(auto["decode_tokens_per_s"].values())
    completions = pl.read_parquet(tmp_path / "out" / "*.parquet")["completion_tokens"].sum()
    assert metrics["generated_tokens"] == metrics["engine"]["decode_tokens"] == completions  # not the measuring's
    assert any(r.getMessage().startswith(f"engine.max_batch_size=auto: {auto['batch']} (measured")
               for r in caplog.records)


def test_memory_filesystem_end_to_end(tiny_model_dir):
    fs = fsspec.filesystem("memory")
    try:
        for shard, ids in enumerate(([10, 11], [12])):
            with fs.open(f"/e2e/in/s{shard}.parquet", "wb") as f:
                pq.write_table(pa.table({"id": ids, "prompt": ["Say hello."] * len(ids)}), f)
        run(job(tiny_model_dir, "memory://e2e/in", "memory://e2e/out", "output.allow_ephemeral=true"),
            stdout=io.StringIO())
        listing = fs.ls("/e2e/out", detail=False)
        assert {"/e2e/out/_metrics.json", "/e2e/out/_SUCCESS"} <= set(listing)
        parts = [p for p in listing if p.startswith("/e2e/out/part-")]
        ids = [i for p in parts for i in pl.read_parquet(fs.cat_file(p))["id"].to_list()]
        assert sorted(ids) == [10, 11, 12]
    finally:
        fs.rm("/e2e", recursive=True)


def test_row_errors_do_not_stop_the_run(tmp_path, tiny_model_dir):
    long = "many words " * 100
    cases = [  # (id, prompt, max_tokens, temperature, top_p, expected error or None)
        ("ok", "fine", None, None, None, None),
        ("null", None, None, None, None, "prompt is null"),
        ("empty", "", None, None, None, "prompt is empty"),
        ("long", long, None, None, None, "max_model_len=64 - max_tokens=4 allows 60"),
        ("cold", "fine", None, -1.0, None, "temperature must be a finite number >= 0"),
        ("none", "fine", 0, None, None, "max_tokens must be an integer >= 1"),
        ("top", "fine", None, None, 7.0, "top_p must be in (0, 1]"),
        (None, "fine", None, None, None, "id is null"),
        ("short", "fine", 2, None, None, None),
    ]
    ids, prompts, max_tokens, temperature, top_p, expected = (list(c) for c in zip(*cases))
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(prompts, pa.string()),
                             "max_tokens": pa.array(max_tokens, pa.int64()), "temperature": temperature,
                             "top_p": top_p}), tmp_path / "in.parquet")
    metrics = run(job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "engine.max_model_len=64",
                      "input.chat_template=false", "sampling.ignore_eos=true"), stdout=io.StringIO())
    df = pl.read_parquet(tmp_path / "out" / "*.parquet")
    got = {r["id"]: r for r in df.iter_rows(named=True)}
    assert len(df) == len(cases) and set(got) == set(ids)
    for row_id, words in zip(ids, expected):
        r = got[row_id]
        if words is None:
            assert r["error"] is None and r["finish_reason"] == "length" and r["text"] is not None
        else:
            assert words in r["error"] and r["finish_reason"] == "error" and r["text"] is None
    assert got["ok"]["completion_tokens"] == 4 and got["short"]["completion_tokens"] == 2  # per-row max_tokens
    assert got["long"]["prompt_tokens"] > 60  # the over-long prompt's real length is reported
    assert metrics["error_rows"] == 7 and metrics["rows"] == len(cases)


def test_messages_rows_and_their_errors(tmp_path, tiny_model_dir):
    good = json.dumps([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    messages = [good, "[{broken", json.dumps([{"role": "robot", "content": "x"}]), json.dumps([]), None,
                json.dumps([{"role": "user"}])]
    pq.write_table(pa.table({"messages": pa.array(messages, pa.string())}), tmp_path / "chat.parquet")
    run(job(tiny_model_dir, tmp_path / "chat.parquet", tmp_path / "out", "input.messages_column=messages"),
        stdout=io.StringIO())
    df = pl.read_parquet(tmp_path / "out" / "*.parquet").sort("id")
    assert df["id"].to_list() == [f"chat.parquet:{i}" for i in range(6)]  # no id column: <file>:<row>
    errors = df["error"].to_list()
    assert errors[0] is None
    for got, words in zip(errors[1:], ["not valid JSON", "unknown role 'robot'", "messages is an empty list",
                                       "messages is null", "item 0 (user) has no text content"]):
        assert words in got


def test_n_samples_and_parts(tmp_path, tiny_model_dir):
    n_rows = write_shards(tmp_path / "in", (5,), prompt_override=[None] * 5)
    pq.write_table(pa.table({"id": [99], "prompt": pa.array([None], pa.string()), "topic": ["t"],
                             "prompt_override": pa.array([None], pa.null())}), tmp_path / "in" / "z.parquet")
    cfg = job(tiny_model_dir, tmp_path / "in", tmp_path / "out", "sampling.n=2", "sampling.temperature=0.9",
              "sampling.seed=3", "output.rows_per_part=4")
    metrics = run(cfg, stdout=io.StringIO())
    df = pl.read_parquet(tmp_path / "out" / "*.parquet")
    assert len(df) == 2 * (n_rows + 1)
    assert metrics["units_committed"] == 2 == len(list((tmp_path / "out").glob("part-*.parquet")))  # 4 + 2 rows
    per_id = df.group_by("id").agg(pl.col("sample_index").sort()).sort("id")
    assert per_id["sample_index"].to_list() == [[0, 1]] * (n_rows + 1)
    assert df.filter(pl.col("id") == 99)["finish_reason"].to_list() == ["error", "error"]


def test_bar_progress_on_captured_output(tmp_path, tiny_model_dir):
    write_shards(tmp_path / "in")
    stdout = io.StringIO()
    run(job(tiny_model_dir, tmp_path / "in", tmp_path / "out", "progress.mode=bar"), stdout=stdout)
    text = stdout.getvalue()
    assert "7/7" in text and "row" in text and "tok/s" in text and "cached" in text


def test_greedy_outputs_do_not_depend_on_batching(tmp_path, tiny_model_dir):
    write_shards(tmp_path / "in", (6,))
    texts = []
    for batch in (1, 6):
        out = tmp_path / f"out{batch}"
        run(job(tiny_model_dir, tmp_path / "in", out, f"engine.max_batch_size={batch}"), stdout=io.StringIO())
        texts.append(pl.read_parquet(out / "*.parquet").sort("id")["text"].to_list())
    assert texts[0] == texts[1]


def test_sample_data_as_chat_messages(tmp_path, tiny_model_dir):
    """data/sample's `messages` column (list<struct<role, content>>, shared system prompts) runs whole."""
    run(job(tiny_model_dir, "data/sample", tmp_path / "out", "input.messages_column=messages",
            "input.passthrough_columns=[topic]", "sampling.max_tokens=2"), stdout=io.StringIO())
    got = pl.read_parquet(tmp_path / "out" / "*.parquet").sort("id")
    want = pl.read_parquet("data/sample/*.parquet").sort("id")
    assert got["id"].to_list() == want["id"].to_list() and got["topic"].to_list() == want["topic"].to_list()
    assert got["error"].null_count() == len(want)
    assert got["cached_tokens"].sum() > 0  # rows share system prompts


def test_logprobs_column(tmp_path, tiny_model_dir, tiny_loaded):
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["Tell me a story.", "Count to three."]}), tmp_path / "in.parquet")
    run(job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "sampling.logprobs=3",
            "sampling.prompt_logprobs=1", "output.token_ids=true", "input.chat_template=false"), stdout=io.StringIO())
    table = pq.read_table(next((tmp_path / "out").glob("part-*.parquet")))
    assert table.schema.field("logprobs").type == pa.list_(pa.map_(pa.int32(), pa.float32()))
    for r in table.to_pylist():
        steps = [dict(m) for m in r["logprobs"]]
        assert len(steps) == r["completion_tokens"] == len(r["token_ids"])
        texts = [dict(m) for m in r["logprob_tokens"]]
        assert [t.keys() for t in texts] == [s.keys() for s in steps]
        assert all(text == tiny_loaded.tokenizer.decode([t], skip_special_tokens=False)
                   for step in texts for t, text in step.items())
        for token, step in zip(r["token_ids"], steps):
            assert max(step, key=step.get) == token  # greedy picks the most likely token
        prompt = tiny_loaded.tokenizer.encode(["Tell me a story.", "Count to three."][r["id"] - 1])
        # the first step against a plain forward pass
        ref = torch.log_softmax(prompt_logits(tiny_loaded.model, prompt)[-1], -1).topk(3)
        assert sorted(steps[0]) == sorted(ref.indices.tolist())
        scored = r["prompt_logprobs"]  # the engine's figures are tested in tests/engine/test_engine.py
        assert len(scored) == r["prompt_tokens"] and scored[0] is None
        assert all(prompt[p] in dict(scored[p]) for p in range(1, len(prompt)))
        assert [steps[0][i] for i in ref.indices.tolist()] == pytest.approx(ref.values.tolist(), abs=1e-4)


def test_list_and_map_sampling_columns(tmp_path, tiny_model_dir, tiny_loaded):
    """Arrow list and map columns override per row; a row's logit_bias of -100 on the greedy token it would
    pick moves it off that token, and a bad row becomes an error row naming the column."""
    prompt = "Tell me a story."
    plain = greedy(tiny_loaded.model, tiny_loaded.tokenizer.encode(prompt), 1)[0]
    bias = pa.array([[(plain, -100.0)], None, [(plain, 500.0)]], pa.map_(pa.int64(), pa.float64()))
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": [prompt] * 3, "logit_bias": bias,
                             "stop_token_ids": pa.array([None, [plain], None], pa.list_(pa.int64()))}),
                   tmp_path / "in.parquet")
    run(job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "sampling.max_tokens=3",
            "output.token_ids=true", "input.chat_template=false",
            "input.sampling_columns=[logit_bias,stop_token_ids]"), stdout=io.StringIO())
    rows = {r["id"]: r for r in pq.read_table(next((tmp_path / "out").glob("part-*.parquet"))).to_pylist()}
    assert rows[1]["token_ids"][0] != plain and rows[1]["error"] is None
    assert rows[2]["token_ids"] == [plain] and rows[2]["finish_reason"] == "stop"
    assert rows[3]["finish_reason"] == "error" and "column 'logit_bias'" in rows[3]["error"]


def test_values_a_row_gives_that_the_engine_refuses_are_error_rows_naming_the_row(tmp_path, tiny_model_dir):
    """A row's own regex that does not compile, or logit_bias id outside the vocabulary: the engine refuses
    the row; the output row has null text and says which input row, not the engine's request number. Given
    in the config instead, the same values stop the job at start (tests/e2e/test_job_errors.py)."""
    bias = pa.array([None, None, [(99999, 1.0)]], pa.map_(pa.int64(), pa.float64()))
    pq.write_table(pa.table({"id": [5, 6, 7], "prompt": ["a", "b", "c"], "regex": [None, "[a-", None],
                             "logit_bias": bias}), tmp_path / "in.parquet")
    run(job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "sampling.n=2",
            "input.sampling_columns=[regex,logit_bias]"), stdout=io.StringIO())
    rows = pl.read_parquet(tmp_path / "out" / "*.parquet").sort(["id", "sample_index"]).to_dicts()
    assert [r["finish_reason"] == "error" for r in rows] == [False, False, True, True, True, True]
    for r in rows[2:]:
        assert r["text"] is None and r["completion_tokens"] == 0
    assert rows[2]["error"].startswith("row 1 of in.parquet (id 6): regex cannot be used: ")
    assert rows[4]["error"] == "row 2 of in.parquet (id 7): logit_bias has token ids outside 0..49151: [99999]"


def test_model_path_as_a_file_url(tmp_path, tiny_model_dir):
    """`file://` works for model.path as it does for input.path and output.path."""
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), tmp_path / "in.parquet")
    metrics = run(job(f"file://{tiny_model_dir}", f"file://{tmp_path}/in.parquet", f"file://{tmp_path}/out"),
                  stdout=io.StringIO())
    assert metrics["rows"] == 1 and metrics["error_rows"] == 0 and metrics["model"]["path"] == str(tiny_model_dir)


def test_first_progress_line_and_sample_come_before_any_row_finishes(tmp_path, tiny_model_dir, caplog):
    """One row of 4 tokens finishes at the 4th step; the progress line and the report's sample follow every
    step (an interval of a nanosecond has always passed by the end of a step), so the first of each shows
    0 rows done. They used to wait for the first finished row."""
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), tmp_path / "in.parquet")
    cfg = job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "sampling.ignore_eos=true",
              "progress.mode=log", "progress.log_every_s=1e-9", "output.report_interval_s=1e-9")
    with caplog.at_level(logging.INFO, logger="pipeline"):
        metrics = run(cfg, stdout=io.StringIO())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rows ")]
    assert lines[0].startswith("rows 0/1 (0.0%) | gen ") and lines[-1].startswith("rows 1/1 (100.0%)")
    assert metrics["timeseries"]["series"]["rows_done"][0] == 0


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_model_through_the_job(tmp_path, tiny_model_dir, tiny_loaded, quant):
    """`model.quant` reaches the loader: fewer weight bytes, and the job's tokens are the plain greedy
    decode of the same quantized model. A weight-only scheme means only that by default: float activations
    at every batch size (no W8A8 steps), a float32 KV cache as the reference keeps its keys, eager layers."""
    n_rows = write_shards(tmp_path / "in")
    out = tmp_path / "out"
    metrics = run(job(tiny_model_dir, f"{tmp_path}/in/*.parquet", out, f"model.quant={quant}", "output.token_ids=true"),
                  stdout=io.StringIO())
    assert metrics["model"]["kv_cache_dtype"] == "float32" and metrics["model"]["w8a8_rows"] is None
    assert not metrics["model"]["compiled_layers"]
    assert metrics["weight_bytes"] < tiny_loaded.weight_bytes
    assert metrics["model"]["kernel_steps"] == {quant: metrics["steps"]}
    df = pl.read_parquet(out / "*.parquet").sort("id")
    assert df["id"].to_list() == list(range(n_rows)) and df["error"].null_count() == n_rows
    quantized = load_model(tiny_model_dir, quant=quant)
    tok = quantized.tokenizer
    row = df.row(0, named=True)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Question number 0: what comes next?"}]))
    assert row["token_ids"] == greedy(quantized.model, prompt, 4, quantized.tokenizer.eos_token_ids)


# Fixed figures instead of the probe: int8 4x the bf16 peak, so W8A8 wins from a few rows on.
HARDWARE = ("hardware.probe=false", "hardware.bandwidth_tbs=0.02", "hardware.memory_gb=16",
            "hardware.peak_tflops.fp32=0.1", "hardware.peak_tflops.bf16=0.2", "hardware.peak_tflops.int8=0.8")


def test_a_second_auto_start_reads_what_the_first_derived(tmp_path, tiny_model_dir, monkeypatch):
    """model.quant=auto's first start probes the machine, quantizes and calibrates, times the GEMMs and the
    W8A8 switch point and checks torch.compile's vector instructions; the second reads all of it from the
    startup cache (each of those steps refused here) and writes the same rows."""
    write_shards(tmp_path / "in")
    cache = f"model.startup_cache_dir={tmp_path / 'cache'}"
    args = (tiny_model_dir, f"{tmp_path}/in/*.parquet")
    from pipeline.model import startup_cache

    monkeypatch.setattr(startup_cache, "cpus_busy", lambda: False)  # a quiet machine: no timing is redone
    from pipeline.model import layers

    checked, check = [], layers.vector_isa_ok

    def checked_in_its_thread() -> bool:  # started beside the model's load, not after it
        checked.append(threading.current_thread().name)
        return check()

    monkeypatch.setattr(layers, "vector_isa_ok", checked_in_its_thread)
    first = run(job(*args, tmp_path / "out1", "model.quant=auto", cache, "output.token_ids=true"), stdout=io.StringIO())
    assert len(checked) == 1 and checked[0].startswith("vector-isa")

    def refuse(*a, **k):
        raise AssertionError("a second start must read this from the startup cache")

    from pipeline.model import loader, w8a8_crossover, w8a8_gemm
    from pipeline.perf import probe

    for module, name in [(probe, "probe"), (loader, "load_quantized"), (w8a8_gemm, "alternating_best"),
                         (w8a8_crossover, "measure_crossover"), (layers, "vector_isa_ok")]:
        monkeypatch.setattr(module, name, refuse)
    from torch._inductor import config

    verdict, config.cpp.vec_isa_ok = config.cpp.vec_isa_ok, None  # unset, as in a new process
    try:
        second = run(job(*args, tmp_path / "out2", "model.quant=auto", cache, "output.token_ids=true"),
                     stdout=io.StringIO())
        assert config.cpp.vec_isa_ok == verdict
    finally:
        config.cpp.vec_isa_ok = verdict
    assert second["model"]["quant_auto"] == first["model"]["quant_auto"]
    assert first["model"]["startup_cache"]["entries_read"] == 0 and first["model"]["startup_cache"]["entries_built"] > 0
    assert second["model"]["startup_cache"]["entries_built"] == 0
    assert second["model"]["int8_gemm"] == first["model"]["int8_gemm"]
    rows = [pl.read_parquet(tmp_path / out / "*.parquet").sort("id").select("id", "token_ids") for out in ("out1", "out2")]
    assert rows[0].equals(rows[1])


def test_auto_keeps_the_float_weights_under_tensor_parallelism(tmp_path, tiny_model_dir):
    """Ranks would time kernels apart: auto loads the float model there, with the reason, and the KV cache
    in the model's dtype."""
    from pipeline import job as job_module

    cfg = job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "model.quant=auto", "engine.tensor_parallel=2")
    choice = job_module._choose_quant(cfg, str(tiny_model_dir), None)  # no hardware profile needed
    assert choice.scheme == "none" and "tensor_parallel" in choice.reason
    options = job_module._model_options(cfg, choice)
    assert options["quant"] == "none" and options["kv_dtype"] == torch.float32


@pytest.mark.parametrize("quant", ["w8a8", "auto"])
def test_w8a8_and_auto_through_the_job(tmp_path, tiny_model_dir, quant):
    """W8A8 runs every step in int8 (per-row activation scales: batching does not change a row's
    arithmetic), so the job's tokens are the plain greedy decode of the W8A8 model (with a float32 KV cache,
    as the reference's); auto records its choice and which kernel ran how many steps, and keeps a narrower
    KV cache (int8 where the native attention kernel builds, else bfloat16)."""
    write_shards(tmp_path / "in")
    out = tmp_path / "out"
    exact_kv = ["model.kv_cache_dtype=float32"] if quant == "w8a8" else []
    metrics = run(job(tiny_model_dir, f"{tmp_path}/in/*.parquet", out, f"model.quant={quant}",
                      "output.token_ids=true", *exact_kv, *HARDWARE), stdout=io.StringIO())
    model = metrics["model"]
    assert sum(model["kernel_steps"].values()) == metrics["steps"]
    assert 0 <= model["native_layer_steps"] <= model["kernel_steps"].get("w8a8", 0) + model["kernel_steps"].get("w4a8", 0)
    assert model["compiled_layers"]  # engine.compile=auto compiles quantized models on CPU
    kernels = model["cpu_kernels"]  # which CPU kernels ran, as the start's log line says
    assert kernels["int8_gemm"] == model["int8_gemm"] and kernels["weight_bound"] == model["int8_weight_bound"]
    assert re.match(r"native in (W8A8|weight-only|W8A8 and weight-only) steps, else compiled|compiled \(not native: ",
                    kernels["decoder_layers"]), kernels["decoder_layers"]
    if quant == "auto":
        assert model["quant_auto"]["scheme"] == model["quant"] and model["quant_auto"]["reason"]
        assert model["kv_cache_dtype"] == resolve_kv_dtype("auto", "auto", "float32", "cpu")
        assert model["kv_cache_dtype"] in ("int8", "bfloat16")
        return
    assert model["kernel_steps"] == {"w8a8": metrics["steps"]}
    assert model["int8_weight_bound"] == w8a8_weight_bound(torch.device("cpu"))  # 127, or 63 without VNNI
    reference = load_model(tiny_model_dir, quant="w8a8", quant_lm_head=model["quant_lm_head"])
    tok = reference.tokenizer
    row = pl.read_parquet(out / "*.parquet").sort("id").row(0, named=True)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Question number 0: what comes next?"}]))
    # A difference only where the reference's top two logits tie within the bf16 head's resolution
    # (2**-5 at logits of 4..8; the tiny model's bf16 logits do tie exactly).
    decoded = greedy_decode(reference.model, [prompt], 4, tok.eos_token_ids)[0]
    assert_only_near_ties({0: decoded}, {0: row["token_ids"]}, epsilon=2**-5 + 1e-6)


@pytest.mark.parametrize("int8_tflops", ["0.8", "0.05"])
def test_auto_times_its_crossing_on_the_loaded_model(tmp_path, tiny_model_dir, int8_tflops, caplog, monkeypatch):
    """With the hardware probed (here: every figure given, so the probe has nothing left to measure), a
    weight-only choice is timed against W8A8 on the loaded model, whatever the roofline's crossing (from a
    few rows, or never with a slow int8 peak), and the job runs and records the measured crossing."""
    # the roofline weighs torch's weight-only kernels; where they are slow (AVX2) it reads dequantizing per
    # call as more bytes than int8 and picks W8A8 at every batch, leaving no crossing to time
    monkeypatch.setattr(kernels.wq_cpu, "weight_only_kernels_fast", lambda: True)
    write_shards(tmp_path / "in")
    figures = [f for f in HARDWARE if not f.startswith(("hardware.probe", "hardware.peak_tflops.int8"))]
    with caplog.at_level(logging.INFO, logger="pipeline"):
        metrics = run(job(tiny_model_dir, f"{tmp_path}/in/*.parquet", tmp_path / "out", "model.quant=auto",
                          "hardware.probe=true", f"hardware.peak_tflops.int8={int8_tflops}", *figures),
                      stdout=io.StringIO())
    model = metrics["model"]
    assert model["quant"] == model["quant_auto"]["scheme"]
    # measured faster from one row, W8A8 runs every step and the weight-only layouts are freed
    assert model["quant"] == "int4" or (model["quant"] == "w8a8" and model["w8a8_rows"] == 1)
    assert "; measured W8A8 " in model["quant_auto"]["reason"]
    assert model["w8a8_rows"] == model["quant_auto"]["w8a8_rows"]
    assert "model.quant=auto on this CPU: W8A8 from" in caplog.text
    assert sum(model["kernel_steps"].values()) == metrics["steps"]
    if model["w8a8_rows"] is None:  # weight-only steps: torch's int4 kernel, or the W4A8 GEMM where timed faster
        assert set(model["kernel_steps"]) <= {"int4", "w4a8"}
    elif model["w8a8_rows"] == 1:
        assert model["kernel_steps"] == {"w8a8": metrics["steps"]}


def test_gguf_quant_needs_a_gguf_file(tmp_path, tiny_model_dir):
    write_shards(tmp_path / "in")
    with pytest.raises(JobError, match="gguf"):
        run(job(tiny_model_dir, f"{tmp_path}/in/*.parquet", tmp_path / "out", "model.quant=gguf"),
            stdout=io.StringIO())


CONSTRAINT_SCHEMAS = [
    {"type": "object", "properties": {"label": {"enum": ["pos", "neg", "neutral"]}}, "required": ["label"],
     "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 5},
                                      "ok": {"type": "boolean"}},
     "required": ["score", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
]


def test_constrained_columns_over_100_rows(tmp_path, tiny_model_dir):
    """Per-row json_schema / regex / choice columns, n=2 sampled: every output that is not an error row parses
    and validates against its own row's schema (jsonschema), matches its regex, or is one of its choices."""
    import re

    import jsonschema

    rows = []
    for i in range(100):
        row = {"id": i, "prompt": f"Label item {i} of the list.", "json_schema": None, "regex": None, "choice": None}
        kind = i % 5
        if kind < 3:
            row["json_schema"] = json.dumps(CONSTRAINT_SCHEMAS[kind])
        elif kind == 3:
            row["regex"] = r"[A-Z][a-z]{1,4}-[0-9]{2}"
        else:
            row["choice"] = ["alpha", "beta", "gamma delta"]
        rows.append(row)
    rows[7]["json_schema"] = '{"type": "object", "properties": 5}'  # a schema the grammar cannot compile
    table = pa.Table.from_pylist(rows, pa.schema([("id", pa.int64()), ("prompt", pa.string()),
                                                  ("json_schema", pa.string()), ("regex", pa.string()),
                                                  ("choice", pa.list_(pa.string()))]))
    pq.write_table(table, tmp_path / "in.parquet")
    run(job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "sampling.max_tokens=24", "sampling.n=2",
            "sampling.temperature=0.8", "sampling.seed=5", "output.rows_per_part=25",
            "input.chat_template=false", "input.sampling_columns=[json_schema,regex,choice]"), stdout=io.StringIO())
    out = pl.read_parquet(str(tmp_path / "out" / "*.parquet")).sort(["id", "sample_index"]).to_dicts()
    assert len(out) == 200
    completed = 0
    for r in out:
        source = rows[r["id"]]
        if r["error"] is not None:
            assert r["finish_reason"] in ("error", "incomplete")
            continue
        assert r["finish_reason"] == "stop", r
        completed += 1
        if source["json_schema"]:
            jsonschema.validate(json.loads(r["text"]), json.loads(source["json_schema"]))
        elif source["regex"]:
            assert re.fullmatch(source["regex"], r["text"])
        else:
            assert r["text"] in source["choice"]
    assert completed >= 150  # the constraints are short: most samples finish within 24 tokens
    bad = [r for r in out if r["id"] == 7]
    assert all(r["finish_reason"] == "error" and "json_schema" in r["error"] for r in bad)
