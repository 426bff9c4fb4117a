"""Progress of a run: a tqdm bar on a terminal, a plain log line every few seconds otherwise.

Cron jobs and Slurm write stdout to a file, where a redrawn bar becomes megabytes of carriage returns;
there a line like `rows 120/200 (60.0%) | gen 312.4 tok/s | ...` every `progress.log_every_s` seconds
tells the same story and greps well.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

from pipeline.engine.stats import EngineStats


def prefill_efficiency(lower_bound: int, computed: int) -> float | None:
    """lower bound / computed prompt positions: 1.0 = every shared prefix computed once (None: not known)."""
    return lower_bound / computed if lower_bound and computed else None


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def rates(stats: EngineStats, elapsed: float, lower_bound: int = 0) -> str:
    """`gen 312.4 tok/s | prompt 1024.0 tok/s | cached 35.2% | batch 48`, then `| prefill eff 97.0%` once the
    prefill lower bound is known (least prompt positions any order could compute for the rows sent so far;
    it counts rows sent to the engine, so mid-run it runs ahead), then `| spec acc 62% x2.40` (guesses
    accepted, and accepted per check) once speculative guesses are accepted. "prompt" counts computed
    positions."""
    elapsed = max(elapsed, 1e-9)
    seen = stats.prefill_tokens + stats.cached_tokens
    cached = 100.0 * stats.cached_tokens / seen if seen else 0.0
    line = (f"gen {stats.decode_tokens / elapsed:.1f} tok/s | prompt {stats.prefill_tokens / elapsed:.1f} tok/s | "
            f"cached {cached:.1f}% | batch {stats.running}")
    efficiency = prefill_efficiency(lower_bound, stats.prefill_tokens)
    if efficiency is not None:
        line = f"{line} | prefill eff {100 * efficiency:.1f}%"
    if stats.spec_acceptance_rate:
        line = f"{line} | spec acc {100 * stats.spec_acceptance_rate:.0f}% x{stats.spec_mean_accepted:.2f}"
    return line


class Progress:
    """Receives the run's totals (rows finished, written or rejected; the engine's stats; the prefill lower
    bound, 0 while unknown); shows nothing (progress.mode=off)."""

    def __init__(self, total_rows: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_rows = total_rows
        self.clock = clock
        self.start = clock()
        self.rows, self.stats, self.lower_bound = 0, EngineStats(), 0

    def update(self, rows: int, stats: EngineStats, lower_bound: int = 0) -> None:
        self.rows, self.stats, self.lower_bound = rows, stats, lower_bound

    def rates(self) -> str:
        return rates(self.stats, self.clock() - self.start, self.lower_bound)

    def close(self) -> None:
        pass


FALLBACK_COLUMNS, FALLBACK_ROWS = 120, 20


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):  # not a terminal, or no file descriptor
        return 0


class BarProgress(Progress):
    """A tqdm bar over rows with the token rates as its postfix."""

    def __init__(self, total_rows: int, stream: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(total_rows, clock)
        # A terminal that reports no size (a pty under `script`, some CI runners) gives tqdm 0 columns and, on
        # stdout or stderr, -1 rows, which hide even the first bar: give it a fixed size instead.
        sized = _columns(stream) > 0
        fixed = {} if sized else {"ncols": FALLBACK_COLUMNS, "nrows": FALLBACK_ROWS}
        self.bar = tqdm(total=total_rows, unit="row", file=stream, dynamic_ncols=sized, mininterval=0.5,
                        smoothing=0.1, **fixed)

    def update(self, rows: int, stats: EngineStats, lower_bound: int = 0) -> None:
        super().update(rows, stats, lower_bound)
        self.bar.update(rows - self.bar.n)
        self.bar.set_postfix_str(self.rates(), refresh=False)

    def close(self) -> None:
        self.bar.set_postfix_str(self.rates(), refresh=False)
        self.bar.close()


class LogProgress(Progress):
    """One line every `every_s` seconds (checked on each update), and a last one at the end."""

    def __init__(self, total_rows: int, every_s: float, emit: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(total_rows, clock)
        self.every_s = every_s
        self.emit = emit
        self.last = self.start

    def line(self) -> str:
        rows, elapsed = self.rows, self.clock() - self.start
        pct = 100.0 * rows / self.total_rows if self.total_rows else 100.0
        eta = elapsed / rows * (self.total_rows - rows) if rows else None
        return (f"rows {rows}/{self.total_rows} ({pct:.1f}%) | {rates(self.stats, elapsed, self.lower_bound)} | "
                f"elapsed {_duration(elapsed)} | eta {_duration(eta) if eta is not None else '?'}")

    def update(self, rows: int, stats: EngineStats, lower_bound: int = 0) -> None:
        super().update(rows, stats, lower_bound)
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            self.emit(self.line())

    def close(self) -> None:
        self.emit(self.line())


def make_progress(mode: str, total_rows: int, log_every_s: float, stream: TextIO | None = None,
                  emit: Callable[[str], None] | None = None) -> Progress:
    """`auto` picks the bar when `stream` (default stdout) is a terminal, log lines otherwise."""
    stream = stream or sys.stdout
    if mode == "auto":
        mode = "bar" if stream.isatty() else "log"
    if mode == "bar":
        return BarProgress(total_rows, stream)
    if mode == "log":
        return LogProgress(total_rows, log_every_s, emit or (lambda line: print(line, file=stream, flush=True)))
    return Progress(total_rows)


def _bytes(n: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            break
        n /= 1024
    return f"{n:.1f} {unit}"


def _speculative(s: dict) -> str:
    return (f"{s['method']}: {s['accepted']:,} of {s['proposed']:,} guesses accepted "
            f"({100 * s['acceptance_rate']:.1f}%, {s['mean_accepted']:.2f} per check), "
            f"{100 * s['step_share']:.0f}% of steps speculated")


def summary(m: dict) -> str:
    """The end-of-run table (a subset of _metrics.json)."""
    cached = 100.0 * m["cached_tokens"] / m["prompt_tokens"] if m["prompt_tokens"] else 0.0
    rows = [
        ("rows", f"{m['rows']:,} in, {m['output_rows']:,} out, {m['error_rows']:,} errors"),
        ("prompt tokens", f"{m['prompt_tokens']:,} ({cached:.1f}% cached, {m['computed_prompt_tokens']:,} computed)"),
        ("generated tokens", f"{m['generated_tokens']:,}"),
        ("wall time", f"{m['wall_time_s']:.1f} s (model load {m['model_load_s']:.1f} s)"),
        ("throughput", f"{m['generated_tokens_per_s']:.1f} generated tok/s, {m['total_tokens_per_s']:.1f} total tok/s"),
        ("mean batch", f"{m['mean_batch']:.1f} over {m['steps']:,} steps"),
        ("preemptions", f"{m['preemptions']:,}"),
        *([("cache evictions", f"{m['evictions']:,} blocks")] if "evictions" in m else []),
        *([("speculative", _speculative(m["speculative"]))]
          if m.get("speculative", {}).get("method", "none") != "none" else []),
        *([("prefill vs bound", f"{m['prefill_lower_bound_tokens']:,} tokens at least, efficiency "
                                f"{m['prefill_efficiency']:.3f}")] if m.get("prefill_efficiency") else []),
        ("peak memory", _bytes(m["peak_memory_bytes"])
         + (f" (GPU {_bytes(m['peak_gpu_memory_bytes'])})" if m.get("peak_gpu_memory_bytes") else "")),
        ("weight bytes", _bytes(m["weight_bytes"])),
        ("weight-read bw", f"{m['weight_read_bandwidth_gb_s']:.2f} GB/s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
