"""Two checkouts' decode steps in lock-step: which one steps faster here, measured so that drift cancels.

On a shared 2-core machine the same step can take 300 ms one minute and 450 the next, so two builds timed
one after the other (or in alternating jobs minutes apart) differ by more than most kernel changes gain.
Here each checkout runs in a process of its own (its own imports, kernels and compiled graphs) on the same
captured step (`bench/step_budget.py`'s: a greedy job's batch after --steps steps); both are loaded and
warm before any timing, then rounds alternate between them (A B, B A, ...) a few steps at a time, so a
change in the machine's speed lands on both within seconds. Printed: each round's median step of each, the
median of the per-round ratios B / A, and each side's fastest step.

    git worktree add /tmp/base HEAD~1
    python bench/step_ab.py /tmp/base . --workload distinct --batch 256
    python bench/step_ab.py /tmp/base . --batch 1 --model ~/.cache/llm-batch-pipeline/shapes/llama-3.2-1b

The model is SmolLM2 (GGUF) unless --model names another checkout (`bench/shapes.py` builds real shapes);
both sides load it in `model.quant=auto` as a job with engine.max_batch_size=--batch does. --adapters N: the
rows run N random LoRA adapters of rank --rank round-robin (`bench/lora.py`'s, the same on both sides).

    python bench/step_ab.py /tmp/base . --batch 256 --adapters 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(checkout: str, workload: str, batch: int, steps: int, model: str | None, adapters: int,
           rank: int) -> None:
    """Child: the checkout's model and captured step, then one line per request ("go N"): the median and
    fastest of N steps, in ms."""
    sys.path[:1] = [checkout, os.path.join(checkout, "bench")]  # the checkout's modules, not this script's
    import tempfile

    import torch
    from lora import write_adapter
    from step_budget import captured_step
    from throughput import load_mode, make_distinct_prompts, make_shared_prompts

    from pipeline.engine.adapters import LoraConfig
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.engine import Engine
    from pipeline.engine.host_memory import keep_step_buffers
    from pipeline.model.loader import default_model_path, load_model
    from pipeline.model.quant_choice import choose_quant
    from pipeline.model.roofline import HardwareProfile
    from pipeline.perf.probe import probe

    keep_step_buffers()
    hw = probe()
    path = model or default_model_path()
    base = load_model(path, torch.float32)
    weight_only = "gguf" if str(path).endswith(".gguf") else "int4"
    auto = choose_quant(base.config, HardwareProfile("cpu", hw.bandwidth, dict(hw.flops), hw.memory), weight_only,
                        hw.weight_only_kernels, batch)
    loaded = load_mode(path, torch.float32, "auto", auto, 16, batch)
    prompts = (make_distinct_prompts(base.tokenizer, batch) if workload == "distinct"
               else make_shared_prompts(base.tokenizer, max(1, batch // 32), min(32, batch)))
    work = Path(tempfile.mkdtemp(prefix="step-ab-"))
    names = [f"ft{i}" for i in range(adapters)]
    lora = LoraConfig({n: str(write_adapter(work / n, base.config, rank, i)) for i, n in enumerate(names)},
                      max_loaded=adapters) if adapters else None
    engine = Engine(loaded, EngineConfig(kv_cache_memory="2GiB", max_batch_size=batch), lora=lora)
    step = captured_step(engine, prompts, steps, names)
    import pipeline
    gemms = getattr(loaded.model.kernel_choice, "int8_gemm", {})  # chosen by timing at load: may differ by side
    print(f"worker: imports {Path(pipeline.__file__).parent}; int8 GEMMs {gemms}", file=sys.stderr, flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line.split()[1])):
            t0 = time.perf_counter()
            engine.runner.execute_greedy(step)
            times.append(time.perf_counter() - t0)
        print(f"RESULT {statistics.median(times) * 1e3:.3f} {min(times) * 1e3:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="checkout A (the baseline)")
    ap.add_argument("b", help="checkout B")
    ap.add_argument("--workload", default="distinct", choices=["distinct", "shared"])
    ap.add_argument("--batch", type=int, default=256, help="sequences decoding together")
    ap.add_argument("--steps", type=int, default=60, help="engine steps before the captured one")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=6, help="steps each side runs per round")
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--adapters", type=int, default=0, help="LoRA adapters the rows run round-robin (0: none)")
    ap.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.a, args.workload, args.batch, args.steps, args.model, args.adapters, args.rank)

    checkouts = [str(Path(c).resolve()) for c in (args.a, args.b)]

    def ask(proc: subprocess.Popen, n: int) -> tuple[float, float]:
        proc.stdin.write(f"go {n}\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith("RESULT"):
                median, best = line.split()[1:]
                return float(median), float(best)
        raise SystemExit(f"a worker exited (return code {proc.wait()})")

    # One side loads after the other: a load times the int8 GEMMs to choose one (`pipeline.model.w8a8_gemm`),
    # and two loads at once on two cores chose by each other's noise (a 1.1x faster GEMM lost).
    procs = []
    for c in checkouts:
        procs.append(subprocess.Popen([sys.executable, __file__, c, c, "--worker", "--workload", args.workload,
                                       "--batch", str(args.batch), "--steps", str(args.steps),
                                       "--adapters", str(args.adapters), "--rank", str(args.rank),
                                       *(["--model", args.model] if args.model else [])],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=c))
        ask(procs[-1], 3)  # loaded, compiled and warm before any timing
    rounds: list[list[tuple[float, float]]] = [[], []]
    for r in range(args.rounds):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            rounds[side].append(ask(procs[side], args.per_round))
        print(f"round {r}: A {rounds[0][-1][0]:.1f} ms  B {rounds[1][-1][0]:.1f} ms", flush=True)
    for proc in procs:
        proc.stdin.close()
        proc.wait()
    ratios = [b[0] / a[0] for a, b in zip(*rounds)]
    from pipeline.perf.probe import cpu_flags

    print(f"cpu flags: {cpu_flags()}; workload {args.workload}, {args.batch} rows"
          f"{f' over {args.adapters} rank-{args.rank} adapters' if args.adapters else ''}, {args.rounds} rounds of "
          f"{args.per_round} steps; load {os.getloadavg()[0]:.1f}")
    for name, side, path in (("A", 0, checkouts[0]), ("B", 1, checkouts[1])):
        print(f"  {name} {path}: median step {statistics.median(m for m, _ in rounds[side]):.1f} ms, "
              f"fastest {min(b for _, b in rounds[side]):.1f} ms")
    print(f"  B / A per round: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
