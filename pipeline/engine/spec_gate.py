"""When speculation pays, per step: the measured cost of longer steps against the measured acceptance.

A sequence asked for guesses gets g of them on average (a proposer may find none) and the check keeps
a of them on average, so it yields 1 + a tokens instead of 1, in a step g positions longer per sequence.
Where a step is bound by reading the weights (few positions) the longer step costs little; where it is
compute bound (many positions on a CPU) it costs in proportion. Speculating pays when
(1 + a) x cost(B) >= min_gain x cost(B x (1 + g)) for the B running sequences.

The cost of a step is measured, not modelled: recent steps' seconds are averaged per size class of
positions (powers of two, old steps decaying) and interpolated linearly between classes, so it follows
this machine, model and quantization, including where a CPU turns compute bound (a single straight line
through decode and prefill steps misjudged that by 30% on SmolLM2). The proposer's own time per sequence
(a draft model's steps) is added to the checking side. Until enough guesses were checked to know a and
g, up to `LEARN_SEQS` sequences per step speculate (learning them); then, until a plain step of the
batch's size class was seen, none does (learning its cost). While the gate is closed, every
`PROBE_EVERY`th step lets `PROBE_SEQS` sequences speculate, so a and g keep following the workload at
little cost.
"""

from __future__ import annotations

from pipeline.engine.config import SpeculativeConfig

DECAY = 0.97  # weight kept by a size class's older steps at each new one (a memory of ~30 steps)
MIN_GUESSES = 64  # checked guesses before the acceptance rate is trusted
LEARN_SEQS = 8  # sequences that speculate per step while learning it (a full batch would pay k + 1 times)
PROBE_EVERY = 16
PROBE_SEQS = 1


class SpeculationGate:
    def __init__(self, spec: SpeculativeConfig):
        self.k = spec.k
        self.max_batch = spec.max_batch
        self.min_gain = spec.min_gain
        self._classes: dict[int, list[float]] = {}  # size class -> decayed [weight, positions, seconds]
        self.offered = self.proposed = self.accepted = 0  # sequences asked, guesses made, guesses kept
        self._proposal_seconds = self._proposal_seqs = 0.0
        self._closed_steps = 0

    def observe_step(self, positions: int, seconds: float) -> None:
        sums = self._classes.setdefault(positions.bit_length(), [0.0, 0.0, 0.0])
        sums[:] = [sums[0] * DECAY + 1, sums[1] * DECAY + positions, sums[2] * DECAY + seconds]

    def observe_proposal(self, seqs: int, seconds: float) -> None:
        self.offered += seqs
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
        """Whether letting all `batch` running sequences speculate yields more tokens per second."""
        if self.proposed < MIN_GUESSES:
            return True  # learning the acceptance
        guesses = round(batch * self.proposed / self.offered)
        plain, check = self.step_seconds(batch), self.step_seconds(batch + guesses)
        if plain is None or check is None:
            return False  # a plain step will show what one costs
        if self._proposal_seqs:
            check += batch * self._proposal_seconds / self._proposal_seqs
        return (1 + self.accepted / self.offered) * plain >= self.min_gain * check

    def speculating(self, batch: int) -> int:
        """How many of the `batch` running sequences may speculate this step."""
        if batch > self.max_batch:
            return 0
        if self.min_gain == 0:
            return batch  # always, nothing to learn
        if self.proposed < MIN_GUESSES:
            return min(batch, LEARN_SEQS)
        if self.worth_it(batch):
            self._closed_steps = 0
            return batch
        self._closed_steps += 1
        return PROBE_SEQS if self._closed_steps % PROBE_EVERY == 0 else 0
