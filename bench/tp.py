"""Tensor-parallel decode on this machine: tokens/s for N ranks vs one, and what the collectives cost.

    python bench/tp.py                       # tiny model N=1 vs 2, SmolLM2 N=1 vs 3
    python bench/tp.py --prompts 16 --max-tokens 32 --skip-smollm2

For each (model, N) it runs the engine on `--prompts` greedy requests (ignore EOS) and prints generated
tokens/s, ms per step and, on rank 0, the time spent inside collectives per step (all-reduce of the
row-parallel linears, all-gather of the LM head, the step broadcast). A probe also times a bare gloo
all-reduce of one decode step's activations ([batch, hidden] float32) with the same N processes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pipeline.engine.config import EngineConfig  # noqa: E402
from pipeline.engine.engine import Engine  # noqa: E402
from pipeline.engine.request import Request, SamplingParams  # noqa: E402
from pipeline.model.collectives import TPGroup  # noqa: E402
from pipeline.parallel.pool import WorkerPool  # noqa: E402
from pipeline.parallel.runner import open_model  # noqa: E402


class CollectiveClock:
    """Wraps torch.distributed's collectives in this process (rank 0) to count calls and time."""

    NAMES = ("all_reduce", "all_gather", "broadcast")

    def __init__(self):
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self._orig = {}

    def __enter__(self) -> CollectiveClock:
        for name in self.NAMES:
            orig = self._orig[name] = getattr(dist, name)

            def timed(*args, _orig=orig, _name=name, **kwargs):
                t = time.perf_counter()
                try:
                    return _orig(*args, **kwargs)
                finally:
                    self.seconds[_name] += time.perf_counter() - t
                    self.calls[_name] += 1

            setattr(dist, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


@dataclass(frozen=True)
class AllReduceProbe:
    """Worker spec whose every step is `iters` all-reduces of a float32 tensor of the given shape."""

    def build(self, group: TPGroup, device: str) -> AllReduceProbe:
        return self

    def execute(self, inputs: list[torch.Tensor]) -> None:
        rows, cols, iters = inputs[0].tolist()
        x = torch.ones(rows, cols)
        for _ in range(iters):
            dist.all_reduce(x)


def probe_all_reduce(size: int, rows: int, cols: int, iters: int = 200) -> float:
    """Mean seconds of one gloo all-reduce of [rows, cols] float32 across `size` local processes."""
    with WorkerPool(size, AllReduceProbe()) as pool:
        pool.wait_ready()
        spec = torch.tensor([rows, cols, 10])
        pool.step([spec], lambda: AllReduceProbe().execute([spec]))  # warm-up
        spec = torch.tensor([rows, cols, iters])
        t = time.perf_counter()
        pool.step([spec], lambda: AllReduceProbe().execute([spec]))
        return (time.perf_counter() - t) / iters


def peak_rss(pid: int) -> int:
    """Peak resident memory (VmHWM) of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run_engine(path, size: int, prompts: list[list[int]], max_tokens: int) -> dict:
    config = EngineConfig(kv_cache_memory="256MiB", max_batched_tokens=1024, tensor_parallel=size)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with open_model(path, tensor_parallel=size) as sharded, CollectiveClock() as clock:
        loaded = sharded.loaded
        engine = Engine(loaded, config, sharded.make_runner)
        list(engine.generate([Request(0, prompts[0][:4], SamplingParams(max_tokens=2))]))  # warm-up
        before = (engine.stats.steps, dict(clock.seconds), dict(clock.calls))
        t = time.perf_counter()
        n = sum(len(r.token_ids) for r in engine.generate(Request(i, p, sampling) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t
        rss = [peak_rss(pid) for pid in getattr(sharded.driver, "pids", [])]  # fresh processes
        weight_mib = loaded.weight_bytes / 2**20
        steps = engine.stats.steps - before[0]
        coll_s = sum(clock.seconds.values()) - sum(before[1].values())
        calls = sum(clock.calls.values()) - sum(before[2].values())
    return {"tok_s": n / wall, "ms_step": 1e3 * wall / steps, "steps": steps,
            "coll_ms_step": 1e3 * coll_s / steps, "calls_step": calls / steps,
            "weight_mib": weight_mib, "rss_mib": [r / 2**20 for r in rss]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="requests decoded together (the batch)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}, "
          f"batch {args.prompts}, {args.max_tokens} new tokens, float32, gloo on 127.0.0.1")

    from pipeline.model.loader import default_model_path
    from tests.tiny_model import build_tiny_checkpoint

    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_checkpoint(tmp)
        cases.append(("tiny (hidden 128, 2 layers)", tiny, (1, 2), 128))
        if not args.skip_smollm2:
            cases.append(("SmolLM2-135M (hidden 576, 30 layers)", default_model_path(), (1, 3), 576))
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 49152, (16,), generator=gen).tolist() for _ in range(args.prompts)]
        for name, path, sizes, hidden in cases:
            base = None
            for size in sizes:
                r = run_engine(path, size, prompts, args.max_tokens)
                base = base or r["tok_s"]
                line = (f"{name:38s} N={size}: {r['tok_s']:7.1f} tok/s ({r['tok_s'] / base:4.2f}x)  "
                        f"{r['ms_step']:7.1f} ms/step  rank-0 weights {r['weight_mib']:4.0f} MiB")
                if size > 1:
                    probe = probe_all_reduce(size, args.prompts, hidden)
                    line += f", workers' peak RSS {', '.join(f'{m:.0f}' for m in r['rss_mib'])} MiB"
                    line += (f"  collectives {r['coll_ms_step']:6.1f} ms/step ({r['calls_step']:.0f} calls), "
                             f"bare all-reduce [{args.prompts}x{hidden}] {1e3 * probe:.2f} ms/call")
                print(line, flush=True)


if __name__ == "__main__":
    main()
