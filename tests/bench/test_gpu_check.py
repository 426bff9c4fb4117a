"""bench/gpu_check.sh without a GPU: its dry run (tiny shapes, Triton's interpreter, nothing timed) runs every
section to its end and writes each one's results; a section that raises is recorded and the next one runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("kernels", "runners", "decode1", "job", "gemm")


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(tmp_path.glob("*.error.txt"))
    for n, name in enumerate(SECTIONS, 1):
        rows = json.loads((tmp_path / f"{n}-{name}.json").read_text())["rows"]
        assert rows and all(r["verdict"] != "FAIL" for r in rows), (name, rows)
    kernels = json.loads((tmp_path / "1-kernels.json").read_text())["rows"]
    assert sum(r["verdict"] == "ok" for r in kernels) >= 30  # checked against the references, not skipped
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {name} |" in summary for name in SECTIONS)


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)

    def broken(ctx, rows):
        rows.add("first row", "measured")
        raise RuntimeError("section broke")

    def after(ctx, rows):
        rows.add("next section", "ran", "ok")

    monkeypatch.setattr(gpu_check, "SECTIONS", {"broken": broken, "after": after})
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    assert "RuntimeError: section broke" in (tmp_path / "1-broken.error.txt").read_text()
    broken_rows = json.loads((tmp_path / "1-broken.json").read_text())["rows"]
    assert [r["case"] for r in broken_rows] == ["first row", "section failed"]
    assert json.loads((tmp_path / "2-after.json").read_text())["rows"][0]["figure"] == "ran"
    assert "| after | next section | ran | ok |" in (tmp_path / "summary.md").read_text()
