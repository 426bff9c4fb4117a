"""Is this machine's speed steady? One int8 GEMM timed over and over, reported per window.

On shared virtual machines the same product can run at two speeds that switch every few seconds to tens of
seconds (another tenant on the same physical core), with no steal time reported. Whole-job figures taken
minutes apart then differ by more than most changes are worth, and so does the probe's int8 peak that the
roofline shares divide by. Run this before comparing runs: if the per-window medians differ by more than a
few percent, compare only side by side in one process, alternating within seconds.

The default product is a decode step's gate/up GEMM at 256 rows; `--shape 1024,1024,1024` is the probe's.
On the development machine the slow windows slowed the first 1.6x and the probe's 1.12x.

    python bench/stability.py --seconds 60 --window 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.perf.probe import cpu_flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--window", type=float, default=5.0, help="seconds per reported window")
    ap.add_argument("--shape", default="256,576,3072", help="M,K,N of the [M, K] x [K, N] int8 product")
    args = ap.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    ops = 2 * m * k * n
    print(f"cpu flags: {cpu_flags()}; threads {torch.get_num_threads()}; int8 [{m}, {k}] x [{k}, {n}] `torch._int_mm`")
    medians = []
    for i in range(int(args.seconds // args.window)):
        times = []
        end = time.perf_counter() + args.window
        while time.perf_counter() < end:
            t = time.perf_counter()
            torch._int_mm(a, w.t())
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times))
        print(f"window {i:3d}: median {medians[-1] * 1e6:7.0f} us ({ops / medians[-1] / 1e9:4.0f} GOP/s), "
              f"min {min(times) * 1e6:7.0f} us", flush=True)
    print(f"slowest window / fastest: {max(medians) / min(medians):.2f}")


if __name__ == "__main__":
    main()
