"""Worker specs for the tensor-parallel tests: a tiny random Llama (the weights of tests/tiny_model.py)
that each rank builds and shards itself, with optional failures injected on one rank."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.model.collectives import TPGroup
from pipeline.model.config import ModelConfig
from pipeline.model.hf_file import config_from_hf
from pipeline.model.llama import LlamaModel
from tests.reference import ContiguousKVCache


def tiny_config() -> ModelConfig:
    from tests.tiny_model import TINY_CONFIG

    return config_from_hf({"architectures": ["LlamaForCausalLM"], **TINY_CONFIG}, Path("tests/tiny_model.py"))


class SequenceExecutor:
    """One sequence on a contiguous KV cache: step inputs [ids, positions] -> logits of the last token."""

    def __init__(self, model: LlamaModel, fail_at_step: int | None = None, crash: bool = False):
        self.model = model
        self.cache = ContiguousKVCache(model.config.num_layers, model.scale)
        self.steps = 0
        self.fail_at_step = fail_at_step
        self.crash = crash

    def execute(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if self.steps == self.fail_at_step:
            if self.crash:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure at step {self.steps}")
        self.steps += 1
        ids, positions = inputs
        hidden = self.model(ids, positions, self.cache)
        return self.model.compute_logits(hidden[-1:])[0]


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Builds the tiny model's shard for a rank; `fail_rank` misbehaves at build or at `fail_step`."""

    seed: int = 0
    fail_rank: int | None = None
    fail_step: int | None = None  # None: fail while building
    crash: bool = False  # die by SIGKILL instead of raising

    def build(self, group: TPGroup, device: str) -> SequenceExecutor:
        from tests.tiny_model import TINY_CONFIG, tiny_state_dict

        failing = group.rank == self.fail_rank
        if failing and self.fail_step is None:
            raise ValueError(f"injected load failure on rank {group.rank}")
        model = LlamaModel(tiny_config(), group, torch.float32)
        model.load_weights(tiny_state_dict(TINY_CONFIG, self.seed).items())
        return SequenceExecutor(model, self.fail_step if failing else None, self.crash)
