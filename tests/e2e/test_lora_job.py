"""A whole job whose rows name LoRA adapters (input.lora_column): each row's tokens are those of
`transformers` + `peft` with its adapter merged; a row naming an unknown adapter is an error row; a bad
configured adapter stops the job at start, before the output is touched."""

from __future__ import annotations

import io
import json

import polars as pl
import pytest

from pipeline.errors import JobError
from pipeline.job import run
from pipeline.model.hf_file import HFCheckpoint
from tests.e2e.test_job import job, write_shards
from tests.lora_adapters import make_adapter, make_adapters, reference_runs
from tests.reference import assert_only_near_ties

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("lora"))


def test_rows_run_their_own_adapters(tmp_path, tiny_model_dir, adapters):
    names = [None, "a", "b", str(adapters["c"]), "a", "", "nope", "b"]  # "" is the base model too
    n_rows = write_shards(tmp_path / "in", (5, 3), adapter=names)
    out = tmp_path / "out"
    cfg = job(tiny_model_dir, f"{tmp_path}/in/*.parquet", out, "input.lora_column=adapter",
              f"model.lora.adapters={{a: {adapters['a']}, b: {adapters['b']}}}", "model.lora.max_loaded=2",
              "sampling.ignore_eos=true", "output.token_ids=true")
    run(cfg, stdout=io.StringIO())
    df = pl.read_parquet(out / "*.parquet").sort("id")
    assert df["id"].to_list() == list(range(n_rows))
    tok = HFCheckpoint(tiny_model_dir).load_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Question number {i}: what comes next?"}]))
               for i in range(n_rows)]
    runnable = [i for i, name in enumerate(names) if name != "nope"]
    keys = {None: None, "": None, "a": "a", "b": "b", str(adapters["c"]): "c"}
    reference = reference_runs(tiny_model_dir, adapters, [(prompts[i], keys[names[i]]) for i in runnable], 4)
    got = {k: df["token_ids"][i].to_list() for k, i in enumerate(runnable)}
    assert_only_near_ties(reference, got, epsilon=1e-3)
    error = df.filter(pl.col("id") == 6)["error"][0]
    assert error.startswith("row 1 of shard-1.parquet (id 6): unknown adapter 'nope'")
    lora = json.loads((out / "_metrics.json").read_text())["lora"]
    assert {k: v["rows"] for k, v in lora["adapters"].items()} == {"a": 2, "b": 2, str(adapters["c"]): 1}
    assert lora["adapters"]["a"]["generated_tokens"] == 8 and lora["loads"] >= 3


@pytest.mark.parametrize("problem", ["missing", "vocabulary"])
def test_bad_configured_adapter_fails_at_start(tmp_path, tiny_model_dir, problem):
    write_shards(tmp_path / "in", (2,))
    folder = tmp_path / "nowhere"
    if problem == "vocabulary":
        folder = make_adapter(tiny_model_dir, tmp_path / "vocab", 4, ["q_proj"], modules_to_save=["lm_head"])
    cfg = job(tiny_model_dir, f"{tmp_path}/in/*.parquet", tmp_path / "out", f"model.lora.adapters={{x: {folder}}}")
    expected = "is not a folder" if problem == "missing" else "changes the vocabulary"
    with pytest.raises(JobError, match=rf"invalid config `model.lora.adapters`: adapter 'x'.*{expected}"):
        run(cfg, stdout=io.StringIO())
    assert not (tmp_path / "out").exists()


def test_fingerprint_names_the_adapters_not_how_many_stay_resident(tiny_model_dir):
    from pipeline.config import load_job_config
    from tests.test_config import compose_job

    def fingerprint(*overrides):
        return load_job_config(compose_job(*overrides)).fingerprint(str(tiny_model_dir))

    plain = fingerprint()
    assert "lora_column" not in plain["input"] and "lora_adapters" not in plain["model"]  # old outputs resume
    with_adapters = fingerprint("input.lora_column=adapter", "model.lora.adapters={a: /x}")
    assert with_adapters["input"]["lora_column"] == "adapter" and with_adapters["model"]["lora_adapters"] == {"a": "/x"}
    assert fingerprint("input.lora_column=adapter", "model.lora.adapters={a: /x}", "model.lora.max_loaded=2") \
        == with_adapters
    assert fingerprint("input.lora_column=adapter", "model.lora.adapters={a: /y}") != with_adapters


@pytest.mark.parametrize(("override", "message"), [
    ("model.lora.max_loaded=0", "model.lora.max_loaded"), ("model.lora.adapters=[a]", "model.lora.adapters")])
def test_bad_lora_keys(override, message):
    from pipeline.config import load_job_config
    from tests.test_config import compose_job

    with pytest.raises(JobError, match=rf"invalid config `{message}`"):
        load_job_config(compose_job(override))
