"""Time of one sampling step: `sample()` over a batch of sampled rows, each with its own seeded generator.

The draw is an exponential race (one Exp(1) number per vocabulary id per row), so the cost grows with
batch x vocabulary; rows without top-k / top-p / min-p skip the sort that the filters need. Greedy rows
take `row_argmax`, timed beside torch's own argmax on the same logits.

    python bench/sampler.py                        # batch 64, SmolLM2's vocabulary (49,152), 20 steps
    python bench/sampler.py --scale 4              # peaked logits (N(0, 4^2)): most nuclei close early
    python bench/sampler.py --batch 8 --vocab 1000 --steps 3    # a smoke test
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels.argmax import row_argmax
from pipeline.engine.request import SamplingParams
from pipeline.engine.sampler import sample
from pipeline.engine.sequence import Sequence
from pipeline.perf.probe import cpu_flags


def step_ms(batch: int, vocab: int, steps: int, sampling: SamplingParams, scale: float) -> float:
    seqs = [Sequence(i, i, 0, [1], 1, sampling, i, torch.Generator().manual_seed(i)) for i in range(batch)]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * scale
    sample(logits, seqs)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        sample(logits, seqs)
    return (time.perf_counter() - start) / steps * 1e3


def argmax_ms(batch: int, vocab: int, steps: int) -> tuple[float, float]:
    """ms of torch's argmax and of `row_argmax` over the same [batch, vocab] float32 logits."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    times = []
    for fn in (lambda: logits.argmax(dim=-1), lambda: row_argmax(logits)):
        fn()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="logits are N(0, scale^2): 1 is flat (every top-p nucleus is wide), 4 peaked")
    args = parser.parse_args()
    print(f"cpu flags: {cpu_flags()}; torch threads {torch.get_num_threads()}, batch {args.batch}, "
          f"vocabulary {args.vocab}, logits N(0, {args.scale:g}^2)")
    torch_ms, ours_ms = argmax_ms(args.batch, args.vocab, args.steps)
    print(f"{'greedy: torch argmax':<28} {torch_ms:8.2f} ms per step; row_argmax {ours_ms:.2f} ms "
          f"({torch_ms / ours_ms:.1f}x)")
    for label, sp in (("temperature 0.8", SamplingParams(temperature=0.8)),
                      ("temperature 0.8, top_p 0.95", SamplingParams(temperature=0.8, top_p=0.95))):
        print(f"{label:<28} {step_ms(args.batch, args.vocab, args.steps, sp, args.scale):8.2f} ms per step")


if __name__ == "__main__":
    main()
