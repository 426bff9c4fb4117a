"""Speculative decoding under tensor parallelism: the verification steps go to the workers as plain
`StepBatch`es, the draft runs on rank 0; greedy tokens equal one rank's plain decoding."""

from __future__ import annotations

import pytest

from pipeline.engine.config import EngineConfig, SpeculativeConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.loader import load_model
from pipeline.parallel.runner import open_model
from tests.parallel.engine_helpers import greedy, random_prompts
from tests.reference import assert_only_near_ties


@pytest.mark.slow
def test_draft_speculation_tp2_equals_single(tiny_model_dir, no_orphans):
    prompts = random_prompts(8, vocab=49152, seed=3)
    single = load_model(tiny_model_dir)
    reference = greedy(single, prompts, max_tokens=10)
    sampling = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    with open_model(tiny_model_dir, tensor_parallel=2) as sharded:
        engine = Engine(sharded.loaded, EngineConfig(kv_cache_memory="64MiB", tensor_parallel=2),
                        sharded.make_runner, SpeculativeConfig(method="draft", max_batch=64), single.model)
        got = {r.id: r.token_ids for r in engine.generate(Request(i, p, sampling) for i, p in enumerate(prompts))}
    assert engine.stats.spec_accepted > 0
    assert_only_near_ties(reference, got, epsilon=1e-3)
