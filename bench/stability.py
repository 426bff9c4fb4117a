"""Is this machine's speed steady? The probe's int8 GEMM measurement, repeated and reported per window.

On shared virtual machines the same product can run at two speeds that switch every few seconds to tens of
seconds (another tenant on the same physical core), with no steal time reported. Whole-job figures taken
minutes apart then differ by more than most changes are worth, and so does the probe's int8 peak that the
roofline shares divide by. Run this before comparing runs: if the per-window medians differ by more than a
few percent, compare only side by side in one process, alternating within seconds.

    python bench/stability.py --seconds 60 --window 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.perf.probe import cpu_flags, measure_int8_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--window", type=float, default=5.0, help="seconds per reported window")
    ap.add_argument("--n", type=int, default=1024, help="the n x n x n product (the probe's size)")
    args = ap.parse_args()
    print(f"cpu flags: {cpu_flags()}; threads {torch.get_num_threads()}; int8 {args.n}-cube `torch._int_mm`")
    medians = []
    for i in range(int(args.seconds // args.window)):
        rates = []
        end = time.perf_counter() + args.window
        while time.perf_counter() < end:
            rates.append(measure_int8_peak(args.n, reps=1))
        medians.append(statistics.median(rates))
        print(f"window {i:3d}: median {medians[-1] / 1e9:5.0f} GOP/s, best {max(rates) / 1e9:5.0f}", flush=True)
    print(f"fastest window / slowest: {max(medians) / min(medians):.2f}")


if __name__ == "__main__":
    main()
