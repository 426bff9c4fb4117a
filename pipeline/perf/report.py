"""The run's time series (every few seconds) and the report drawn from it: PNG plots and a self-contained HTML.

The job feeds `RunRecorder.observe()` the rows finished and the engine's stats as often as it likes; a sample is kept every
`interval_s`. Rates are differences between samples. Bytes moved and FLOPs done in an interval are
estimated from the roofline model of the run (weights read once per step, each step reads the KV of the
resident blocks), so "% of roofline" = least time the hardware needed for that work / time it took.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import fsspec
from matplotlib.figure import Figure

from pipeline.engine.stats import EngineStats
from pipeline.model.roofline import Roofline


@dataclass(frozen=True)
class Sample:
    """One point of the series; rates cover the interval that ends at `t` (seconds since the start)."""

    t: float
    rows_done: int
    generated_tok_s: float
    prefilled_tok_s: float
    running_batch: int
    kv_blocks_used: int
    kv_blocks_total: int
    cache_hit_rate: float | None  # cached / (cached + prefilled) prompt tokens in the interval
    bytes_per_s: float | None  # estimated from the roofline model; None without one
    flops_per_s: float | None
    pct_of_roofline: float | None


class RunRecorder:
    """Keeps a sample every `interval_s` seconds of the totals it is shown."""

    def __init__(
        self, roofline: Roofline | None = None, interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if interval_s <= 0:
            raise ValueError(f"report interval must be > 0 seconds, got {interval_s}")
        self.roofline = roofline
        self.interval_s = interval_s
        self._clock = clock
        self._t0 = clock()
        self._last_t = self._t0
        self._last: tuple[int, EngineStats] = (0, EngineStats())
        self.samples: list[Sample] = []

    def observe(self, rows_done: int, stats: EngineStats, force: bool = False) -> Sample | None:
        """Record a sample when `interval_s` has passed since the last one (or when `force`, e.g. at the end)."""
        now = self._clock()
        dt = now - self._last_t
        if dt <= 0 or (dt < self.interval_s and not force) or (rows_done, stats) == self._last:
            return None  # too early, or nothing happened since the last sample
        (_, prev), self._last, self._last_t = self._last, (rows_done, replace(stats)), now
        generated = stats.decode_tokens - prev.decode_tokens
        prefilled = stats.prefill_tokens - prev.prefill_tokens
        cached = stats.cached_tokens - prev.cached_tokens
        moved = flops = pct = None
        if self.roofline is not None:
            steps = stats.steps - prev.steps
            resident = (stats.kv_blocks_used + prev.kv_blocks_used) / 2 * stats.block_size
            moved, flops = self.roofline.work(steps, generated + prefilled, steps * resident)
            pct = 100 * self.roofline.seconds(moved, flops) / dt
            moved, flops = moved / dt, flops / dt
        sample = Sample(
            t=now - self._t0,
            rows_done=rows_done,
            generated_tok_s=generated / dt,
            prefilled_tok_s=prefilled / dt,
            running_batch=stats.running,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            cache_hit_rate=cached / (cached + prefilled) if cached + prefilled else None,
            bytes_per_s=moved,
            flops_per_s=flops,
            pct_of_roofline=pct,
        )
        self.samples.append(sample)
        return sample

    def to_json(self) -> dict:
        """The series column by column (for _metrics.json) plus the roofline it was measured against."""
        out: dict = {"interval_s": self.interval_s}
        out["series"] = {f.name: [getattr(s, f.name) for s in self.samples] for f in fields(Sample)}
        if self.roofline is not None:
            r = self.roofline
            out["roofline"] = {
                "hardware": r.hw.name, "bandwidth_bytes_s": r.bandwidth, "peak_flops": r.peak,
                "ridge_flop_per_byte": r.ridge, "weights": r.weights.name, "kv_dtype": r.kv_dtype,
                "compute_dtype": r.compute_dtype, "tp": r.tp,
            }
        return out


# ----------------------------------------------------------------------------------------------- plots
def _series(data: dict, key: str) -> list:
    return data["series"].get(key, [])


def _figure(title: str, ylabel: str = "", xlabel: str = "time since start (s)") -> tuple[Figure, object]:
    fig = Figure(figsize=(7, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig, ax


def plot_throughput(data: dict) -> Figure:
    fig, ax = _figure("Throughput", "tokens / s")
    t = _series(data, "t")
    ax.plot(t, _series(data, "generated_tok_s"), marker=".", label="generated")
    ax.plot(t, _series(data, "prefilled_tok_s"), marker=".", label="prefilled")
    ax.legend()
    return fig


def plot_batch(data: dict) -> Figure:
    fig, ax = _figure("Running batch and KV cache")
    t = _series(data, "t")
    ax.plot(t, _series(data, "running_batch"), marker=".", color="C0", label="running batch")
    ax.set_ylabel("sequences in the batch", color="C0")
    ax2 = ax.twinx()
    ax2.plot(t, _series(data, "kv_blocks_used"), marker=".", color="C1", label="KV blocks used")
    total = max(_series(data, "kv_blocks_total") or [0])
    if total:
        ax2.axhline(total, color="C1", linestyle="--", linewidth=1, label="KV blocks total")
    ax2.set_ylabel("KV blocks used", color="C1")
    ax2.legend(loc="lower right")
    return fig


def plot_roofline(data: dict) -> Figure:
    """The classic roofline (log-log): attainable FLOP/s against FLOP per byte, with the run's intervals on it."""
    fig, ax = _figure("Roofline: achieved vs attainable", "FLOP / s", "arithmetic intensity (FLOP / byte)")
    roof = data.get("roofline")
    flops = _series(data, "flops_per_s")
    moved = _series(data, "bytes_per_s")
    points = [(f / b, f) for f, b in zip(flops, moved) if f and b]
    if roof:
        bw, peak = roof["bandwidth_bytes_s"], roof["peak_flops"]
        lo = min([roof["ridge_flop_per_byte"] / 100, *(p[0] / 2 for p in points)])
        hi = max([roof["ridge_flop_per_byte"] * 100, *(p[0] * 2 for p in points)])
        xs = [lo, roof["ridge_flop_per_byte"], hi]
        ax.plot(xs, [min(peak, bw * x) for x in xs], color="k", label=f"{roof['hardware']} roof")
        ax.axvline(roof["ridge_flop_per_byte"], color="grey", linestyle=":", linewidth=1, label="ridge point")
    if points:
        ax.scatter([p[0] for p in points], [p[1] for p in points], color="C3", zorder=3, label="run intervals")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend()
    return fig


