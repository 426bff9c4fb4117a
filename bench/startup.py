"""Start-up and the quick start: `python -m pipeline` on the sample data in the default mode, first start
(empty startup cache and torch.compile cache, as on a fresh machine) against the second (both warm), and the
exact float job beside them. Each run is its own process, as a user runs it; figures come from its
`_metrics.json` (model load, generation) and the wall clock (the whole command, Python's start included).

    python bench/startup.py                          # 200 sample rows x 64 tokens: `make run`'s job
    python bench/startup.py --runs 3 --args sampling.max_tokens=16

Prints the CPU flags and the load average beside the figures.
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

from pipeline.perf.probe import cpu_flags

REPO = Path(__file__).resolve().parents[1]


def run_job(out: Path, env: dict[str, str], args: list[str]) -> dict:
    """One `python -m pipeline` run into `out`; its metrics with the command's wall time added."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipeline", f"output.path={out}", "progress.mode=off",
                           f"hydra.run.dir={out}.hydra", *args],
                          cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    metrics = json.loads((out / "_metrics.json").read_text())
    metrics["command_s"] = wall
    return metrics


def line(label: str, m: dict) -> str:
    """One run's figures; `first token` is the model load plus the engine's wait for its first sampled token;
    `compile` is torch.compile's time inside the generation (graphs compiled at the steps that first need
    them, which the model load does not count)."""
    first = m["model_load_s"] + (m["engine"]["first_token_s"] or 0.0)
    return (f"{label:<28} command {m['command_s']:6.1f} s | model load {m['model_load_s']:5.1f} s | first token "
            f"{first:5.1f} s | compile {m['engine']['compile_s']:5.1f} s | generate "
            f"{m['generate_time_s']:5.1f} s | {m['generated_tokens_per_s']:6.1f} gen tok/s | "
            f"quant {m['model']['quant']} (w8a8 from {m['model']['w8a8_rows']} rows), "
            f"kv {m['model']['kv_cache_dtype']}, compiled {m['model']['compiled_layers']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="warm starts after the first")
    parser.add_argument("--args", nargs="*", default=[], help="job overrides for every run")
    opts = parser.parse_args()
    print(f"cpu flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        env = os.environ | {"XDG_CACHE_HOME": str(tmp_path / "cache"),
                            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        print(line("default, first start", run_job(tmp_path / "first", env, opts.args)))
        for i in range(opts.runs):
            print(line(f"default, start {i + 2}", run_job(tmp_path / f"warm{i}", env, opts.args)))
        print(line("model.quant=none", run_job(tmp_path / "none", env, [*opts.args, "model.quant=none"])))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
