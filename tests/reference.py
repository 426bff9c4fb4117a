"""The plain references every test compares the engine and the model with: a contiguous per-sequence KV
cache and one greedy decoding loop (no paging, no scheduler, no sampler), and the near-tie rule for
comparing two greedy decodes.

Greedy decoding is exact only up to float rounding: where the reference's top two logits are closer than
the rounding differences between two correct implementations (batching, summation order, tensor
parallelism), either token is right. `mismatches` reports each first difference with the reference's
top-2 logit gap there, so a test can accept differences only at such near-ties.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from pipeline.model.attention import causal_attention
from pipeline.model.llama import LlamaModel

K = TypeVar("K")


class ContiguousKVCache:
    """KV cache of a single sequence in growing per-layer tensors."""

    def __init__(self, num_layers: int, scale: float, window: int | None = None):
        self.scale = scale
        self.window = window  # the model's sliding window (ModelConfig.sliding_window); None: full attention
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start = 0 if self.k[layer] is None else self.k[layer].shape[0]
        # copies: a compiled caller may reuse the memory of what it passed once the call returns
        self.k[layer] = k.clone() if self.k[layer] is None else torch.cat([self.k[layer], k])
        self.v[layer] = v.clone() if self.v[layer] is None else torch.cat([self.v[layer], v])
        return causal_attention(q, self.k[layer], self.v[layer], start, self.scale, self.window)


class SequenceCaches:
    """Attention backend for several sequences, each with its own contiguous cache. `select` names the
    sequences of the next forward pass and how many of its flat tokens each owns, in order."""

    def __init__(self, model: LlamaModel, count: int):
        self.caches = [ContiguousKVCache(model.config.num_layers, model.scale, model.config.sliding_window) for _ in range(count)]
        self._runs: list[tuple[int, int]] = []

    def select(self, sequences: Iterable[int], counts: Iterable[int]) -> None:
        self._runs = list(zip(sequences, counts))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for seq, n in self._runs:
            part = slice(start, start + n)
            outs.append(self.caches[seq].attend(layer, q[part], k[part], v[part]))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@torch.no_grad()
def prompt_logits(model: LlamaModel, ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of every position, in one forward pass on a fresh cache."""
    hidden = model(torch.tensor(list(ids)), torch.arange(len(ids)), ContiguousKVCache(model.config.num_layers, model.scale, model.config.sliding_window))
    return model.compute_logits(hidden)


class Decoded(NamedTuple):
    tokens: list[int]
    gaps: list[float]  # per step: top-1 minus top-2 logit (how close the choice was)


@torch.inference_mode()
def greedy_decode(model: LlamaModel, prompts: Sequence[Sequence[int]], max_tokens: int,
                  stop_token_ids: Iterable[int] = ()) -> list[Decoded]:
    """Greedy completion of every prompt, all live sequences in one forward pass per step, each on its
    own contiguous cache: up to `max_tokens` tokens, ending at (and including) a stop token."""
    stops = set(stop_token_ids)
    device = model.embed_tokens.weight.device
    caches = SequenceCaches(model, len(prompts))
    out = [Decoded([], []) for _ in prompts]
    feed = [list(p) for p in prompts]  # what each live sequence feeds next
    lengths = [0] * len(prompts)  # tokens already in each cache
    live = [i for i in range(len(prompts)) if max_tokens > 0]
    while live:
        counts = [len(feed[i]) for i in live]
        ids = torch.tensor([t for i in live for t in feed[i]], device=device)
        positions = torch.cat([torch.arange(lengths[i], lengths[i] + len(feed[i])) for i in live]).to(device)
        caches.select(live, counts)
        hidden = model(ids, positions, caches)
        last = (torch.tensor(counts).cumsum(0) - 1).to(device)
        top2 = model.compute_logits(hidden[last]).float().topk(2, dim=-1)
        still = []
        for row, i in enumerate(live):
            token = int(top2.indices[row, 0])
            out[i].tokens.append(token)
            out[i].gaps.append(float(top2.values[row, 0] - top2.values[row, 1]))
            lengths[i] += len(feed[i])
            feed[i] = [token]
            if token not in stops and len(out[i].tokens) < max_tokens:
                still.append(i)
        live = still
    return out


def greedy(model: LlamaModel, prompt: Sequence[int], max_tokens: int, stop_token_ids: Iterable[int] = ()) -> list[int]:
    """Greedy completion tokens of one prompt (see `greedy_decode`)."""
    return greedy_decode(model, [prompt], max_tokens, stop_token_ids)[0].tokens


def gaps_of(logprobs: Sequence[Mapping[int, float]]) -> list[float]:
    """Top-1 minus top-2 log-probability per step (equal to the logit gap) from an engine result's
    `logprobs` (requested with `logprobs >= 2`)."""
    return [a - b for a, b in (sorted(step.values(), reverse=True)[:2] for step in logprobs)]


@dataclass
class Mismatch:
    key: object
    step: int
    gap: float  # reference top-1 minus top-2 logit at the first differing step


def mismatches(reference: Mapping[K, Decoded], other: Mapping[K, Sequence[int]]) -> list[Mismatch]:
    """Each sequence of `other` that differs from the reference, with where it first differs. A sequence
    that is a strict prefix of the other (or longer) differs at the shorter one's end."""
    out = []
    for key, (tokens, gaps) in reference.items():
        got = list(other[key])
        if got != tokens:
            step = next((s for s, (a, b) in enumerate(zip(tokens, got)) if a != b), min(len(tokens), len(got)))
            out.append(Mismatch(key, step, gaps[step] if step < len(gaps) else float("inf")))
    return out


def assert_only_near_ties(reference: Mapping[K, Decoded], other: Mapping[K, Sequence[int]],
                          epsilon: float = 1e-3) -> None:
    """Every difference from the reference starts where its top-2 logits were within `epsilon`."""
    far = [vars(m) for m in mismatches(reference, other) if not m.gap < epsilon]
    assert not far, f"differences away from a near-tie (gap >= {epsilon}): {far}"
