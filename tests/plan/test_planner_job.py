"""Whole runs of the job on the tiny random model with the prefix planner and the prefix cache on and off."""

from __future__ import annotations

import io
import json
import random
import shutil

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_job_config
from pipeline.job import run
from pipeline.plan import window as window_module
from pipeline.plan.prefix import unique_prefix_tokens
from tests.test_config import compose_job

BASE = ("sampling.max_tokens=4", "progress.mode=off", "input.messages_column=messages", "output.token_ids=true",
        "model.quant=none")


def job(model_dir, input_path, output_path, *overrides):
    return load_job_config(compose_job(f"input.path={input_path}", f"output.path={output_path}",
                                       f"model.path={model_dir}", *BASE, *overrides))


def mixed_workload(directory, systems=4, questions=6, unique=8, seed=0) -> int:
    """Rows sharing long system prompts, plus rows with their own prompt, shuffled, in two files."""
    rng = random.Random(seed)
    rows = []
    for s in range(systems):
        system = " ".join(f"Rule {s}.{j}: answer the question briefly, politely and in plain words." for j in range(5))
        for q in range(questions):
            rows.append([{"role": "system", "content": system},
                         {"role": "user", "content": f"What is {q * 7 + s} plus {q + 3}?"}])
    rows += [[{"role": "user", "content": f"Tell me fact number {u} about the {u % 3} moons."}]
             for u in range(unique)]
    rng.shuffle(rows)
    directory.mkdir(parents=True, exist_ok=True)
    half = len(rows) // 2
    for k, part in enumerate((rows[:half], rows[half:])):
        start = k * half
        pq.write_table(pa.table({"id": list(range(start, start + len(part))),
                                 "messages": [json.dumps(m) for m in part]}), directory / f"in-{k}.parquet")
    return len(rows)


def outputs(path) -> dict[int, list[int]]:
    df = pl.read_parquet(path / "part-*.parquet")
    assert df["error"].null_count() == len(df)
    return dict(zip(df["id"].to_list(), df["token_ids"].to_list()))


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixed")
    return directory, mixed_workload(directory)


@pytest.mark.slow
def test_outputs_do_not_depend_on_sorting_or_caching(tmp_path, tiny_model_dir, workload):
    directory, n = workload
    got, metrics = {}, {}
    for caching in (True, False):
        for sort in (True, False):
            out = tmp_path / f"out-{caching}-{sort}"
            metrics[caching, sort] = run(job(tiny_model_dir, directory, out, f"engine.prefix_caching={caching}",
                                             f"plan.prefix_sort={sort}"),
                                         stdout=io.StringIO())
            got[caching, sort] = outputs(out)
    reference = got[False, False]
    assert len(reference) == n
    for key, result in got.items():
        assert result == reference, key
    both, neither = metrics[True, True], metrics[False, False]
    assert both["prompt_tokens"] == neither["prompt_tokens"] == neither["computed_prompt_tokens"]
    assert both["prefill_lower_bound_tokens"] == neither["prefill_lower_bound_tokens"] < both["prompt_tokens"]
    assert both["computed_prompt_tokens"] + both["cached_tokens"] == both["prompt_tokens"]
    # Sorted + cached computes each shared prefix once, except that a row resumes at its last cached *full*
    # block: it recomputes at most block_size - 1 tokens that another row already computed.
    assert both["computed_prompt_tokens"] <= both["prefill_lower_bound_tokens"] + n * 15
    assert both["prefill_efficiency"] == both["prefill_lower_bound_tokens"] / both["computed_prompt_tokens"]
    # With one-token blocks nothing is recomputed at all: exactly the lower bound.
    exact = run(job(tiny_model_dir, directory, tmp_path / "bs1", "engine.block_size=1"), stdout=io.StringIO())
    assert exact["computed_prompt_tokens"] == exact["prefill_lower_bound_tokens"]
    assert exact["prefill_efficiency"] == 1.0 and outputs(tmp_path / "bs1") == reference
    for m in metrics.values():
        assert m["evictions"] >= 0 and m["preemptions"] >= 0 and m["plan"]["windows"] == 1


