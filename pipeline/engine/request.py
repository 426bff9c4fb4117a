"""What enters and leaves the engine. A request carries its own id back out in its result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature=0 is greedy. `seed` makes sampling independent of the batch."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # top-k logprobs of each chosen token; 0 = off

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, int | float) and 0 <= self.min_p <= 1):
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            problems.append(f"seed must be a non-negative integer or null, got {self.seed!r}")
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be an integer >= 1, got {self.n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20:
            problems.append(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Request:
    """One prompt to complete. `id` is opaque to the engine and returned unchanged in each result."""

    id: Any
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Result:
    """One finished sample of a request (a request with n > 1 yields n results)."""

    id: Any
    sample_index: int
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
