"""LoRA adapters under tensor parallelism (tp=2, gloo on CPU): each rank holds its shard of every adapter (B
cut by output rows on the column-parallel q/k/v and gate/up, A by input columns on the row-parallel o and
down, whose partial deltas join the all-reduce once); rows of three adapters and the base model in one
batch give the tokens of `transformers` + `peft` with each adapter merged."""

from __future__ import annotations

import pytest

from pipeline.engine.adapters import LoraConfig
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.parallel.runner import open_model
from tests.engine.test_lora import mixed_rows
from tests.lora_adapters import make_adapters, reference_runs
from tests.reference import assert_only_near_ties

pytest.importorskip("peft")

MAX_TOKENS = 6


@pytest.mark.slow
def test_tp2_mixed_adapters_match_merged_transformers(tiny_model_dir, tmp_path, no_orphans):
    adapters = make_adapters(tiny_model_dir, tmp_path)
    rows = mixed_rows(24, seed=1)
    reference = reference_runs(tiny_model_dir, adapters, rows, MAX_TOKENS)
    lora = LoraConfig({k: str(v) for k, v in adapters.items()}, max_loaded=2)  # reloads on every rank too
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with open_model(tiny_model_dir, tensor_parallel=2) as sharded:
        engine = Engine(sharded.loaded, EngineConfig(kv_cache_memory="64MiB", max_batch_size=16, tensor_parallel=2),
                        sharded.make_runner, lora=lora)
        results = {r.id: r.token_ids for r in engine.generate(
            Request(i, p, sampling, adapter=a) for i, (p, a) in enumerate(rows))}
    assert engine.adapters.loads > 3
    assert_only_near_ties(reference, results, epsilon=1e-3)
