"""Requests that run their prompt through the model and sample nothing: scoring and embedding.

`Request.prefill = Score(start)` asks for the log-probability of each prompt token from index `start` on,
given the tokens before it (a candidate completion after its prompt); `Embed(pooling, normalize)` for the
model's final hidden states (after its final norm) pooled over the prompt: the last position's, or the mean
of every position's. The sequence finishes in the step that computes its last position.

What the prefix cache may serve is everything before the first position whose output is needed
(`first_needed`): for a score, the position before the first scored token, whose logits score it, so a
prompt shared by several candidates (each its own request) is computed once and every candidate computes
from its prompt's last token on; for `last` pooling, the last position. `mean` pooling needs every
position's hidden state, and the cache keeps keys and values, not hidden states, so such a request takes
no blocks from it (its own blocks are still cached for others).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class Score:
    """Score prompt tokens `start`.. (start >= 1: the first token has no context to be scored in)."""

    start: int

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 1:
            raise ValueError(f"Score.start must be an integer >= 1, got {self.start!r}")


@dataclass(frozen=True)
class Embed:
    """Pool the final hidden states: `last` position or `mean` of all; `normalize` to unit L2 norm."""

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")


Prefill = Score | Embed


def first_needed(task: Prefill, num_tokens: int) -> int:
    """The first position whose output `task` needs; the prefix cache may serve only the positions before it."""
    if isinstance(task, Score):
        return task.start - 1
    return 0 if task.pooling == "mean" else num_tokens - 1


def output_positions(task: Prefill, lo: int, n: int, num_tokens: int) -> range:
    """The positions of a chunk [lo, lo + n) whose outputs the request records: logits for a score (position
    p scores token p + 1), final hidden states for an embedding."""
    if isinstance(task, Score):
        return range(max(lo, task.start - 1), min(lo + n, num_tokens - 1))
    if task.pooling == "mean":
        return range(lo, lo + n)
    return range(num_tokens - 1, num_tokens) if lo + n == num_tokens else range(0)


def wants_hidden(task: Prefill) -> bool:
    """Whether the request records final hidden states (else logits, if anything)."""
    return isinstance(task, Embed)


@dataclass
class PrefillState:
    """A prefill-only sequence's request and what its computed positions gave so far. Each position is
    recorded once: a preempted sequence computes its positions again."""

    task: Prefill
    top_k: int = 0  # Score: also keep each scored token's top-k log-probabilities (`sampling.logprobs`)
    logprobs: list[float] = field(default_factory=list)  # Score: of each scored token so far, in order
    top: list[dict[int, float]] = field(default_factory=list)  # Score with top_k: per scored token, top-k and it
    pooled: torch.Tensor | None = None  # Embed: float64 sum (mean) or the last position's hidden state
    pooled_positions: int = 0  # Embed: positions 0.. pooled so far

    @property
    def wants_hidden(self) -> bool:
        return wants_hidden(self.task)

    def record_logprobs(self, logprobs: torch.Tensor, positions: range, token_ids: list[int]) -> None:
        """`logprobs` [len(positions), vocab]: log-softmax of each position's logits, which scores the next token."""
        assert isinstance(self.task, Score)
        skip = len(self.logprobs) - (positions.start - (self.task.start - 1))
        if skip >= len(positions):
            return
        rows = logprobs[max(0, skip):]
        tokens = torch.tensor(token_ids[positions.start + 1 + max(0, skip) : positions.stop + 1],
                              device=rows.device)
        self.logprobs.extend(rows.gather(1, tokens[:, None]).squeeze(1).tolist())
        if self.top_k:
            top_v, top_i = rows.topk(self.top_k, dim=-1)
            for values, ids, token, own in zip(top_v.tolist(), top_i.tolist(), tokens.tolist(),
                                               self.logprobs[len(self.logprobs) - len(rows):]):
                self.top.append({**dict(zip(ids, values)), token: own})

    def record_hidden(self, hidden: torch.Tensor, positions: range) -> None:
        """`hidden` [len(positions), hidden size]: the final hidden states of `positions`, in order."""
        assert isinstance(self.task, Embed)
        skip = self.pooled_positions - positions.start
        if skip >= len(positions):
            return
        rows = hidden[max(0, skip):]
        if self.task.pooling == "mean":
            part = rows.double().sum(0)
            self.pooled = part if self.pooled is None else self.pooled + part
        else:
            self.pooled = rows[-1].float()
        self.pooled_positions = positions.stop

    def embedding(self) -> list[float]:
        """The pooled (and, if asked, normalized) vector, in float32."""
        assert isinstance(self.task, Embed) and self.pooled is not None
        vector = self.pooled / self.pooled_positions if self.task.pooling == "mean" else self.pooled
        if self.task.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.float().tolist()
