"""When speculation pays, per step: a running cost model of a step against the measured acceptance rate.

Checking k guesses for each of b running sequences makes the step b (k + 1) positions long instead of b.
Where a step is bound by reading the weights (small b) that costs little; where it is compute bound
(large b on a CPU) it costs up to k + 1 times as much. It pays when the tokens it yields per sequence,
1 + rate x k (rate: the share of guesses accepted so far), exceed that cost ratio by `min_gain`.

The cost of a step is fitted online as seconds = a + c x positions (weighted least squares over recent
steps, old ones decaying), so it follows this machine, model and quantization without a table; the
proposer's own time per sequence (a draft model's steps) is added to the checking side. Until enough
guesses were checked to know the rate, every step may speculate (learning it); while the gate is closed,
every `PROBE_EVERY`th step lets `PROBE_SEQS` sequences speculate, so the rate keeps following the
workload at little cost.
"""

from __future__ import annotations

from pipeline.engine.config import SpeculativeConfig

DECAY = 0.97  # weight kept by older observations at each new one (a memory of ~30 steps)
MIN_GUESSES = 64  # checked guesses before the acceptance rate is trusted
PROBE_EVERY = 16
PROBE_SEQS = 1


class SpeculationGate:
    def __init__(self, spec: SpeculativeConfig):
        self.k = spec.k
        self.max_batch = spec.max_batch
        self.min_gain = spec.min_gain
        self._sums = [0.0] * 5  # weighted n, sum x, sum y, sum xx, sum xy of (positions, seconds)
        self.proposed = self.accepted = 0
        self._proposal_seconds = self._proposal_seqs = 0.0
        self._closed_steps = 0

    def observe_step(self, positions: int, seconds: float) -> None:
        n, sx, sy, sxx, sxy = (s * DECAY for s in self._sums)
        self._sums = [n + 1, sx + positions, sy + seconds, sxx + positions * positions, sxy + positions * seconds]

    def observe_proposal(self, seqs: int, seconds: float) -> None:
        self._proposal_seqs = self._proposal_seqs * DECAY + seqs
        self._proposal_seconds = self._proposal_seconds * DECAY + seconds

    def observe_check(self, guessed: int, accepted: int) -> None:
        self.proposed += guessed
        self.accepted += accepted

    def step_seconds(self, positions: int) -> float | None:
        """The fitted cost of a step of `positions` tokens; None until steps of two sizes were seen."""
        n, sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx
        if n < 2 or spread <= 1e-9 * max(1.0, sxx * n):
            return None
        slope = max(0.0, (n * sxy - sx * sy) / spread)
        return max(1e-9, (sy - slope * sx) / n) + slope * positions

    def worth_it(self, batch: int) -> bool:
        """Whether all `batch` running sequences checking k guesses yields more tokens per second."""
        plain, check = self.step_seconds(batch), self.step_seconds(batch * (self.k + 1))
        if plain is None or check is None or self.proposed < MIN_GUESSES:
            return True  # learning the rate and the costs
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
