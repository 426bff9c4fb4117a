"""Continuous batching: which sequences run this step, and how many of their tokens.

One token budget per step (`max_batched_tokens`) and a cap on running samples (`max_batch_size`).
Running sequences are served first, decodes (one token each, plus the tokens a speculating sequence
guessed) before prefill chunks, so a long prompt is cut into chunks that ride along with the decodes
instead of stalling them. Waiting sequences are then admitted strictly in arrival order while budget,
slots and blocks last. When blocks run out, the most recently admitted sequence is preempted: its blocks
are freed and it is recomputed later (full blocks it had registered usually survive in the prefix cache, so
recomputation is often a cache hit). Guesses never cause a preemption: without blocks for them they are
dropped, and they are cut to the token budget.

Group-aware admission: a waiting sequence whose next uncached full block is being prefilled right now by a
running sequence is held back (later arrivals may pass it) until that block is cached, so a prefix shared
by many waiting rows is computed once rather than once per row admitted in the same step.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from pipeline.engine.kv_cache import KVCacheManager, extend_block_hashes
from pipeline.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from pipeline.engine.adapters import AdapterManager


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batched_tokens: int, max_batch_size: int,
                 adapters: AdapterManager | None = None):
        """`adapters`: a LoRA run's resident adapters; a sample is admitted once its adapter has a slot."""
        self.kv = kv
        self.adapters = adapters
        self.max_batched_tokens = max_batched_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.held = 0  # admissions deferred because a running sequence was computing the same prefix

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def slots_used(self) -> int:
        """Running samples plus the samples they will fork into after their prefill."""
        return sum(1 + s.num_children for s in self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick this step's work as (sequence, number of its uncomputed tokens to compute now)."""
        budget = self.max_batched_tokens
        scheduled: dict[Sequence, int] = {}
        order = sorted(self.running, key=lambda s: s.num_uncomputed > 1)  # decodes first, stable
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed + len(seq.draft), budget)
            if seq.draft and not self.kv.allocate(seq, n):  # guesses never preempt anyone: drop them
                seq.draft = []
                n = min(seq.num_uncomputed, budget)
            while not self.kv.allocate(seq, n):
                victim = self.running.pop()
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                del seq.draft[max(0, n - seq.num_uncomputed) :]  # guesses past the budget wait
                scheduled[seq] = n
                budget -= n
        budget = self._admit(scheduled, budget)
        return list(scheduled.items())

    def _admit(self, scheduled: dict[Sequence, int], budget: int) -> int:
        bs = self.kv.block_size
        pending = self._pending_hashes()
        slots = self.slots_used
        held: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if slots + 1 + seq.num_children > self.max_batch_size:
                break
            matched = self.kv.match_prefix(seq)
            if pending and self._next_block_pending(seq, len(matched), pending):
                held.append(self.waiting.popleft())
                self.held += 1
                continue
            partial = self.kv.match_partial(seq, matched)
            start = len(matched) * bs + (partial[1] if partial else 0)
            n = min(seq.num_tokens - start, budget)
            reclaimed = sum(1 for b in matched if self.kv.ref_count[b] == 0)  # taken out of the free queue
            if -(-(start + n) // bs) - len(matched) + reclaimed > self.kv.num_free:
                break
            if self.adapters is not None and not self.adapters.acquire(seq):
                break  # every adapter slot is held by running samples
            self.waiting.popleft()
            self.kv.admit(seq, matched, partial)
            if not self.kv.allocate(seq, n):
                raise AssertionError("block accounting out of sync with admission check")
            if seq.num_cached < 0:
                seq.num_cached = start
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled[seq] = n
            budget -= n
            slots += 1 + seq.num_children
            if self.kv.prefix_caching:
                pending.update(self._prefill_hashes(seq))
        self.waiting.extendleft(reversed(held))
        return budget

    def _prefill_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full blocks seq has yet to compute."""
        bs = self.kv.block_size
        hashes = extend_block_hashes(seq, bs, seq.num_tokens // bs * bs)
        return hashes[seq.num_computed // bs :]

    def _pending_hashes(self) -> set[int]:
        if not self.kv.prefix_caching:
            return set()
        pending: set[int] = set()
        for seq in self.running:
            if seq.num_uncomputed > 1:
                pending.update(self._prefill_hashes(seq))
        return pending

    def _next_block_pending(self, seq: Sequence, num_matched: int, pending: set[int]) -> bool:
        limit = seq.first_needed // self.kv.block_size  # blocks past it are computed anyway
        return num_matched < limit and seq.block_hashes[num_matched] in pending

    def _preempt(self, seq: Sequence) -> None:
        self.kv.release(seq)
        self._release_adapter(seq)
        seq.draft = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        self._release_adapter(seq)
        seq.status = Status.FINISHED

    def _release_adapter(self, seq: Sequence) -> None:
        if self.adapters is not None:
            self.adapters.release(seq)
