"""The run recorder's rates and roofline share, and the report files (PNGs, HTML rendered by Chromium)."""

from __future__ import annotations

import base64
import dataclasses
import re
import shutil
import subprocess

import numpy as np
import pytest
from matplotlib.image import imread

from pipeline.engine.stats import EngineStats
from pipeline.model.config import ModelConfig
from pipeline.model.roofline import HardwareProfile, Roofline, precision
from pipeline.perf.report import PLOTS, RunRecorder, render_html, write_report

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
CPU = HardwareProfile("cpu", bandwidth=25e9, flops={"fp32": 2e11}, memory=24e9)
ROOF = Roofline(SMOLLM2, CPU, precision("fp32"), kv_dtype="fp32", compute_dtype="fp32")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_samples_every_interval_with_rates_over_it():
    clock = FakeClock()
    rec = RunRecorder(interval_s=5, clock=clock)
    clock.now += 2
    assert rec.observe(0, EngineStats(decode_tokens=10)) is None  # too early
    clock.now += 3
    s = rec.observe(3, EngineStats(decode_tokens=100, prefill_tokens=300, cached_tokens=100, running=4,
                                   kv_blocks_used=9, kv_blocks_total=50))
    assert (s.t, s.generated_tok_s, s.prefilled_tok_s, s.cache_hit_rate) == (5, 20, 60, 0.25)
    assert (s.running_batch, s.kv_blocks_used, s.rows_done) == (4, 9, 3)
    assert s.bytes_per_s is None and s.pct_of_roofline is None  # no roofline given
    clock.now += 1
    s = rec.observe(4, EngineStats(decode_tokens=130, prefill_tokens=300, cached_tokens=100), force=True)
    assert (s.t, s.generated_tok_s, s.prefilled_tok_s, s.cache_hit_rate) == (6, 30, 0, None)
    clock.now += 1
    assert rec.observe(4, EngineStats(decode_tokens=130, prefill_tokens=300, cached_tokens=100),
                       force=True) is None  # nothing new: no sample
    series = rec.to_json()["series"]
    assert series["t"] == [5, 6] and series["generated_tok_s"] == [20, 30]


