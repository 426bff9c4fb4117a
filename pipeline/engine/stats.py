"""The run's one set of counters: what the engine did (cumulative) and where it stands (after its latest
step). The job's metrics, its progress line and its report's time series all read this one record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The state after the engine's latest step, not sums; not part of `as_dict` (_metrics.json's "engine").
GAUGES = ("running", "kv_blocks_used", "kv_blocks_total", "block_size")


@dataclass
class EngineStats:
    """Counters of everything the engine did (cumulative over generate calls), then the gauges. Times in
    seconds."""

    steps: int = 0
    running_sum: int = 0  # sum over steps of sequences in the batch
    steady_steps: int = 0  # steps taken while requests were still waiting (the batch could have been full)
    steady_running_sum: int = 0
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (once per request)
    cached_tokens: int = 0  # of those, served by the prefix cache at first admission
    prefill_tokens: int = 0  # prompt positions run through the model (recomputation included)
    decode_tokens: int = 0  # tokens sampled
    computed_tokens: int = 0  # all positions run through the model
    attention_pairs: int = 0  # (query, key) position pairs attended over (per layer and head)
    preemptions: int = 0
    evictions: int = 0  # cached blocks dropped to make room
    held: int = 0  # admissions deferred to let a shared prefix finish first
    model_time: float = 0.0
    attention_time: float = 0.0  # part of model_time
    sampling_time: float = 0.0
    schedule_time: float = 0.0  # scheduling, batch building and result bookkeeping
    total_time: float = 0.0
    # wall seconds from the first generate call to the first token sampled: the first steps' torch.compile
    # included, which a job's model load does not count (None before any token)
    first_token_s: float | None = None
    compile_s: float = 0.0  # torch.compile's tracing and code generation during the steps (`compile_seconds`)
    # Speculative decoding: steps in which some sequence checked guesses; guesses made and accepted; checks
    # (one per sequence and step that had guesses). Each accepted guess is a forward pass that sequence saved.
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_checks: int = 0
    # LoRA: per adapter (Request.adapter), its requests, their prompt tokens and the tokens they generated
    adapters: dict[str, dict[str, int]] = field(default_factory=dict)
    running: int = 0  # sequences in the running batch
    kv_blocks_used: int = 0  # KV blocks not in the free queue
    kv_blocks_total: int = 0
    block_size: int = 16  # tokens per KV block

    @property
    def mean_running_batch(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0

    @property
    def steady_mean_running_batch(self) -> float:
        return self.steady_running_sum / self.steady_steps if self.steady_steps else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def spec_mean_accepted(self) -> float:
        """Guesses accepted per check (each check also emits one token of the model's own)."""
        return self.spec_accepted / self.spec_checks if self.spec_checks else 0.0

    @property
    def spec_step_share(self) -> float:
        return self.spec_steps / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in GAUGES}
        out["mean_running_batch"] = self.mean_running_batch
        out["steady_mean_running_batch"] = self.steady_mean_running_batch
        out["spec_acceptance_rate"] = self.spec_acceptance_rate
        out["spec_mean_accepted"] = self.spec_mean_accepted
        out["spec_forwards_saved"] = self.spec_accepted
        out["spec_step_share"] = self.spec_step_share
        return out
