"""Turn each sampling row's logits into its next token, per request parameters.

Greedy rows take the argmax. Sampled rows apply, in this order: temperature, top-k, top-p (on the top-k
renormalized distribution), min-p (relative to the most likely token), then draw by an exponential race:
each vocabulary id gets an Exp(1) number E from the sequence's own `torch.Generator` and the kept token with
the largest p / E wins (an exact draw from the kept distribution; the Gumbel-max trick). Every operation is
row-wise, so a seeded request draws the same tokens alone or in any batch.

Rows without top-k / top-p / min-p skip the sort those filters need (`bench/sampler.py` times a step).

Why a race and not the inverse CDF: logits of the same row differ in the last bits between batch shapes
(another matmul blocking), and a CDF summed over a whole vocabulary moves by that much at every token
boundary, so a near-flat distribution flipped draws between batch sizes. The race flips only when the two
best p / E are within that rounding of each other, and draws are tied to token ids, not to sorted ranks. Logprobs, when asked, are of the model's own distribution
(before temperature and filters): the chosen token plus the top-k alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engine.sequence import Sequence


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def filter_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept probabilities in descending order [R, V] (zeros where filtered, not renormalized) and the
    token ids of each column. Per-row parameters are [R] tensors; top_k 0 means off."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_p = sorted_p.masked_fill(rank >= k, 0.0)
    # top-p over the renormalized top-k mass: keep a token if the mass before it is still < top_p.
    mass_before = (sorted_p.cumsum(-1) - sorted_p) / sorted_p.sum(-1, keepdim=True)
    sorted_p = sorted_p.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), 0.0)
    sorted_p = sorted_p.masked_fill(sorted_p < min_p[:, None] * sorted_p[:, :1], 0.0)
    return sorted_p, order


def exponential_draws(seqs: list[Sequence], rows: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] Exp(1) numbers, row i from seqs[rows[i]]'s generator, one per vocabulary id."""
    u = torch.stack([torch.rand(vocab, generator=seqs[i].generator) for i in rows]).to(device)
    return (-torch.log1p(-u)).clamp_min_(1e-30)  # u in [0, 1): E > 0, so a filtered token (p = 0) never wins


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
    """One token per row of `logits` [R, V] (float32), row i belonging to seqs[i]."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
    if sampled_rows:
        params = [seqs[i].sampling for i in sampled_rows]
        dev = logits.device  # the generators are CPU ones: their draws move to the logits' device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        if all(p.top_k == 0 and p.top_p == 1 and p.min_p == 0 for p in params):  # nothing filtered: no sort
            by_id = torch.softmax(logits[sampled_rows] / temperature[:, None], dim=-1)
        else:
            kept, order = filter_probs(
                logits[sampled_rows], temperature,
                torch.tensor([p.top_k for p in params], device=dev),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev),
            )
            by_id = torch.zeros_like(kept).scatter_(1, order, kept)  # kept probabilities in vocabulary order
        tokens[sampled_rows] = (by_id / exponential_draws(seqs, sampled_rows, by_id.shape[-1], dev)).argmax(dim=-1)
    token_list = tokens.tolist()
    logprobs: list[dict[int, float] | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.sampling.logprobs]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        k = max(seqs[i].sampling.logprobs for i in want)
        top_v, top_i = lp.topk(k, dim=-1)
        for row, i in enumerate(want):
            n = seqs[i].sampling.logprobs
            entry = dict(zip(top_i[row, :n].tolist(), top_v[row, :n].tolist()))
            entry[token_list[i]] = float(lp[row, token_list[i]])
            logprobs[i] = entry
    return Sampled(token_list, logprobs)
