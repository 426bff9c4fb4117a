"""Seeds belong to the row: a sampled job's output does not depend on resumes, shards or batch size.

Before, rows without a seed drew one from the engine's generator in admission order, so any change in
which rows were admitted when (a resume, a shard split, another batch size) reseeded the rest; and a job
seed gave every row the same stream. The reference is the uninterrupted single-process run.
"""

from __future__ import annotations

import pytest

from pipeline.config import InputConfig
from pipeline.engine.request import SamplingParams
from pipeline.output.verify import verify_output
from pipeline.seeds import row_seed
from pipeline.source.prompts import Prepared, PromptBuilder
from tests.output.jobs import read_output
from tests.output.test_resume import POINTS, crash_and_resume, stable

HOT = SamplingParams(max_tokens=5, temperature=0.8, n=2)


def _builder(sampling: SamplingParams, job_seed: int = 0) -> PromptBuilder:
    return PromptBuilder(None, InputConfig(), sampling, 2048, job_seed)  # type: ignore[arg-type]


def test_row_seed_is_a_stable_hash_of_job_seed_and_row_id():
    assert row_seed(0, 1000) == row_seed(0, 1000)  # no process state
    seeds = {row_seed(s, r) for s in (0, 1) for r in (1000, 1001, "1000", "a.parquet:3")}
    assert len(seeds) == 8  # every (job seed, row id) its own stream; an int id differs from its string
    assert all(0 <= s < 2**63 for s in seeds)


def test_identical_prompts_in_different_rows_get_different_seeds_and_a_row_seed_column_wins():
    prepared = Prepared([1, 2, 3], HOT)
    b = _builder(HOT)
    assert b.seeded(prepared, 1).seed != b.seeded(prepared, 2).seed
    assert b.seeded(prepared, 1).seed == row_seed(0, 1)
    seeded_job = _builder(SamplingParams(temperature=0.8, seed=42))  # sampling.seed is the job seed
    assert seeded_job.seeded(Prepared([1], seeded_job.sampling), 7).seed == row_seed(42, 7)
    assert _builder(HOT, job_seed=5).seeded(prepared, 1).seed == row_seed(5, 1)  # engine.seed when null
    own = Prepared([1, 2, 3], SamplingParams(temperature=0.8, seed=9), own_seed=True)
    assert b.seeded(own, 1).seed == 9
    greedy = Prepared([1], SamplingParams())
    assert b.seeded(greedy, 1) == SamplingParams()  # greedy rows are untouched


def test_prompt_builder_marks_a_row_seed_column(tiny_model_dir):
    from pipeline.model.tokenizer import Tokenizer

    b = PromptBuilder(Tokenizer.from_hf_dir(tiny_model_dir), InputConfig(), HOT, 2048)
    assert b.prepare({"prompt": "x", "seed": 3}).own_seed
    assert not b.prepare({"prompt": "x", "seed": None}).own_seed
    assert not b.prepare({"prompt": "x"}).own_seed


SAMPLED = ["sampling.temperature=0.8", "sampling.n=2"]


@pytest.fixture(scope="module")
def sampled_reference(job_runner, job_args, tmp_path_factory) -> list[tuple]:
    out = tmp_path_factory.mktemp("sampled") / "out"
    rc, log = job_runner.run([*job_args, *SAMPLED, f"output.path={out}"])
    assert rc == 0, log
    rows = stable(read_output(str(out)))
    assert len(rows) == 96
    assert sum(a[2] != b[2] for a, b in zip(rows[::2], rows[1::2])) > 24  # the two samples of a row differ
    return rows


@pytest.mark.slow
def test_sampled_job_killed_and_resumed_equals_uninterrupted(job_runner, job_args, sampled_reference, tmp_path):
    out = str(tmp_path / "out")
    points = [p for p in POINTS if p[0] in ("row.admit", "row.result", "part.after_write", "ledger.mid_write")]
    crash_and_resume(job_runner, [*job_args, *SAMPLED], out, points, seed=3)
    assert stable(read_output(out)) == sampled_reference
    assert verify_output(out).ok


@pytest.mark.slow
def test_sampled_job_in_3_shards_equals_one_process(job_runner, job_args, sampled_reference, tmp_path):
    out = tmp_path / "out"
    for i in range(3):
        rc, log = job_runner.run([*job_args, *SAMPLED, f"output.path={out}", "runtime.num_shards=3",
                                  f"runtime.shard_index={i}"])
        assert rc == 0, log
    assert stable(read_output(str(out))) == sampled_reference


@pytest.mark.slow
@pytest.mark.parametrize("batch", [5, 64])
def test_sampled_job_output_does_not_depend_on_batch_size(job_runner, job_args, sampled_reference, tmp_path,
                                                          batch):
    out = tmp_path / "out"
    rc, log = job_runner.run([*job_args, *SAMPLED, f"output.path={out}", f"engine.max_batch_size={batch}"])
    assert rc == 0, log
    assert stable(read_output(str(out))) == sampled_reference
