"""When speculation pays, per step: a running cost model of a step against the measured acceptance rate.

Checking k guesses for each of b running sequences makes the step b (k + 1) positions long instead of b.
Where a step is bound by reading the weights (small b) that costs little; where it is compute bound
(large b on a CPU) it costs up to k + 1 times as much. It pays when the tokens it yields per sequence,
1 + rate x k (rate: the share of guesses accepted so far), exceed that cost ratio by `min_gain`.

The cost of a step is measured, not modelled: recent steps' seconds are averaged per size class of
positions (powers of two, old steps decaying) and interpolated linearly between classes, so it follows
this machine, model and quantization, including where a CPU turns compute bound (a single straight line
through decode and prefill steps misjudged that by 30% on SmolLM2). The proposer's own time per sequence
(a draft model's steps) is added to the checking side. Until enough
guesses were checked to know the rate, every step may speculate (learning it); then, until a plain step of
the batch's size class was seen, none does (learning its cost). While the gate is closed,
every `PROBE_EVERY`th step lets `PROBE_SEQS` sequences speculate, so the rate keeps following the
workload at little cost.
"""

from __future__ import annotations

from pipeline.engine.config import SpeculativeConfig

DECAY = 0.97  # weight kept by a size class's older steps at each new one (a memory of ~30 steps)
MIN_GUESSES = 64  # checked guesses before the acceptance rate is trusted
PROBE_EVERY = 16
PROBE_SEQS = 1


class SpeculationGate:
    def __init__(self, spec: SpeculativeConfig):
        self.k = spec.k
        self.max_batch = spec.max_batch
        self.min_gain = spec.min_gain
        self._classes: dict[int, list[float]] = {}  # size class -> decayed [weight, positions, seconds]
        self.proposed = self.accepted = 0
        self._proposal_seconds = self._proposal_seqs = 0.0
        self._closed_steps = 0

    def observe_step(self, positions: int, seconds: float) -> None:
        sums = self._classes.setdefault(positions.bit_length(), [0.0, 0.0, 0.0])
        sums[:] = [sums[0] * DECAY + 1, sums[1] * DECAY + positions, sums[2] * DECAY + seconds]

    def observe_proposal(self, seqs: int, seconds: float) -> None:
        self._proposal_seqs = self._proposal_seqs * DECAY + seqs
        self._proposal_seconds = self._proposal_seconds * DECAY + seconds

    def observe_check(self, guessed: int, accepted: int) -> None:
        self.proposed += guessed
        self.accepted += accepted

    def step_seconds(self, positions: int) -> float | None:
        """The measured cost of a step of `positions` tokens, interpolated between the two nearest size
        classes seen (extrapolated from the last two beyond them); None until two classes were seen."""
        points = sorted((p / w, t / w) for w, p, t in self._classes.values())
        if len(points) < 2:
            return None
        i = next((i for i, (p, _) in enumerate(points[1:-1], 1) if p >= positions), len(points) - 1)
        (p0, t0), (p1, t1) = points[i - 1], points[i]
        slope = max(0.0, (t1 - t0) / (p1 - p0)) if p1 > p0 else 0.0
        return max(1e-9, t0 + slope * (positions - p0))

    def worth_it(self, batch: int) -> bool:
        """Whether all `batch` running sequences checking k guesses yields more tokens per second."""
        if self.proposed < MIN_GUESSES:
            return True  # learning the rate
        plain, check = self.step_seconds(batch), self.step_seconds(batch * (self.k + 1))
        if plain is None or check is None:
            return False  # a plain step will show what one costs
        if self._proposal_seqs:
            check += batch * self._proposal_seconds / self._proposal_seqs
        tokens = 1 + self.accepted / self.proposed * self.k
        return tokens * plain >= self.min_gain * check

    def speculating(self, batch: int) -> int:
        """How many of the `batch` running sequences may speculate this step."""
        if batch > self.max_batch:
            return 0
        if self.worth_it(batch):
            self._closed_steps = 0
            return batch
        self._closed_steps += 1
        return PROBE_SEQS if self._closed_steps % PROBE_EVERY == 0 else 0
