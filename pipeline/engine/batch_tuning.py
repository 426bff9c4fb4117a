"""`engine.max_batch_size=auto`: the running batch that decodes fastest here, measured, not assumed.

Why measure: past the ridge point a CPU decode step is compute bound and the roofline sees nothing to gain
from a bigger batch. What moves the best batch is what the roofline leaves out: per-step costs that do not
grow with the batch (Python, dispatch, compiled-graph guards), GEMM efficiency at small row counts, and
attention and the LM head, which grow with it. Those differ by machine, model and quantization.

How: for each candidate size, that many synthetic prompts are prefilled (their prompts share cached blocks
from one size to the next, so most of the prefill is paid once), then a few decode steps with all of them
running are timed one by one, and the fastest step counts. The sizes within `RECHECK` of the best are timed
once more, in the opposite order, and keep their faster rate: a slow spell of the machine can cover all of
one pass's steps, enough to swap two sizes ~10% apart. The pick is the largest candidate within `WITHIN`
of the best rate: sizes that close are a tie the few timed steps cannot break, and on a CPU a token's cost
does not grow with the batch (its GEMM work is the same per row and runs no slower with more rows, while the
step's fixed costs, Python, dispatch and graph guards, are shared by more of them), so a tie goes to the
larger batch. (On a Zen 4, whole shared-prefix jobs ran 1.18x faster at 256 than at 128 and distinct ones
tied: docs/performance.md.) Every candidate's KV cache fits by construction (`candidates`). Measuring costs seconds
(more in float32), so a short run (fewer than `SHORT_RUN_TOKENS` new tokens in all) takes `SHORT_RUN_BATCH`
unmeasured. On CUDA nothing is timed: decode stays bandwidth bound well past the largest candidate, so the
largest that fits is the pick.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.engine.config import BATCH_CANDIDATES
from pipeline.engine.request import Request, SamplingParams

WITHIN = 0.05  # pick the largest batch within 5% of the best measured rate
RECHECK = 0.15  # sizes within 15% of the best rate are timed a second time
PROMPT_TOKENS = 48  # synthetic prompts: a short chat turn
WARMUP_STEPS, TIMED_STEPS = 2, 5
SHORT_RUN_TOKENS = 16_384  # runs that generate fewer tokens in all do not measure
SHORT_RUN_BATCH = 64


@dataclass
class BatchChoice:
    """What auto chose and the figures it chose from (reported in _metrics.json)."""

    batch: int
    rates: dict[int, float] = field(default_factory=dict)  # generated tok/s of decode steps, by batch
    reason: str = ""
    seconds: float = 0.0  # spent measuring

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "decode_tokens_per_s": {str(b): round(r, 1) for b, r in self.rates.items()},
                "reason": self.reason, "seconds": round(self.seconds, 1)}


def candidates(kv_tokens: int, max_batched_tokens: int, context: int, rows: int | None) -> list[int]:
    """The sizes worth trying: each decodes in one step's token budget, holds `context` positions per
    sequence in the KV cache, and is not larger than the job's rows (when known); the smallest always stays."""
    fits = [b for b in BATCH_CANDIDATES if b <= max_batched_tokens and b * context <= kv_tokens
            and (rows is None or b <= rows)]
    return fits or [BATCH_CANDIDATES[0]]


def short_run(rows: int | None, max_tokens: int) -> bool:
    """Too little work to pay for the measurement (`rows` None: unknown, measure)."""
    return rows is not None and rows * max_tokens < SHORT_RUN_TOKENS


def unmeasured(sizes: list[int], reason: str, cap: int) -> BatchChoice:
    """The largest candidate up to `cap` (else the smallest), chosen without timing anything."""
    return BatchChoice(max([b for b in sizes if b <= cap] or [min(sizes)]), reason=reason)


def pick(rates: dict[int, float], within: float = WITHIN) -> int:
    """The largest batch whose rate is within `within` of the best."""
    best = max(rates.values())
    return max(b for b, r in rates.items() if r >= (1 - within) * best)


def decode_rate(engine: Any, batch: int, prompt_tokens: int = PROMPT_TOKENS, steps: int = TIMED_STEPS) -> float:
    """Generated tok/s of `engine`'s fastest of `steps` decode steps with `batch` synthetic sequences running,
    after their prefill and `WARMUP_STEPS` untimed steps. The fastest, not the mean: a slow spell of a shared
    machine during some of a size's steps moves a mean by as much as the gap between two sizes (measured:
    a 256-row step took 190-226 ms minutes apart), and the fastest step of a few is what the size can do.
    The engine is left empty (its stats are the caller's to reset)."""
    vocab = engine.model_config.vocab_size
    # None may finish before the timed steps end, or those steps time a smaller batch. Prefill takes more
    # steps than batch x prompt / max_batched_tokens: the first sequences decode all along and take part of
    # every step's budget. So no length limit short of the model's: the sequences are aborted once timed.
    sampling = SamplingParams(max_tokens=engine.max_model_len, ignore_eos=True)
    try:
        for i in range(batch):  # distinct prompts, the same ones for every size
            tokens = [(1000 + 7919 * (i * prompt_tokens + j)) % vocab for j in range(prompt_tokens)]
            engine.add_request(Request(("batch-tuning", i), tokens, sampling))
        running = engine.scheduler.running
        while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in running):
            engine.step()
        for _ in range(WARMUP_STEPS):
            engine.step()
        best = 0.0
        for _ in range(steps):
            start, generated = time.perf_counter(), engine.stats.decode_tokens
            engine.step()
            best = max(best, (engine.stats.decode_tokens - generated) / (time.perf_counter() - start))
        return best
    finally:
        engine.abort_all()


def measure(engine: Any, sizes: list[int]) -> BatchChoice:
    """Time each size on `engine` (largest first: the smaller ones find their prompts cached), the close ones
    again in the opposite order, and pick."""
    if len(sizes) == 1:
        return unmeasured(sizes, "the only candidate that fits the KV cache and the job's rows", sizes[0])
    start = time.perf_counter()
    rates = {b: decode_rate(engine, b) for b in sorted(sizes, reverse=True)}
    contenders = sorted(b for b, r in rates.items() if r >= (1 - RECHECK) * max(rates.values()))
    if len(contenders) > 1:
        for b in contenders:  # smallest first: each timed early once and late once
            rates[b] = max(rates[b], decode_rate(engine, b))
    rates = dict(sorted(rates.items()))
    batch = pick(rates)
    figures = ", ".join(f"{b}: {r:.0f}" for b, r in rates.items())
    return BatchChoice(batch, rates, f"measured decode tok/s by batch ({figures}); the largest within "
                       f"{100 * WITHIN:.0f}% of the best", time.perf_counter() - start)
