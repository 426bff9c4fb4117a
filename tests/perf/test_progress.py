"""The progress bar (terminal) and the periodic log lines (files, Slurm logs), on captured output."""

from __future__ import annotations

import io
import sys

from pipeline.engine.stats import EngineStats
from pipeline.perf.progress import BarProgress, LogProgress, Progress, make_progress, rates, summary


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_rates_are_totals_over_elapsed_time():
    stats = EngineStats(prefill_tokens=300, cached_tokens=100, decode_tokens=50, running=7)
    assert rates(stats, 10.0) == "gen 5.0 tok/s | prompt 30.0 tok/s | cached 25.0% | batch 7"
    assert rates(stats, 10.0, lower_bound=270) == ("gen 5.0 tok/s | prompt 30.0 tok/s | cached 25.0% | batch 7 | "
                                                  "prefill eff 90.0%")
    assert rates(EngineStats(), 0.0) == "gen 0.0 tok/s | prompt 0.0 tok/s | cached 0.0% | batch 0"


def test_log_lines_come_every_interval_and_at_the_end():
    clock, lines = Clock(), []
    progress = LogProgress(200, every_s=10, emit=lines.append, clock=clock)
    clock.t += 4
    progress.update(10, EngineStats(prefill_tokens=400, decode_tokens=40, running=8))
    assert lines == []  # not yet 10 s
    clock.t += 6
    progress.update(50, EngineStats(prefill_tokens=1000, cached_tokens=1000, decode_tokens=200, running=16))
    assert lines == ["rows 50/200 (25.0%) | gen 20.0 tok/s | prompt 100.0 tok/s | cached 50.0% | batch 16 | "
                     "elapsed 00:10 | eta 00:30"]
    clock.t += 9
    progress.update(60, EngineStats())
    assert len(lines) == 1  # 9 s since the last line
    clock.t += 71
    progress.update(200, EngineStats(prefill_tokens=9000, decode_tokens=1800))
    progress.close()
    assert lines[1:] == ["rows 200/200 (100.0%) | gen 20.0 tok/s | prompt 100.0 tok/s | cached 0.0% | batch 0 | "
                         "elapsed 01:30 | eta 00:00"] * 2


def test_bar_shows_rows_and_rates():
    out, clock = io.StringIO(), Clock()
    progress = BarProgress(200, out, clock=clock)
    clock.t += 10
    progress.update(120, EngineStats(prefill_tokens=500, cached_tokens=500, decode_tokens=250, running=32))
    progress.close()
    text = out.getvalue()
    assert "120/200" in text and "row" in text
    assert "gen 25.0 tok/s | prompt 50.0 tok/s | cached 50.0% | batch 32" in text


def test_auto_mode_picks_by_terminal():
    assert isinstance(make_progress("auto", 5, 10, Terminal()), BarProgress)
    assert isinstance(make_progress("auto", 5, 10, io.StringIO()), LogProgress)
    assert type(make_progress("off", 5, 10, Terminal())) is Progress
    out = io.StringIO()
    quiet = make_progress("log", 5, 10, out)
    quiet.close()
    assert out.getvalue().startswith("rows 0/5 (0.0%)")


def test_summary_table():
    m = {"rows": 200, "output_rows": 400, "error_rows": 3, "prompt_tokens": 8000, "cached_tokens": 2000,
         "computed_prompt_tokens": 6000, "generated_tokens": 12800, "wall_time_s": 61.0, "model_load_s": 2.5,
         "generated_tokens_per_s": 218.8, "total_tokens_per_s": 321.4, "mean_batch": 47.3, "steps": 300,
         "preemptions": 2, "peak_memory_bytes": 3 * 2**30 // 2, "peak_gpu_memory_bytes": None,
         "weight_bytes": 540 * 2**20, "weight_read_bandwidth_gb_s": 4.25}
    lines = summary(m).splitlines()
    assert lines[0] == "  rows              200 in, 400 out, 3 errors"
    assert "  prompt tokens     8,000 (25.0% cached, 6,000 computed)" in lines
    assert "  peak memory       1.5 GiB" in lines and "  weight bytes      540.0 MiB" in lines
    assert "  weight-read bw    4.25 GB/s" in lines and "  mean batch        47.3 over 300 steps" in lines


def test_bar_is_visible_on_a_terminal_without_a_size(monkeypatch):
    """A fresh pty reports 0 columns (as under `script -qc ... > file`); the bar used to draw nothing. It is
    stdout, as in a job: tqdm asks the size of stdout and stderr only, and took -1 rows from it."""
    import os
    import pty

    master, slave = pty.openpty()
    assert os.get_terminal_size(slave).columns == 0
    with os.fdopen(slave, "w") as stream:
        monkeypatch.setattr(sys, "stdout", stream)
        progress = make_progress("auto", 10, 1.0)
        assert isinstance(progress, BarProgress)
        progress.update(5, EngineStats())
        progress.close()
    chunks = []
    while True:  # everything written before the slave side closed; a single read may return only part
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the slave side is closed and drained
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    shown = b"".join(chunks).decode()
    assert "5/10" in shown and "gen " in shown
