"""Running whole jobs from the checkpoint tests: a forking runner, input files, reading outputs back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]


class JobRunner:
    """Starts `python -m pipeline` processes forked from a preloaded zygote (see zygote.py)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.output.zygote"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()
        self.count = 0
        assert "ready" in self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the job zygote died")
        return json.loads(line)

    def _call(self, request: dict) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return self._read()

    def start(self, args: list[str], env: dict[str, str | None] | None = None) -> tuple[int, Path]:
        self.count += 1
        log = self.workdir / f"job-{self.count}.log"
        hydra = [f"hydra.run.dir={self.workdir}/hydra-{self.count}", "hydra.output_subdir=null"]
        env = {"PIPELINE_FAULT": None, **(env or {})}
        pid = self._call({"cmd": "run", "args": [*args, *hydra], "env": env, "log": str(log)})["pid"]
        return pid, log

    def wait(self, pid: int) -> int:
        return self._call({"cmd": "wait", "pid": pid})["rc"]

    def run(self, args: list[str], env: dict[str, str | None] | None = None) -> tuple[int, str]:
        pid, log = self.start(args, env)
        rc = self.wait(pid)
        return rc, log.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def write_prompts(path: Path, rows: list[dict[str, Any]], schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def read_output(url: str) -> list[dict]:
    """All rows of the committed parts (never stray files), sorted by (id, sample_index)."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache(root)
    rows = []
    for rec_path in fs.glob(f"{root}/_progress/*.json"):
        rec = json.loads(fs.cat_file(rec_path))
        with fs.open(f"{root}/{rec['part']}", "rb") as f:
            rows += pq.read_table(f).to_pylist()
    return sorted(rows, key=lambda r: (str(r["id"]), r.get("sample_index", 0)))  # score, embed: one row per id


def wait_for(condition, timeout_s: float = 60, every_s: float = 0.02) -> None:
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError("condition not met")
        time.sleep(every_s)
