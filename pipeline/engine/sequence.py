"""One sample being generated: its tokens, its place in the KV cache, and its own random generator."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.engine.prefill import PrefillState, first_needed
from pipeline.engine.request import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt plus what was sampled so far. `num_computed` tokens have their K/V in `block_table`.

    `token_ids[num_computed:]` still has to go through the model; when it is all computed the last
    position's logits are sampled. After a preemption num_computed drops to 0 and the whole thing
    (prompt + outputs) is recomputed.
    """

    seq_id: int
    request_id: Any
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    base_seed: int  # the request's seed (drawn from the engine's generator when it has none)
    generator: torch.Generator | None
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached: int = -1  # prompt tokens served by the prefix cache at first admission; -1 = not admitted
    block_table: list[int] = field(default_factory=list)
    # Chained content hashes of the full blocks of token_ids (computed lazily, see kv_cache.extend_block_hashes).
    block_hashes: list[int] = field(default_factory=list)
    # Prefix-cache identity of each block in block_table that holds confirmed content, see kv_cache.
    block_serials: list[int] = field(default_factory=list)
    text: str = ""
    decoder: Any = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # entry p: of prompt token p given 0..p-1
    finish_reason: str | None = None
    num_children: int = 0  # samples of the same request still to fork from this one after its prefill
    matcher: Any = None  # the constraint's grammar state (llguidance.LLMatcher) when the request has one
    prefill: PrefillState | None = None  # a request that samples nothing (scoring, embedding)
    # Speculative decoding: tokens guessed to follow token_ids, checked by this step's forward (not part of
    # token_ids until accepted), and how many this sequence may guess (adapted with speculative.adaptive_k).
    draft: list[int] = field(default_factory=list)
    spec_k: int = 0
    # LoRA: the adapter this sample runs (its key in `pipeline.engine.adapters`; None: the base model), part
    # of its blocks' prefix-cache identity, and the resident slot it holds while running (-1: none)
    adapter: str | None = None
    lora_slot: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def first_needed(self) -> int:
        """The first position whose output (logits or hidden state) this sequence needs: the prefix cache may
        serve only the positions before it. The last one's logits to sample; with prompt logprobs, every
        prompt position's; a prefill-only request's own (`pipeline.engine.prefill.first_needed`)."""
        if self.prefill is not None:
            return first_needed(self.prefill.task, self.num_tokens)
        return 0 if self.sampling.prompt_logprobs else self.num_tokens - 1
