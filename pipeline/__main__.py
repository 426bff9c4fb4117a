"""`python -m pipeline [conf=path/to/job.yaml] [key=value ...]`: one batch-inference job, configured by Hydra.

Job-level problems (bad config, unreadable input, missing model) print one `error: ...` line on stderr
and exit with status 2; Hydra's own composition errors (unknown key, wrong type) exit with status 1.
An output leased by another live job exits with 73; a run stopped by SIGTERM/SIGINT/SIGUSR1 exits with 75
after committing what it finished ("run the same command again to resume"; see pipeline/output/signals.py).
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeline.config import CONF_DIR, hydra_argv, load_job_config, per_job_output_path
from pipeline.errors import JobError
from pipeline.output.lease import LeaseHeld
from pipeline.output.signals import EXIT_INTERRUPTED, EXIT_LOCKED, Interrupted

EXIT_JOB_ERROR = 2


def _fail(error: JobError) -> None:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(EXIT_LOCKED if isinstance(error, LeaseHeld) else EXIT_JOB_ERROR)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _run(cfg: DictConfig) -> None:
    try:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            cfg.output.path = per_job_output_path(cfg.output.path, hydra_cfg.job.override_dirname)
        job_cfg = load_job_config(cfg)
        from pipeline.job import run  # imported here so that config errors fail before torch loads

        run(job_cfg)
    except Interrupted as e:  # committed units are kept; the same command resumes
        print(f"interrupted: {e}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except JobError as e:
        _fail(e)


def main() -> None:
    try:
        sys.argv = [sys.argv[0], *hydra_argv(sys.argv[1:])]
    except JobError as e:
        _fail(e)
    _run()


if __name__ == "__main__":
    main()
