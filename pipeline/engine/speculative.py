"""Proposers for speculative decoding: cheap guesses of a sequence's next tokens, verified by the model.

A proposer returns, for each sequence asked, up to k token ids that it expects to follow `seq.token_ids`
(possibly none). Proposals are deterministic (no draft distribution), so the engine's acceptance test
treats the proposal as a one-hot q: greedy rows keep the longest prefix equal to the model's argmaxes;
sampled rows accept a guess with the model's probability of it (see `sampler.verify`).

- `NgramProposer` (prompt lookup): find the last n tokens (n from ngram_max down to ngram_min) earlier in
  the prompt and output, and propose what followed them. Free, and right whenever the output copies its
  input (rewrites, extraction, code edits).
- `DraftProposer`: a smaller model with the same tokenizer runs greedily k steps ahead. It has its own
  paged KV cache (its own block pool, same block size) kept in step with the target's: before each
  proposal its cache is rolled back to the longest prefix still equal to the sequence's tokens (rejected
  guesses drop out) and the new tokens are computed.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kernels.argmax import row_argmax
from pipeline.engine.config import SpeculativeConfig
from pipeline.engine.kv_cache import KVCacheManager
from pipeline.engine.runner import Runner, build_batch
from pipeline.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] guessed next tokens for seqs[i] (an empty list: no guess)."""
        ...

    def release(self, seq: Sequence) -> None:
        """seq is finished: drop whatever the proposer keeps for it."""
        ...


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest matching suffix n-gram."""
        size = len(tokens)
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            suffix = tokens[size - n :]
            last = suffix[-1]
            # Scan candidate end positions right to left: the nearest earlier copy is the best predictor.
            for end in range(size - 2, n - 2, -1):
                if tokens[end] == last and tokens[end - n + 1 : end + 1] == suffix:
                    return tokens[end + 1 : end + 1 + k]
        return []

    def release(self, seq: Sequence) -> None:
        pass


class DraftProposer:
    """Greedy guesses from a draft model, with a paged KV cache of its own (`num_blocks` blocks)."""

    def __init__(self, model: Any, num_blocks: int, block_size: int, device: torch.device):
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching=False)
        self.runner = Runner(model, num_blocks, block_size, device)
        self.block_size = block_size
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> the draft's copy (its own block table)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        active: list[tuple[int, Sequence, int]] = []  # (index, shadow, k)
        work: list[tuple[Sequence, int]] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            shadow = self._sync(seq)
            n = shadow.num_uncomputed
            if not self.kv.allocate(shadow, n + k - 1):  # draft pool full: no guess for this one now
                self.release(seq)
                continue
            active.append((i, shadow, k))
            work.append((shadow, n))
        for step in range(max((k for _, _, k in active), default=0)):
            if step:
                work = [(shadow, 1) for _, shadow, k in active if k > step]
            batch, samplers, _ = build_batch(work, self.block_size)  # prompt-logprob rows, if any, come last
            tokens = row_argmax(self.runner.execute(batch)[: len(samplers)]).tolist()
            for shadow, n in work:
                shadow.num_computed += n
            by_shadow = dict(zip(samplers, tokens))
            for i, shadow, k in active:
                if k > step:
                    token = by_shadow[shadow]
                    shadow.token_ids.append(token)
                    proposals[i].append(token)
        return proposals

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft's copy of seq, rolled back to the longest prefix equal to seq.token_ids and then given
        seq's remaining tokens to compute."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.seq_id, seq.request_id, seq.sample_index, [], 0, seq.sampling, 0, None)
            self.shadows[seq.seq_id] = shadow
        same = 0
        for a, b in zip(shadow.token_ids, seq.token_ids):
            if a != b:
                break
            same += 1
        self.kv.truncate(shadow, min(shadow.num_computed, same, len(seq.token_ids) - 1))
        shadow.token_ids = list(seq.token_ids)
        return shadow

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.kv.release(shadow)


def make_proposer(spec: SpeculativeConfig, draft_model: Any, vocab_size: int, num_blocks: int, block_size: int,
                  device: torch.device) -> Proposer | None:
    """The proposer `spec` asks for (None for method none); a draft pool has as many blocks as the target's."""
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.method != "draft":
        return None
    if draft_model is None:
        raise ValueError("speculative.method=draft needs a draft model (Engine(..., draft_model=...))")
    if draft_model.config.vocab_size != vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft_model.config.vocab_size} tokens, the model's "
                         f"{vocab_size}: speculative.draft.path must share the model's tokenizer")
    if draft_model.tp.size != 1:
        raise ValueError("the draft model runs on rank 0 alone; load it without tensor parallelism")
    if next(draft_model.parameters()).device != device:
        draft_model.to(device)
    return DraftProposer(draft_model, num_blocks, block_size, device)
