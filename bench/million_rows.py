"""Bounded memory at scale: plan and run N short prompts with max_tokens=1, report peak RSS and rate.

The job streams rows (one record batch and one planning window at a time), keeps only the units in
flight, and commits each unit as it completes, so peak RSS must not grow with the number of rows. This
bench writes a synthetic input of N short prompts (several files, several row groups each), runs
`python -m pipeline` on the tiny random model (tests/tiny_model.py) with `sampling.max_tokens=1`, and
prints rows, wall time, rows/s and the job's peak RSS (from its _metrics.json), for each N given:

    python bench/million_rows.py                          # 100,000 and 1,000,000 rows
    python bench/million_rows.py --rows 20000 --rows 200000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]


def write_input(directory: Path, rows: int, files: int = 4) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    for f in range(files):
        lo, hi = f * per_file, min((f + 1) * per_file, rows)
        ids = pa.array(range(lo, hi), pa.int64())
        prompts = pa.array([f"Q{i % 977}: say hi" for i in range(lo, hi)])
        pq.write_table(pa.table({"id": ids, "prompt": prompts}), directory / f"part-{f}.parquet",
                       row_group_size=65_536)


def run_job(model: Path, inp: Path, out: Path, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "pipeline", f"input.path={inp}", f"output.path={out}", f"model.path={model}",
            "sampling.max_tokens=1", "input.chat_template=false", "engine.kv_cache_memory=256MiB",
            "engine.max_batch_size=512", "engine.max_batched_tokens=4096", "output.rows_per_part=10000",
            "progress.mode=log", "progress.log_every_s=30", f"hydra.run.dir={out.parent}/hydra",
            "hydra.output_subdir=null", *extra]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    subprocess.run(args, cwd=REPO, env=env, check=True)
    wall = time.perf_counter() - t0
    metrics = json.loads((out / "_metrics.json").read_text())
    return {"rows": metrics["rows"], "wall_s": round(wall, 1), "rows_per_s": round(metrics["rows"] / wall),
            "peak_rss_mib": round(metrics["peak_memory_bytes"] / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, action="append", help="input rows (repeatable)")
    parser.add_argument("extra", nargs="*", help="more job overrides, e.g. engine.max_batch_size=256")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.tiny_model import build_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="million-rows-") as tmp:
        tmp_path = Path(tmp)
        model = build_tiny_checkpoint(tmp_path / "model")
        for rows in args.rows or [100_000, 1_000_000]:
            inp = tmp_path / f"in-{rows}"
            write_input(inp, rows)
            result = run_job(model, inp, tmp_path / f"out-{rows}", args.extra)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
