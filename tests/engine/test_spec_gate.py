"""The speculation gate's cost fit and decision, against figures computed by hand."""

from __future__ import annotations

import pytest

from pipeline.engine.config import SpeculativeConfig
from pipeline.engine.spec_gate import MIN_GUESSES, PROBE_EVERY, PROBE_SEQS, SpeculationGate


def gate_with_costs(fixed: float, per_position: float, **spec) -> SpeculationGate:
    gate = SpeculationGate(SpeculativeConfig(method="ngram", k=4, **spec))
    for positions in (1, 4, 16, 20, 80, 16, 64):
        gate.observe_step(positions, fixed + per_position * positions)
    return gate


def test_fit_recovers_a_linear_step_cost():
    gate = SpeculationGate(SpeculativeConfig(method="ngram"))
    assert gate.step_seconds(10) is None  # nothing seen
    gate.observe_step(8, 0.1)
    gate.observe_step(8, 0.1)
    assert gate.step_seconds(10) is None  # one size only: no slope to fit
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
    assert unknown.worth_it(16)  # rate still unknown: speculate to learn it
    unknown.observe_check(MIN_GUESSES, MIN_GUESSES)
    assert not unknown.worth_it(16)  # rate known, a plain step's cost not: take one to see
    gate = gate_with_costs(0.08, 0.004)  # 16 seqs: 0.144 s plain, 0.40 s checking 4 guesses each (2.8x)
    assert gate.worth_it(16)  # rate still unknown: speculate to learn it
    gate.observe_check(MIN_GUESSES, int(MIN_GUESSES * 0.75))  # 1 + 0.75 x 4 = 4 tokens per check
    assert gate.worth_it(16) and gate.worth_it(1)
    low = gate_with_costs(0.08, 0.004)
    low.observe_check(MIN_GUESSES, int(MIN_GUESSES * 0.25))  # 2 tokens per check
    assert not low.worth_it(16)  # 2 < 1.1 x 2.8
    assert low.worth_it(1)  # 1 seq: 0.084 s vs 0.10 s, 2 tokens: pays


def test_a_slow_proposer_counts_against_speculating():
    gate = gate_with_costs(0.08, 0.004)
    gate.observe_check(MIN_GUESSES, MIN_GUESSES // 2)  # 3 tokens per check
    assert gate.worth_it(2)  # 0.088 s plain vs 0.12 s checking
    gate.observe_proposal(2, 0.2)  # a draft model taking 0.1 s per sequence
    assert not gate.worth_it(2)


def test_closed_gate_probes_with_one_sequence_and_max_batch_caps():
    gate = gate_with_costs(0.08, 0.004, max_batch=32)
    gate.observe_check(MIN_GUESSES, 0)
    allowed = [gate.speculating(16) for _ in range(2 * PROBE_EVERY)]
    assert allowed.count(PROBE_SEQS) == 2 and set(allowed) == {0, PROBE_SEQS}
    open_gate = gate_with_costs(0.08, 0.004, max_batch=8)
    assert open_gate.speculating(8) == 8 and open_gate.speculating(9) == 0


def test_min_gain_is_validated():
    with pytest.raises(ValueError, match="speculative.min_gain"):
        SpeculativeConfig(min_gain=-1)
