"""`python -m pipeline [conf=path/to/job.yaml] [key=value ...]`: one batch-inference job, configured by Hydra.

Job-level problems (bad config, unreadable input, missing model) print one `error: ...` line on stderr
and exit with status 2; Hydra's own composition errors (unknown key, wrong type) exit with status 1.
An output leased by another live job exits with 73; a run stopped by SIGTERM/SIGINT/SIGUSR1 exits with 75
after committing what it finished ("run the same command again to resume"; see pipeline/signals.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from pipeline.config import job_file_overrides, load_job_config, register_schema
from pipeline.errors import JobError
from pipeline.io.lease import LeaseHeld
from pipeline.signals import EXIT_INTERRUPTED, EXIT_LOCKED, Interrupted

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
JOB_FILE_GROUP = "job_file"
# Config groups a job file may select by name (`model: smollm2-135m`) instead of giving their keys.
_GROUPS = ("model", "hardware")
EXIT_JOB_ERROR = 2


def _fail(error: JobError) -> None:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(EXIT_LOCKED if isinstance(error, LeaseHeld) else EXIT_JOB_ERROR)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def _run(cfg: DictConfig) -> None:
    try:
        job_cfg = load_job_config(cfg)
        from pipeline.job import run  # imported here so that config errors fail before torch loads

        run(job_cfg)
    except Interrupted as e:  # committed units are kept; the same command resumes
        print(f"interrupted: {e}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except JobError as e:
        _fail(e)


def hydra_argv(argv: list[str]) -> list[str]:
    """Hydra's arguments for `argv`: a `conf=job.yaml` there is stored as a config group option that
    merges over the defaults (and under the command-line overrides). Raises JobError for a bad file."""
    register_schema()
    job_file, argv = job_file_overrides(argv)
    overrides = []
    if job_file is not None:
        for group in _GROUPS:
            chosen = job_file.pop(group) if isinstance(job_file.get(group), str) else None
            if chosen and not any(a.startswith(f"{group}=") for a in argv):
                overrides.append(f"{group}={chosen}")
        ConfigStore.instance().store(group=JOB_FILE_GROUP, name="file", node=job_file, package="_global_")
        overrides.append(f"+{JOB_FILE_GROUP}=file")
    return [*argv, *overrides]  # after Hydra's --flags, which precede the overrides


def main() -> None:
    try:
        sys.argv = [sys.argv[0], *hydra_argv(sys.argv[1:])]
    except JobError as e:
        _fail(e)
    _run()


if __name__ == "__main__":
    main()
