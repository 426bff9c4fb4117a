"""Turn each sampling row's logits into its next token, per request parameters.

First the logits are adjusted (greedy and sampled rows alike): tokens a row's constraint forbids are
masked (`pipeline.engine.constraints`); `logit_bias` is added; under `min_tokens`
the end-of-sequence and stop tokens are masked; then the penalties (vLLM's semantics, see `SamplingParams`)
apply: repetition over prompt + output tokens, presence and frequency over output tokens. Greedy rows then
take the argmax. Sampled rows apply, in this order: temperature, top-k, top-p (on the top-k
renormalized distribution), min-p (relative to the most likely token), then draw by an exponential race:
each vocabulary id gets an Exp(1) number E from the sequence's own `torch.Generator` and the kept token with
the largest p / E wins (an exact draw from the kept distribution; the Gumbel-max trick). Every operation is
row-wise, so a seeded request draws the same tokens alone or in any batch.

Rows without top-k / top-p / min-p skip the sort those filters need; rows with them sort only their
1,024 most likely tokens unless the filters reach past them (`bench/sampler.py` times a step).

Why a race and not the inverse CDF: logits of the same row differ in the last bits between batch shapes
(another matmul blocking), and a CDF summed over a whole vocabulary moves by that much at every token
boundary, so a near-flat distribution flipped draws between batch sizes. The race flips only when the two
best p / E are within that rounding of each other, and draws are tied to token ids, not to sorted ranks.

Logprobs, when asked, are of the model's own distribution
(before temperature and filters): the chosen token plus the top-k alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.argmax import row_argmax
from pipeline.engine.sequence import Sequence

# (rows of the batch, their allowed next tokens [len(rows), V] bool): constrained decoding's mask.
Allowed = tuple[list[int], torch.Tensor]


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


NUCLEUS_WIDTH = 1024  # the most likely tokens sorted first; a row that keeps more is sorted whole


def filter_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Kept probabilities [R, V] in vocabulary order (zeros where filtered, not renormalized). Per-row
    parameters are [R] tensors; top_k 0 means off.

    Sorting a whole 49,152-token vocabulary per row is most of a filtered step on CPU (270 ms for 128 rows
    on the development machine), while the kept tokens are nearly always among the few hundred most likely.
    So on CPU each row's `NUCLEUS_WIDTH` most likely are taken first (top-k), and a row is sorted whole only
    where its filters do not close inside them: top-k wider than that, or a nucleus / min-p reaching past."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab)
    total = probs.sum(-1)
    width = min(vocab, NUCLEUS_WIDTH) if probs.device.type == "cpu" else vocab
    if width == vocab:  # nothing to save: a small vocabulary, or a GPU, where sorting is cheap
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        return torch.zeros_like(probs).scatter_(1, order, _kept_sorted(sorted_p, k, top_p, min_p, total))
    head_p, head_order = probs.topk(width, dim=-1)  # descending
    # Tokens past the head are dropped by top-k, or, with top-k off (the nucleus is then over the whole
    # distribution), by top-p (the head's mass reaches top_p) or min-p (the head's last is below it).
    nucleus = (top_p < 1) & (head_p.sum(-1) >= top_p * total)
    closed = (k <= width) | ((k >= vocab) & (nucleus | (head_p[:, -1] < min_p * head_p[:, 0])))
    by_id = torch.zeros_like(probs)
    by_id.scatter_(1, head_order, _kept_sorted(head_p, k, top_p, min_p, total))
    open_rows = (~closed).nonzero().squeeze(1)
    if open_rows.numel():
        sorted_p, order = probs[open_rows].sort(dim=-1, descending=True, stable=True)
        kept = _kept_sorted(sorted_p, k[open_rows], top_p[open_rows], min_p[open_rows], total[open_rows])
        by_id[open_rows] = torch.zeros_like(sorted_p).scatter_(1, order, kept)
    return by_id


def _kept_sorted(sorted_p: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 total: torch.Tensor) -> torch.Tensor:
    """The filters over the first columns of each row's descending probabilities (zeros where dropped).
    `total` is the row's whole probability mass: the top-k mass when top-k reaches past the columns."""
    width = sorted_p.shape[-1]
    rank = torch.arange(width, device=sorted_p.device)[None, :]
    sorted_p = sorted_p.masked_fill(rank >= k[:, None], 0.0)
    mass = torch.where(k <= width, sorted_p.sum(-1), total)[:, None]
    # top-p over the renormalized top-k mass: keep a token if the mass before it is still < top_p (top_p 1
    # is off: a sum rounded up to the whole mass must not drop the tail).
    mass_before = (sorted_p.cumsum(-1) - sorted_p) / mass
    sorted_p = sorted_p.masked_fill((mass_before >= top_p[:, None]) & (rank > 0) & (top_p < 1)[:, None], 0.0)
    return sorted_p.masked_fill(sorted_p < min_p[:, None] * sorted_p[:, :1], 0.0)


def penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition, presence and frequency penalties applied to rows [R, V] (in place), row i for seqs[i]."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.penalized]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    sub = logits[rows]
    counts = torch.zeros(len(rows), vocab, device=dev)  # occurrences in the output
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)  # anywhere in prompt or output
    for r, i in enumerate(rows):
        seq = seqs[i]
        out = torch.tensor(seq.output_ids, dtype=torch.long, device=dev)
        counts[r].scatter_add_(0, out, torch.ones(len(out), device=dev))
        seen[r, torch.tensor(seq.token_ids, dtype=torch.long, device=dev)] = True
    params = [seqs[i].sampling for i in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    sub = sub - freq * counts - presence * (counts > 0)
    logits[rows] = sub
    return logits


def adjust(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int],
           allowed: Allowed | None = None) -> torch.Tensor:
    """The logits a request's parameters ask to draw from: constraint mask, bias, `min_tokens` mask (not for
    constrained rows: their constraint says when they may end), then penalties."""
    if allowed is not None:
        rows, mask = allowed
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(~mask.to(logits.device), float("-inf"))
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        if sp.logit_bias:
            ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(sp.logit_bias.values()), device=logits.device)
        if seq.num_output_tokens < sp.min_tokens and not sp.constrained:
            banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
            logits[i, sorted(banned)] = float("-inf")
    return penalize(logits, seqs)


def exponential_draws(seqs: list[Sequence], rows: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] Exp(1) numbers, row i from seqs[rows[i]]'s generator, one per vocabulary id."""
    u = torch.empty(len(rows), vocab)
    for r, i in enumerate(rows):
        torch.rand(vocab, generator=seqs[i].generator, out=u[r])
    # -log(1 - u), in place: each [rows, vocab] temporary is tens of MB at batch 128
    return u.neg_().log1p_().neg_().clamp_min_(1e-30).to(device)  # u in [0, 1): E > 0, a p = 0 token never wins


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int] = frozenset(),
           allowed: Allowed | None = None) -> Sampled:
    """One token per row of `logits` [R, V] (float32), row i belonging to seqs[i]; `allowed` masks the
    constrained rows. Logprobs are of the logits as given; the draw is from the adjusted ones."""
    raw = logits
    if allowed is not None or any(s.sampling.adjusts_logits for s in seqs):
        logits = adjust(logits.clone(), seqs, eos_token_ids, allowed)
    tokens = row_argmax(logits)
    sampled_rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
    if sampled_rows:
        params = [seqs[i].sampling for i in sampled_rows]
        dev = logits.device  # the generators are CPU ones: their draws move to the logits' device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        if all(p.top_k == 0 and p.top_p == 1 and p.min_p == 0 for p in params):  # nothing filtered: no sort
            by_id = torch.softmax(logits[sampled_rows] / temperature[:, None], dim=-1)
        else:
            by_id = filter_probs(
                logits[sampled_rows], temperature,
                torch.tensor([p.top_k for p in params], device=dev),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev),
            )
        tokens[sampled_rows] = row_argmax(by_id.div_(exponential_draws(seqs, sampled_rows, by_id.shape[-1], dev)))
    token_list = tokens.tolist()
    return Sampled(token_list, token_logprobs(raw, [s.sampling.logprobs for s in seqs], token_list))


