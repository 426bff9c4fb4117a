"""The speculation gate's cost measurements and decision, against figures computed by hand."""

from __future__ import annotations

import pytest

from pipeline.engine.config import SpeculativeConfig
from pipeline.engine.spec_gate import LEARN_SEQS, MIN_GUESSES, PROBE_EVERY, PROBE_SEQS, SpeculationGate


def gate_with_costs(fixed: float, per_position: float, **spec) -> SpeculationGate:
    gate = SpeculationGate(SpeculativeConfig(method="ngram", k=4, **spec))
    for positions in (1, 4, 16, 20, 80, 16, 64, 40):
        gate.observe_step(positions, fixed + per_position * positions)
    return gate


def learn(gate: SpeculationGate, offered: int, guesses: int, accepted: int, seconds: float = 0.0) -> None:
    """`offered` sequences asked for guesses got `guesses` in all (proposing took `seconds`), and
    `accepted` of them were kept."""
    gate.observe_proposal(offered, seconds)
    gate.observe_check(guesses, accepted)


def test_linear_costs_are_recovered():
    gate = SpeculationGate(SpeculativeConfig(method="ngram"))
    assert gate.step_seconds(10) is None  # nothing seen
    gate.observe_step(8, 0.1)
    gate.observe_step(8, 0.1)
    assert gate.step_seconds(10) is None  # one size class only: nothing to interpolate
    gate = gate_with_costs(0.05, 0.002)
    assert gate.step_seconds(100) == pytest.approx(0.25)
    assert gate.step_seconds(1) == pytest.approx(0.052)


def test_costs_that_bend_are_interpolated_not_fitted_by_one_line():
    """SmolLM2 float32 on 2 cores: cheap while bandwidth bound, then ~4.5 ms per position."""
    gate = SpeculationGate(SpeculativeConfig(method="ngram"))
    measured = {1: 0.063, 4: 0.102, 16: 0.125, 80: 0.415, 600: 2.7}
    for positions, seconds in measured.items():
        gate.observe_step(positions, seconds)
    assert all(gate.step_seconds(p) == pytest.approx(t) for p, t in measured.items())
    assert gate.step_seconds(48) == pytest.approx((0.125 + 0.415) / 2)
    assert gate.step_seconds(80) / gate.step_seconds(16) == pytest.approx(3.32, abs=0.01)


def test_pays_where_accepted_tokens_beat_the_cost_ratio():
    unknown = SpeculationGate(SpeculativeConfig(method="ngram", k=4))
    unknown.observe_step(80, 0.4)
    assert unknown.worth_it(16)  # acceptance still unknown: speculate to learn it, with a few sequences
    assert unknown.speculating(16) == LEARN_SEQS and unknown.speculating(3) == 3
    learn(unknown, MIN_GUESSES // 4, MIN_GUESSES, MIN_GUESSES)
    assert not unknown.worth_it(16)  # acceptance known, a plain step's cost not: take one to see
    # 16 sequences: 0.144 s plain; each guessing 4 (80 positions): 0.40 s, 2.8x
    copying = gate_with_costs(0.08, 0.004)
    learn(copying, 16, MIN_GUESSES, 48)  # 4 guesses per sequence, 3 kept: 4 tokens per check
    assert copying.worth_it(16) and copying.worth_it(1)
    chat = gate_with_costs(0.08, 0.004)
    learn(chat, 16, MIN_GUESSES, 16)  # 1 kept: 2 tokens per check
    assert not chat.worth_it(16)  # 2 x 0.144 < 1.1 x 0.40
    assert chat.worth_it(1)  # 1 sequence: 2 x 0.084 >= 1.1 x 0.10


def test_sequences_without_guesses_make_checking_cheaper_and_gain_less():
    """Free text: one guess per sequence asked on average, half of them kept. 16 sequences: 16 guesses
    (32 positions: 0.208 s against 0.144 s plain) for 1.5 tokens per sequence. Counting k = 4 guesses
    for every sequence instead would price the step at 80 positions (0.40 s) and never speculate."""
    gate = gate_with_costs(0.08, 0.004, min_gain=1.0)
    learn(gate, MIN_GUESSES, MIN_GUESSES, MIN_GUESSES // 2)
    assert gate.worth_it(16)  # 1.5 x 0.144 = 0.216 >= 0.208
    strict = gate_with_costs(0.08, 0.004, min_gain=1.1)
    learn(strict, MIN_GUESSES, MIN_GUESSES, MIN_GUESSES // 2)
    assert not strict.worth_it(16)  # 0.216 < 1.1 x 0.208


def test_a_slow_proposer_counts_against_speculating():
    free = gate_with_costs(0.08, 0.004)
    learn(free, 16, MIN_GUESSES, MIN_GUESSES // 2)  # 4 guesses per sequence, 2 kept: 3 tokens per check
    assert free.worth_it(2)  # 3 x 0.088 >= 1.1 x 0.12
    slow = gate_with_costs(0.08, 0.004)
    learn(slow, 16, MIN_GUESSES, MIN_GUESSES // 2, seconds=16 * 0.1)  # a draft: 0.1 s per sequence
    assert not slow.worth_it(2)  # 3 x 0.088 < 1.1 x (0.12 + 2 x 0.1)


def test_closed_gate_probes_with_one_sequence_and_max_batch_caps():
    gate = gate_with_costs(0.08, 0.004, max_batch=32)
    learn(gate, 16, MIN_GUESSES, 0)
    allowed = [gate.speculating(16) for _ in range(2 * PROBE_EVERY)]
    assert allowed.count(PROBE_SEQS) == 2 and set(allowed) == {0, PROBE_SEQS}
    open_gate = gate_with_costs(0.08, 0.004, max_batch=8)
    assert open_gate.speculating(8) == 8 and open_gate.speculating(9) == 0


def test_min_gain_is_validated():
    with pytest.raises(ValueError, match="speculative.min_gain"):
        SpeculativeConfig(min_gain=-1)