def plot_efficiency(data: dict) -> Figure:
    fig, ax = _figure("Share of the roofline", "% of roofline (least time / actual)")
    ax.plot(_series(data, "t"), _series(data, "pct_of_roofline"), marker=".", color="C2")
    ax.set_ylim(bottom=0)
    return fig


PLOTS = {
    "throughput.png": plot_throughput,
    "batch_kv.png": plot_batch,
    "roofline.png": plot_roofline,
    "efficiency.png": plot_efficiency,
}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _summary_rows(summary: dict) -> str:
    return "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in summary.items()
    )


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    return json.dumps(v) if isinstance(v, dict | list) else str(v)


def render_html(title: str, images: dict[str, bytes], summary: dict) -> str:
    """One page, images inlined as base64 data URIs, no scripts and no external resources."""
    body = "".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(name)}</figcaption></figure>"
        for name, png in images.items()
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:60em}"
        "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:.2em .6em;text-align:left}"
        "img{max-width:100%}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><table>{_summary_rows(summary)}</table>{body}</body></html>"
    )


def write_report(out_dir: str, data: dict, title: str = "Run report", summary: dict | None = None) -> list[str]:
    """Write the PNG plots and report.html of `data` (RunRecorder.to_json()) into `out_dir` (any fsspec URL).

    Returns the paths written.
    """
    images = {name: _png(plot(data)) for name, plot in PLOTS.items()}
    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    written = []
    for name, png in images.items():
        path = f"{root.rstrip('/')}/{name}"
        with fs.open(path, "wb") as f:
            f.write(png)
        written.append(path)
    path = f"{root.rstrip('/')}/report.html"
    with fs.open(path, "w") as f:
        f.write(render_html(title, images, {**(summary or {}), **data.get("roofline", {})}))
    written.append(path)
    return written