def token_logprobs(logits: torch.Tensor, wanted: list[int], tokens: list[int]) -> list[dict[int, float] | None]:
    """Per row: the top-`wanted[i]` log-probabilities of the model's distribution plus the chosen token's
    (None where wanted[i] is 0)."""
    logprobs: list[dict[int, float] | None] = [None] * len(tokens)
    want = [i for i, k in enumerate(wanted) if k]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        top_v, top_i = lp.topk(max(wanted[i] for i in want), dim=-1)
        for row, i in enumerate(want):
            n = wanted[i]
            entry = dict(zip(top_i[row, :n].tolist(), top_v[row, :n].tolist()))
            entry[tokens[i]] = float(lp[row, tokens[i]])
            logprobs[i] = entry
    return logprobs


def verify(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
    """Check each sequence's guessed tokens (`seq.draft`) against the model: what each sequence emits.

    `logits` holds 1 + len(seq.draft) consecutive rows per sequence, in `seqs` order: row j is the model's
    next-token distribution after the sequence's tokens and the first j guesses. A sequence emits its
    accepted guesses and then one token of its own (a correction, or a bonus after all were accepted).
    Greedy: a guess is accepted while it equals the row's argmax, so the tokens are exactly greedy decoding's.
    Sampled: the speculative-sampling rule for a deterministic proposal (q one-hot), which leaves every
    emitted token distributed exactly as the plain sampler's: accept guess d with probability p(d) (p after
    temperature and filters); on rejection draw from p with d removed, renormalized (the residual
    max(0, p - q)); after all are accepted draw the bonus token from the next row's p.
    """
    sizes = [1 + len(s.draft) for s in seqs]
    firsts = [sum(sizes[:i]) for i in range(len(seqs))]
    greedy_tokens = row_argmax(logits).tolist()
    probs = _filtered_probs(logits, [s.sampling for s, size in zip(seqs, sizes) for _ in range(size)])
    out = []
    for seq, first in zip(seqs, firsts):
        emitted: list[int] = []
        for j, guess in enumerate([*seq.draft, None]):
            row = first + j
            if seq.sampling.greedy:
                token = greedy_tokens[row]
            elif guess is None:
                token = draw(probs[row], seq.generator)
            else:
                token = accept_or_resample(probs[row], guess, seq.generator)
            emitted.append(token)
            if token != guess:
                break
        if seq.sampling.logprobs:
            rows = logits[first : first + len(emitted)]
            out.append(Sampled(emitted, token_logprobs(rows, [seq.sampling.logprobs] * len(emitted), emitted)))
        else:
            out.append(Sampled(emitted, [None] * len(emitted)))
    return out


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """The sampler's distribution of each row in vocabulary order (rows of greedy params are left zero)."""
    probs = torch.zeros_like(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        chosen = [params[i] for i in rows]
        dev = logits.device
        kept = filter_probs(
            logits[rows],
            torch.tensor([p.temperature for p in chosen], dtype=torch.float32, device=dev),
            torch.tensor([p.top_k for p in chosen], device=dev),
            torch.tensor([p.top_p for p in chosen], dtype=torch.float32, device=dev),
            torch.tensor([p.min_p for p in chosen], dtype=torch.float32, device=dev),
        )
        probs[rows] = kept / kept.sum(-1, keepdim=True)
    return probs


def accept_or_resample(p: torch.Tensor, guess: int, generator: torch.Generator) -> int:
    """`guess` with probability p[guess], else a draw from p without it (renormalized)."""
    if float(torch.rand(1, generator=generator)) < float(p[guess]):
        return guess
    residual = p.clone()
    residual[guess] = 0.0
    return draw(residual, generator)


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index with probability proportional to the non-negative `weights` [V] (inverse CDF)."""
    cdf = weights.cumsum(0)
    u = float(torch.rand(1, generator=generator)) * float(cdf[-1])
    pick = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True))
    # Rounding may land past the last kept index; step back to the last index with weight.
    return min(pick, int(weights.nonzero()[-1]))
