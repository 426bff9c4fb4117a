"""The job config: Hydra composition over the dataclass schema, validation, job files, fingerprint."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from pipeline.config import (
    CONF_DIR,
    SamplingSection,
    hydra_argv,
    job_file_overrides,
    load_job_config,
    register_schema,
)
from pipeline.engine.config import EngineConfig
from pipeline.engine.request import SamplingParams
from pipeline.errors import JobError


def compose_job(*overrides: str):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=list(overrides))


def fingerprint_of(model: Path, *overrides: str) -> dict:
    """The fingerprint of the job these overrides compose, for the model file `model`."""
    return load_job_config(compose_job(*overrides)).fingerprint(str(model))


def test_defaults_compose_into_validated_objects():
    job = load_job_config(compose_job())
    assert isinstance(job.sampling, SamplingParams) and isinstance(job.engine, EngineConfig)
    # the engine section is the engine's own defaults, but for the measured batch size (conf/config.yaml)
    assert job.engine == EngineConfig(max_batch_size="auto")
    assert job.sampling.max_tokens == 64 and job.sampling.temperature == 0  # conf/config.yaml
    assert job.input.path == "data/sample/*.parquet" and job.model.name is None  # the checkpoint's own
    assert job.model.path is None  # null = the installed SmolLM2 GGUF


def test_sampling_section_mirrors_sampling_params():
    def defaults(cls) -> dict:
        return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)}

    mirrored, original = defaults(SamplingSection), defaults(SamplingParams)
    assert mirrored.pop("logit_bias") is None and original.pop("logit_bias") == {}  # null reads as {}
    assert mirrored == original


def test_overrides_reach_the_objects():
    job = load_job_config(compose_job(
        "sampling.temperature=0.7", "sampling.stop=[END,'###']", "sampling.seed=5", "engine.max_batch_size=8",
        "engine.kv_cache_memory=64MiB", "input.path=[a.parquet,b.parquet]", "output.token_ids=true",
    ))
    assert job.sampling.temperature == 0.7 and job.sampling.seed == 5
    assert job.sampling.stop == ("END", "###")  # lists become the tuple SamplingParams wants
    assert job.engine.max_batch_size == 8 and job.engine.kv_cache_bytes == 64 * 2**20
    assert job.input.path == ["a.parquet", "b.parquet"] and job.output.token_ids is True


@pytest.mark.parametrize("override, key", [
    ("sampling.bogus=1", "bogus"),
    ("input.prompt_colum=text", "prompt_colum"),
    ("sampling.max_tokens=abc", "sampling.max_tokens"),
])
def test_unknown_keys_and_wrong_types_fail_while_composing(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        compose_job(override)
    assert key in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("override, words", [
    ("sampling.temperature=-1", "temperature must be a finite number >= 0"),
    ("sampling.top_p=1.5", "top_p must be in (0, 1]"),
    ("sampling.max_tokens=0", "max_tokens must be an integer >= 1"),
    ("engine.max_batch_size=0", "engine.max_batch_size must be an integer >= 1 or auto, got 0"),
    ("engine.max_batch_size=big", "engine.max_batch_size must be an integer >= 1 or auto, got 'big'"),
    ("engine.kv_cache_memory=lots", "engine.kv_cache_memory"),
    ("model.startup_cache_max_size=lots", "model.startup_cache_max_size must be a byte size"),
    ("engine.device=tpu", "engine.device"),
    ("input.truncate=right", "input.truncate"),
    ("input.sampling_columns=[n]", "input.sampling_columns"),
    ("input.passthrough_columns=[text]", "input.passthrough_columns"),
    ("output.mode=append", "output.mode"),
    ("output.rows_per_part=0", "output.rows_per_part"),
    ("model.dtype=int3", "model.dtype"),
    ("model.quant=int3", "model.quant"),
    ("model.quant_group_size=48", "model.quant_group_size"),
    ("model.quant_w8a8_rows=0", "model.quant_w8a8_rows"),
    ("model.quant_lm_head=fp8", "model.quant_lm_head"),
    ("model.kv_cache_dtype=int4", "model.kv_cache_dtype"),
    ("progress.mode=fancy", "progress.mode"),
    ("progress.log_every_s=0", "progress.log_every_s"),
    ("input.path=[]", "input.path"),
    ("sampling.logit_bias={a: 1}", "sampling.logit_bias"),
    ("input.chat_template=''", "input.chat_template"),
    ("input.chat_template=3", "input.chat_template"),
    ("input.chat_template_kwargs=[a]", "input.chat_template_kwargs"),
    ("sampling.logit_bias={5: 101}", "logit_bias must map token ids >= 0 to numbers in [-100, 100]"),
    ("sampling.presence_penalty=2.5", "presence_penalty must be in [-2, 2]"),
    ("sampling.repetition_penalty=0", "repetition_penalty must be a finite number > 0"),
    ("sampling.min_tokens=100", "min_tokens must be an integer in [0, max_tokens]"),
    ("output.path=memory://results", "is gone when the job exits, with every result; write to a directory or a "
                                     "bucket, or set output.allow_ephemeral=true"),
    ("speculative.method=medusa", "speculative.method"),
    ("speculative.k=0", "speculative.k must be an integer >= 1"),
    ("speculative.max_batch=0", "speculative.max_batch"),
    ("speculative.ngram_min=5", "speculative.ngram_min=5 must not exceed speculative.ngram_max=4"),
    ("speculative.draft.dtype=int3", "speculative.draft.dtype"),
    ("speculative.draft.quant=int3", "speculative.draft.quant"),
])
def test_invalid_values_name_the_key(override, words):
    cfg = compose_job(override)
    with pytest.raises(JobError) as e:
        load_job_config(cfg)
    assert words in str(e.value)


def test_logit_bias_takes_a_whole_mapping():
    """Hydra refuses new keys in a typed mapping; the bias map must still be settable from the command line."""
    job = load_job_config(compose_job("sampling.logit_bias={50: -100, 7: 2.5}", "sampling.frequency_penalty=0.5"))
    assert job.sampling.logit_bias == {50: -100, 7: 2.5} and job.sampling.frequency_penalty == 0.5
    assert load_job_config(compose_job()).sampling.logit_bias == {}


def test_chat_template_takes_a_string_and_kwargs_a_mapping():
    job = load_job_config(compose_job("input.chat_template='{{ messages }}'",
                                      "input.chat_template_kwargs={enable_thinking: false}"))
    assert job.input.chat_template == "{{ messages }}" and job.input.chat_template_kwargs == {"enable_thinking": False}
    assert load_job_config(compose_job("input.chat_template=false")).input.chat_template is False


def test_fingerprint_follows_what_changes_outputs(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"1234")

    fingerprint = functools.partial(fingerprint_of, model)

    base = fingerprint()
    assert base["model"]["bytes"] == 4
    assert fingerprint("output.path=elsewhere", "progress.mode=off", "engine.max_batch_size=8",
                       "input.path=./other/*.parquet", "input.batch_rows=8") == base
    assert fingerprint("sampling.temperature=0.5") != base
    assert fingerprint("model.name=other") != base
    assert fingerprint("engine.seed=1") != base
    assert fingerprint("model.dtype=auto", "engine.device=cpu") == fingerprint("model.dtype=float32", "engine.device=cpu")
    assert fingerprint("model.dtype=auto", "engine.device=cuda") != fingerprint("model.dtype=auto", "engine.device=cpu")
    assert fingerprint("speculative.k=2") == base  # speculation off: its keys leave the digest alone
    assert fingerprint("speculative.method=ngram") != base  # on: it changes which tokens a seed draws
    model.write_bytes(b"12345")  # weights replaced at the same path
    assert fingerprint() != base


def test_job_file_is_split_out_of_argv(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: smollm2-135m\nsampling:\n  max_tokens: 7\n")
    content, rest = job_file_overrides(["sampling.temperature=0", f"conf={job}", "--cfg", "job"])
    assert content == {"model": "smollm2-135m", "sampling": {"max_tokens": 7}}
    assert rest == ["sampling.temperature=0", "--cfg", "job"]
    assert job_file_overrides(["a=1"]) == (None, ["a=1"])


@pytest.mark.parametrize("text, words", [
    (None, "job file not found"),
    ("- a\n- b\n", "must hold a mapping"),
    ("sampling: [unclosed\n", "cannot read job file"),
])
def test_bad_job_files(tmp_path, text, words):
    path = tmp_path / "job.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(JobError, match=words):
        job_file_overrides([f"conf={path}"])


def test_resolved_config_is_plain_data():
    job = load_job_config(compose_job("sampling.n=2"))
    assert job.resolved["sampling"]["n"] == 2 and "hydra" not in job.resolved
    assert OmegaConf.create(job.resolved)  # round-trips into a config


def test_job_file_merges_over_defaults_and_under_overrides(tmp_path):
    (tmp_path / "job.yaml").write_text(
        "model: smollm2-135m\ninput:\n  path: prompts/\n  passthrough_columns: [lang]\n"
        "sampling:\n  max_tokens: 3\n  temperature: 0.5\n")
    args = hydra_argv([f"conf={tmp_path}/job.yaml", "sampling.max_tokens=2"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        job = load_job_config(compose("config", overrides=args))
    assert job.sampling.max_tokens == 2 and job.sampling.temperature == 0.5  # command line > file > defaults
    assert job.input.path == "prompts/" and job.input.passthrough_columns == ["lang"]
    assert job.input.prompt_column == "prompt" and job.model.name is None  # untouched defaults


def test_job_file_with_unknown_key_fails_while_composing(tmp_path):
    (tmp_path / "job.yaml").write_text("sampling:\n  temprature: 0.5\n")
    args = hydra_argv([f"conf={tmp_path}/job.yaml"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None), \
            pytest.raises(ConfigCompositionException) as e:
        compose("config", overrides=args)
    assert "temprature" in str(e.value) + str(e.value.__cause__)


def test_appended_unknown_key_is_rejected():
    """Hydra lets `+key=value` add keys the schema lacks; the job still refuses them by name."""
    with pytest.raises(JobError, match="nonsense"):
        load_job_config(compose_job("+input.nonsense=1"))
