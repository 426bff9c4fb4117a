"""What enters and leaves the engine. A request carries its own id back out in its result."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.engine.prefill import Prefill


def _json_object(text: Any) -> bool:
    try:
        return isinstance(text, str) and isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature=0 is greedy. `seed` makes sampling independent of the batch.

    Penalties follow vLLM/OpenAI: `repetition_penalty` divides positive (multiplies negative) logits of every
    token already in the prompt or output; `presence_penalty` subtracts once per token seen in the output,
    `frequency_penalty` once per occurrence there. `logit_bias` adds to a token's logit (OpenAI's range).
    """

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
    prompt_logprobs: int = 0  # top-k logprobs (and the actual token's) at each prompt position; 0 = off
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages any token of the prompt or output
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit, in [-100, 100]
    min_tokens: int = 0  # end-of-sequence and stop tokens (and stop strings) are held off until this many
    # Constrained decoding (at most one): the output must be JSON valid under this schema (JSON text; a job's
    # config may give a mapping), match this regular expression, or be exactly one of these strings.
    json_schema: str | None = field(default=None, metadata={"json": True})
    regex: str | None = None
    choice: tuple[str, ...] = ()

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
        if not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20:
            problems.append(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20:
            problems.append(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if not (_number(self.repetition_penalty) and self.repetition_penalty > 0):
            problems.append(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_number(value) and -2 <= value <= 2):
                problems.append(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.logit_bias, dict) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 or not (_number(b) and -100 <= b <= 100)
                for t, b in self.logit_bias.items()):
            problems.append(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {self.logit_bias!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            problems.append(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.json_schema is not None and not _json_object(self.json_schema):
            problems.append(f"json_schema must be a JSON object (as text), got {self.json_schema!r:.80}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            problems.append(f"regex must be a non-empty string or null, got {self.regex!r}")
        if any(not isinstance(c, str) or not c for c in self.choice):
            problems.append(f"choice must be a list of non-empty strings, got {list(self.choice)!r}")
        if sum(x not in (None, ()) for x in (self.json_schema, self.regex, self.choice)) > 1:
            problems.append("give at most one of json_schema, regex and choice")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or bool(self.choice)

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias, min_tokens or a penalty may change this request's logits before the draw."""
        return bool(self.logit_bias or self.min_tokens or self.penalized)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else wanted of the logits: each token is their argmax as the model gives them."""
        return self.greedy and not self.logprobs and not self.adjusts_logits and not self.constrained

    def token_id_problem(self, vocab_size: int) -> str | None:
        """Why `logit_bias` or `stop_token_ids` cannot apply to a model of `vocab_size` tokens (None: they can).
        Kept apart from the checks above: those need no model, this needs its vocabulary."""
        for key in ("logit_bias", "stop_token_ids"):
            bad = [t for t in getattr(self, key) if t >= vocab_size]
            if bad:
                return f"{key} has token ids outside 0..{vocab_size - 1}: {bad[:5]}"
        return None


@dataclass
class Request:
    """One prompt to complete. `id` is opaque to the engine and returned unchanged in each result."""

    id: Any
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # None: generate. `Score` / `Embed` (pipeline/engine/prefill.py): run the prompt only, sample nothing
    prefill: Prefill | None = None
    adapter: str | None = None  # a LoRA adapter's name or folder (pipeline.engine.adapters); None: the base model


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
    finish_reason: str  # "stop" | "length" | "incomplete" (max_tokens hit before the constraint was met) | "error"
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    logprob_tokens: list[dict[int, str]] | None = None  # the same token ids as text
    # per prompt token (None for the first): the top-k prompt_logprobs and the actual token's log-probability
    prompt_logprobs: list[dict[int, float] | None] | None = None
    token_logprobs: list[float] | None = None  # a `Score` request: of each scored token, given those before it
    embedding: list[float] | None = None  # an `Embed` request: the pooled final hidden state
