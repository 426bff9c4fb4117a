"""Resume trusts no committed part it can check cheaply: a deleted or damaged part is redone.

Before, a part deleted or truncated after its commit went unnoticed: the rerun said "nothing to do" (or
wrote `_SUCCESS`) over the hole, and only `verify` reported it.
"""

from __future__ import annotations

import pytest

from pipeline.output.verify import verify_output
from tests.output.jobs import read_output
from tests.output.test_resume import reference, stable  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("complete", [True, False])
def test_deleted_and_truncated_parts_are_redone_with_a_warning(job_runner, job_args, reference, tmp_path,  # noqa: F811
                                                               complete):
    out = tmp_path / "out"
    env = None if complete else {"PIPELINE_FAULT": "ledger.after_write:6"}  # 6 units committed, then killed
    job_runner.run([*job_args, f"output.path={out}"], env)
    assert (out / "_SUCCESS").exists() == complete
    (out / "part-000001.parquet").unlink()
    truncated = out / "part-000004.parquet"
    truncated.write_bytes(truncated.read_bytes()[:100])

    rc, log = job_runner.run([*job_args, f"output.path={out}"])
    assert rc == 0, log
    assert "unit 000001 is redone: part part-000001.parquet is missing" in log
    assert "unit 000004 is redone: part part-000004.parquet has 100 bytes" in log
    assert stable(read_output(str(out))) == reference
    assert verify_output(str(out)).ok and (out / "_SUCCESS").exists()
