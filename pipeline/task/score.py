"""task=score: one prefill-only request per candidate (the prompt's tokens, then the candidate's), and one
output row per input row: each candidate's log-probability (`scores`) and the index of the most likely one.

Each candidate is a sequence of its own, so the prefix cache and the plan's prefix sort share the prompt's
blocks between the row's candidates and between rows (`pipeline.engine.prefill`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.engine.prefill import Prefill, Score
from pipeline.engine.request import Result
from pipeline.source.prefill_prompts import ScorePrepared
from pipeline.source.prompts import Prepared


def score_type(logprobs: bool) -> pa.DataType:
    """One candidate's score: the sum and mean of its tokens' log-probabilities and their count; with
    `logprobs`, per token the top-k log-probabilities and the candidate's own token's."""
    fields = [pa.field("logprob_sum", pa.float64()), pa.field("logprob_mean", pa.float64()),
              pa.field("num_tokens", pa.int32())]
    if logprobs:
        fields.append(pa.field("logprobs", pa.list_(pa.map_(pa.int32(), pa.float32()))))
    return pa.struct(fields)


class ScoreRows:
    def __init__(self, logprobs: bool) -> None:
        self.logprobs = logprobs

    def schema(self, ids: pa.DataType, passthrough: Mapping[str, pa.DataType]) -> pa.Schema:
        return pa.schema([
            pa.field("id", ids), *(pa.field(n, t) for n, t in passthrough.items()),
            pa.field("scores", pa.list_(score_type(self.logprobs))), pa.field("best_candidate", pa.int32()),
            pa.field("prompt_tokens", pa.int32()), pa.field("cached_tokens", pa.int32()),
            pa.field("error", pa.string()),
        ])

    def requests(self, prepared: Prepared) -> list[tuple[list[int], Prefill | None]]:
        assert isinstance(prepared, ScorePrepared)
        start = Score(len(prepared.token_ids))
        return [(prepared.token_ids + candidate, start) for candidate in prepared.candidates]

    def rows(self, base: dict[str, Any], results: list[Result], prompt_tokens: int, where: str) -> list[dict]:
        failed = next((j for j, r in enumerate(results) if r.finish_reason == "error"), None)
        if failed is not None:
            return self.error_rows(base, f"{where}: candidate {failed}: {results[failed].error}", prompt_tokens)
        scores = [self._score(r) for r in results]
        best = max(range(len(scores)), key=lambda j: scores[j]["logprob_sum"])  # the first of equal ones
        return [{**base, "scores": scores, "best_candidate": best, "prompt_tokens": prompt_tokens,
                 "cached_tokens": sum(r.cached_tokens for r in results), "error": None}]

    def error_rows(self, base: dict[str, Any], error: str, prompt_tokens: int) -> list[dict]:
        return [{**base, "scores": None, "best_candidate": None, "prompt_tokens": prompt_tokens, "cached_tokens": 0,
                 "error": error}]

    def _score(self, result: Result) -> dict[str, Any]:
        total = sum(result.token_logprobs)
        count = len(result.token_logprobs)
        score = {"logprob_sum": total, "logprob_mean": total / count, "num_tokens": count}
        return {**score, "logprobs": result.logprobs} if self.logprobs else score
