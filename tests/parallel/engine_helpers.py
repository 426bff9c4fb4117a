"""Greedy runs of the engine with and without tensor parallelism, and their comparison."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.engine.runner import Runner, RunnerFactory
from pipeline.parallel.runner import open_model


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (3..40 tokens) so a step mixes prefill chunks and decodes."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def greedy(loaded, prompts: list[list[int]], max_tokens: int, tensor_parallel: int = 1,
           make_runner: RunnerFactory = Runner) -> dict[int, tuple]:
    """id -> (tokens, per-step top-2 logprobs) for greedy decoding of every prompt in one batch."""
    config = EngineConfig(kv_cache_memory="64MiB", max_batched_tokens=256, tensor_parallel=tensor_parallel)
    engine = Engine(loaded, config, make_runner)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    out = {r.id: (r.token_ids, r.logprobs)
           for r in engine.generate(Request(i, p, sampling) for i, p in enumerate(prompts))}
    assert all(len(t) == max_tokens for t, _ in out.values())
    return out


def greedy_tp(path, prompts, max_tokens: int, tensor_parallel: int, **load) -> dict[int, tuple]:
    with open_model(path, tensor_parallel=tensor_parallel, **load) as sharded:
        return greedy(sharded.loaded, prompts, max_tokens, tensor_parallel, sharded.make_runner)


@dataclass
class Mismatch:
    prompt: int
    step: int
    gap: float  # reference top-1 minus top-2 logit at the first differing step


def mismatches(reference: dict[int, tuple], other: dict[int, tuple]) -> list[Mismatch]:
    out = []
    for i, (tokens, logprobs) in reference.items():
        got = other[i][0]
        if got != tokens:
            step = next(s for s, (a, b) in enumerate(zip(tokens, got)) if a != b)
            top = sorted(logprobs[step].values(), reverse=True)
            out.append(Mismatch(i, step, top[0] - top[1]))
    return out