@pytest.mark.slow
def test_windows_are_bounded_and_units_stay_inside_them(tmp_path, tiny_model_dir, workload, monkeypatch):
    directory, n = workload
    sizes = []
    plan = window_module.WindowPlanner.__call__

    def spy(self, rows):
        sizes.append(len(rows))
        return plan(self, rows)

    monkeypatch.setattr(window_module.WindowPlanner, "__call__", spy)
    out = tmp_path / "out"
    metrics = run(job(tiny_model_dir, directory, out, "plan.window_rows=12", "output.rows_per_part=5"),
                  stdout=io.StringIO())
    windows = -(-n // 12)
    assert sizes == [min(12, n - 12 * w) for w in range(windows)] and metrics["plan"]["windows"] == windows
    for part in out.glob("part-*.parquet"):  # a unit never mixes rows of two windows
        ids = pl.read_parquet(part)["id"].to_list()
        assert len({i // 12 for i in ids}) == 1 and len(ids) <= 5
    # the bound is per window: the sum of each window's prefix tree
    df = pl.read_parquet(out / "part-*.parquet")
    from pipeline.model.loader import load_model

    tok = load_model(tiny_model_dir).tokenizer
    prompts = {r["id"]: tok.encode(tok.apply_chat_template(json.loads(m))) for r, m in zip(
        pq.read_table(directory).to_pylist(), pq.read_table(directory)["messages"].to_pylist())}
    expected = sum(unique_prefix_tokens([prompts[i] for i in prompts if i // 12 == w]) for w in range(windows))
    assert metrics["prefill_lower_bound_tokens"] == expected
    assert df["prompt_tokens"].sum() == metrics["prompt_tokens"]


@pytest.mark.slow
def test_a_redone_unit_gets_the_same_rows_after_a_restart(tmp_path, tiny_model_dir, workload):
    directory, _ = workload
    out = tmp_path / "out"
    args = (tiny_model_dir, directory, out, "plan.window_rows=20", "output.rows_per_part=6")
    run(job(*args), stdout=io.StringIO())
    before = {p.name: sorted(pl.read_parquet(p)["id"].to_list()) for p in out.glob("part-*.parquet")}
    first = outputs(out)
    record = json.loads((out / "_progress" / "000001.json").read_text())
    (out / "_progress" / "000001.json").unlink()  # as if the run died before committing unit 1
    (out / record["part"]).unlink()
    (out / "_SUCCESS").unlink()
    metrics = run(job(*args), stdout=io.StringIO())
    assert metrics["units_committed"] == 1 and metrics["rows"] == 6
    assert {p.name: sorted(pl.read_parquet(p)["id"].to_list()) for p in out.glob("part-*.parquet")} == before
    assert outputs(out) == first


@pytest.mark.slow
def test_a_kv_budget_below_one_groups_working_set_completes(tmp_path, tiny_model_dir, workload):
    directory, n = workload
    longer = ("engine.max_model_len=160", "sampling.max_tokens=40", "sampling.ignore_eos=true")
    roomy = tmp_path / "roomy"
    run(job(tiny_model_dir, directory, roomy, *longer), stdout=io.StringIO())
    tight = tmp_path / "tight"
    # 10 blocks of 16 tokens (2 layers x 4 KV heads x 16 dims x 4 bytes x K,V = 16 KiB a block); one group
    # (6 rows of ~100 prompt + 40 new tokens) needs ~5 shared + 6 x ~4 own blocks at once
    metrics = run(job(tiny_model_dir, directory, tight, *longer, "engine.kv_cache_memory=160KiB"),
                  stdout=io.StringIO())
    assert outputs(tight) == outputs(roomy) and len(outputs(tight)) == n
    assert metrics["preemptions"] > 0 and metrics["evictions"] > 0  # both counted, and reported
    assert metrics["engine"]["evictions"] == metrics["evictions"]
    shutil.rmtree(roomy)


@pytest.mark.slow
def test_report_is_written(tmp_path, tiny_model_dir, workload):
    directory, _ = workload
    out = tmp_path / "out"
    hardware = ("hardware.bandwidth_tbs=0.02", "hardware.memory_gb=8", "hardware.peak_tflops.fp32=0.1",
                "hardware.peak_tflops.bf16=0.01")  # figures given: no probe
    metrics = run(job(tiny_model_dir, directory, out, "output.report=true", "output.report_interval_s=0.01",
                      *hardware), stdout=io.StringIO())
    for name in ("report.html", "throughput.png", "batch_kv.png", "roofline.png", "efficiency.png"):
        assert (out / "_report" / name).stat().st_size > 1000, name
    series = json.loads((out / "_metrics.json").read_text())["timeseries"]
    assert series == metrics["timeseries"] and series["roofline"]["hardware"] == "cpu"
    assert series["series"]["rows_done"][-1] == metrics["rows"]
    html = (out / "_report" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "prefill_efficiency" in html