def test_decode_at_the_ceiling_is_100_percent_of_the_roofline():
    batch, context, block = 8, 256, 16
    ceiling = ROOF.ceiling(batch, context)
    clock = FakeClock()
    rec = RunRecorder(ROOF, interval_s=1, clock=clock)
    kv = EngineStats(running=batch, kv_blocks_used=batch * context // block, kv_blocks_total=1000, block_size=block)
    clock.now += 1
    rec.observe(0, kv, force=True)  # the batch is resident from here on
    steps, start = 50, clock.now
    clock.now += steps * batch / ceiling.tokens_per_s  # exactly the time the roofline allows
    s = rec.observe(0, dataclasses.replace(kv, steps=steps, decode_tokens=steps * batch))
    assert s.pct_of_roofline == pytest.approx(100)
    assert s.bytes_per_s == pytest.approx(ceiling.step_bytes * steps / (clock.now - start))
    assert s.flops_per_s / s.bytes_per_s == pytest.approx(ceiling.intensity)
    clock.now += 2 * steps * batch / ceiling.tokens_per_s  # half the speed: half the share
    s = rec.observe(0, dataclasses.replace(kv, steps=2 * steps, decode_tokens=2 * steps * batch))
    assert s.pct_of_roofline == pytest.approx(50)


def _recorded() -> dict:
    clock = FakeClock()
    rec = RunRecorder(ROOF, interval_s=1, clock=clock)
    for i in range(1, 8):
        clock.now += 1
        rec.observe(10 * i, EngineStats(steps=20 * i, decode_tokens=600 * i, prefill_tokens=900 * i,
                                        cached_tokens=300 * i, running=30, kv_blocks_used=100 + 10 * i,
                                        kv_blocks_total=400))
    return rec.to_json()


def test_plots_have_titles_and_labelled_axes():
    data = _recorded()
    for name, plot in PLOTS.items():
        fig = plot(data)
        for ax in fig.axes:
            assert ax.get_ylabel(), f"{name}: unlabelled y axis"
            assert ax.get_xlabel() or ax.get_shared_x_axes().get_siblings(ax) != [ax], f"{name}: unlabelled x"
        assert fig.axes[0].get_title()
        assert any(line.get_xydata().size for ax in fig.axes for line in ax.lines), f"{name} draws nothing"


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    written = write_report(str(out), _recorded(), title="demo run", summary={"rows": 70})
    assert sorted(p.rsplit("/", 1)[1] for p in written) == sorted([*PLOTS, "report.html"])
    return out


def test_write_report_files(report_dir):
    for name in PLOTS:
        png = (report_dir / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000
        assert imread(report_dir / name).std() > 0.05  # not a blank canvas
    page = (report_dir / "report.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert [base64.b64decode(e) for e in embedded] == [(report_dir / n).read_bytes() for n in PLOTS]
    assert "http" not in page.replace("http-equiv", "")  # self-contained: nothing to fetch
    assert "demo run" in page and "<td>70</td>" in page and "ridge_flop_per_byte" in page


def test_write_report_to_an_fsspec_url():
    import fsspec

    write_report("memory://reports/run1", _recorded())
    fs = fsspec.filesystem("memory")
    assert fs.cat("/reports/run1/throughput.png").startswith(PNG_MAGIC)
    assert fs.cat("/reports/run1/report.html").startswith(b"<!DOCTYPE html>")


def test_html_escapes_the_title():
    assert "<script>" not in render_html("<script>x</script>", {}, {"a&b": "<i>"})


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(report_dir, tmp_path):
    shot = tmp_path / "shot.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", "--window-size=900,1800",
         f"--screenshot={shot}", (report_dir / "report.html").as_uri()],
        check=True, capture_output=True, timeout=60,
    )
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (1800, 900)
    # matplotlib's first colour (#1f77b4) only appears if the embedded plots were decoded and drawn
    blue = np.all(np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.03, axis=-1)
    assert blue.sum() > 200
    assert (pixels.mean(axis=-1) < 0.5).mean() > 0.005  # text and axes, not an empty page


def test_recorder_on_the_real_engine(tiny_model_dir):
    """The engine's counters map onto the series: rates integrate back to the engine's totals."""
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.engine import Engine
    from pipeline.engine.request import Request, SamplingParams
    from pipeline.model.loader import load_model

    loaded = load_model(tiny_model_dir)
    engine = Engine(loaded, EngineConfig(max_batch_size=4, kv_cache_memory="8MiB", max_batched_tokens=64))
    shared = list(range(100, 140))  # a 40-token shared prefix: later requests hit the prefix cache
    requests = [Request(i, shared + [200 + i], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(8)]
    roof = Roofline.of(loaded.config, CPU, "float32")
    rec = RunRecorder(roof, interval_s=1e-9)
    rows = 0
    for request in requests:
        engine.add_request(request)
    while engine.scheduler.has_work():
        rows += len(engine.step())
        rec.observe(rows, engine.stats)
    series = rec.to_json()["series"]
    dts = [b - a for a, b in zip([0.0, *series["t"]], series["t"])]
    assert sum(r * dt for r, dt in zip(series["generated_tok_s"], dts)) == pytest.approx(8 * 6)
    assert sum(r * dt for r, dt in zip(series["prefilled_tok_s"], dts)) == pytest.approx(engine.stats.prefill_tokens)
    assert series["rows_done"][-1] == 8 and max(series["running_batch"]) == 4
    assert series["running_batch"][-1] == 0 and series["kv_blocks_used"][-1] == 0  # all done, all blocks free
    assert all(0 <= u <= t for u, t in zip(series["kv_blocks_used"], series["kv_blocks_total"]))
    assert any(h for h in series["cache_hit_rate"] if h)  # the shared prefix was served from the cache
    assert all(p > 0 for p in series["pct_of_roofline"])
