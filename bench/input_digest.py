"""What the input row digests (pipeline/plan/digests.py) cost on a 1M-row input, against reading it.

A job reads every input row once (Arrow batches of the columns it needs) and digests each window as it
reads it, for the units it commits; a resume reads and digests its committed windows once more, before the
model loads. This bench writes N rows (4 files, row groups of 65,536 rows, prompts of about --prompt-bytes
bytes), then times, best of --reps: reading the batches as the job does (`ParquetSource.batches`), and
reading them while digesting every window (`WindowDigests`). The digest's cost is the difference. Both are
printed against the wall time of a job over N rows at --job-rows-per-s (default: the 1M-row figure of
docs/performance.md with the engine skipped, the fastest a job runs: no model work at all).

    python bench/input_digest.py
    python bench/input_digest.py --rows 100000 --prompt-bytes 2000
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import InputConfig
from pipeline.perf.probe import cpu_flags
from pipeline.plan.digests import WindowDigests
from pipeline.plan.units import InputFile, WorkPlan
from pipeline.source.columns import read_columns
from pipeline.source.files import ParquetSource

COLUMNS = read_columns(dataclasses.asdict(InputConfig()))  # what a job with the default input keys reads


def write_input(directory: Path, rows: int, prompt_bytes: int, files: int = 4) -> None:
    """Prompts of about `prompt_bytes` bytes, distinct per row (a repeated text would compress away)."""
    directory.mkdir(parents=True, exist_ok=True)
    filler = "Summarize the following text in one sentence. " * (prompt_bytes // 47 + 1)
    per_file = -(-rows // files)
    for f in range(files):
        lo, hi = f * per_file, min((f + 1) * per_file, rows)
        prompts = pa.array([f"Q{i}: {filler[i % 47:i % 47 + prompt_bytes]}" for i in range(lo, hi)])
        pq.write_table(pa.table({"id": pa.array(range(lo, hi), pa.int64()), "prompt": prompts}),
                       directory / f"part-{f}.parquet", row_group_size=65_536)


def best_seconds(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def sha256_gb_s() -> float:
    data = os.urandom(64 << 20)
    return len(data) / best_seconds(lambda: hashlib.sha256(data).digest(), 3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--prompt-bytes", type=int, default=200)
    parser.add_argument("--window-rows", type=int, default=10_000, help="plan.window_rows")
    parser.add_argument("--batch-rows", type=int, default=1024, help="input.batch_rows")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--job-rows-per-s", type=float, default=2689.0)
    args = parser.parse_args()
    print(f"cpu flags: {cpu_flags()}; sha256 {sha256_gb_s():.2f} GB/s; load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="input-digest-") as tmp:
        write_input(Path(tmp), args.rows, args.prompt_bytes)
        source = ParquetSource(tmp)
        plan = WorkPlan(tuple(InputFile(f.name, f.size, f.num_rows) for f in source.files), args.window_rows, 1000)
        everything = set(range(plan.num_windows))

        def read() -> None:
            for _ in source.batches(COLUMNS, args.batch_rows):
                pass

        def read_and_digest() -> None:
            digests = WindowDigests(plan, everything)
            for file, _, batch in source.batches(COLUMNS, args.batch_rows):
                digests.add(file.name, batch)
            assert len(digests.done) == plan.num_windows

        read_s = best_seconds(read, args.reps)
        digest_s = best_seconds(read_and_digest, args.reps) - read_s
        input_mb = sum(f.size for f in source.files) / 1e6
        arrow_mb = sum(b.nbytes for _, _, b in source.batches(COLUMNS, args.batch_rows)) / 1e6  # what is hashed
    job_s = args.rows / args.job_rows_per_s
    print(json.dumps({
        "rows": args.rows, "input_mb": round(input_mb, 1), "arrow_mb": round(arrow_mb, 1), "read_s": round(read_s, 3),
        "digest_s": round(digest_s, 3), "digest_vs_read": round(digest_s / read_s, 2),
        "job_s_at_job_rows_per_s": round(job_s), "digest_share_of_job": f"{digest_s / job_s:.3%}",
        "resume_check_share_of_job": f"{(read_s + digest_s) / job_s:.3%}",
    }))


if __name__ == "__main__":
    main()
