"""Greedy runs of the engine with and without tensor parallelism, and their comparison."""

from __future__ import annotations

import random

from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.engine.runner import Runner, RunnerFactory
from pipeline.parallel.runner import open_model
from tests.reference import Decoded, gaps_of


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (3..40 tokens) so a step mixes prefill chunks and decodes."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def greedy(loaded, prompts: list[list[int]], max_tokens: int, tensor_parallel: int = 1,
           make_runner: RunnerFactory = Runner) -> dict[int, Decoded]:
    """id -> (tokens, per-step top-2 gaps) for greedy decoding of every prompt in one batch."""
    config = EngineConfig(kv_cache_memory="64MiB", max_batched_tokens=256, tensor_parallel=tensor_parallel)
    engine = Engine(loaded, config, make_runner)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    out = {r.id: Decoded(r.token_ids, gaps_of(r.logprobs))
           for r in engine.generate(Request(i, p, sampling) for i, p in enumerate(prompts))}
    assert all(len(d.tokens) == max_tokens for d in out.values())
    return out


def greedy_tp(path, prompts, max_tokens: int, tensor_parallel: int, **load) -> dict[int, Decoded]:
    with open_model(path, tensor_parallel=tensor_parallel, **load) as sharded:
        return greedy(sharded.loaded, prompts, max_tokens, tensor_parallel, sharded.make_runner)
