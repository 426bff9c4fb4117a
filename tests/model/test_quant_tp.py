"""Quantized linears under real tensor parallelism (gloo workers): each rank quantizes its own shard."""

from __future__ import annotations

import pytest

from pipeline.model.loader import load_model
from tests.parallel.engine_helpers import greedy, greedy_tp, random_prompts
from tests.reference import assert_only_near_ties


@pytest.mark.slow
@pytest.mark.parametrize("quant,group", [("int4", 32), ("int8", 32)])
def test_tiny_quantized_tp2_equals_single(tiny_model_dir, quant, group):
    """Every rank holds exactly its slice of the TP=1 quantized weights (int4 groups fall on the shard
    boundaries; int8 row-parallel weights are quantized whole, then sliced), so only the float summation
    order differs and only near-ties may flip."""
    prompts = random_prompts(16, vocab=49152, seed=1)
    single = greedy(load_model(tiny_model_dir, quant=quant, quant_group_size=group), prompts, max_tokens=6)
    tp = greedy_tp(tiny_model_dir, prompts, 6, tensor_parallel=2, quant=quant, quant_group_size=group)
    assert_only_near_ties(single, {i: d.tokens for i, d in tp.items()}, epsilon=1e-3)
