"""LoRA adapters on the real SmolLM2-135M (its GGUF dequantized to float32, model.quant=none): chat prompts
under two adapters and the base model in one batch give the greedy tokens of `transformers` + `peft` with
each adapter merged; a difference may only start at a near-tie (top-2 gap < 0.01, as test_smollm2.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.adapters import LoraConfig
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.loader import load_model
from tests.lora_adapters import make_adapter, reference_runs
from tests.reference import assert_only_near_ties, mismatches

pytest.importorskip("peft")

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly.",
             "List three prime numbers.", "How do plants make food?", "Say hello in Spanish."]
MAX_TOKENS = 12


@pytest.mark.slow
def test_smollm2_adapters_match_merged_transformers(smollm2_path, tmp_path):
    adapters = {"a": make_adapter(smollm2_path, tmp_path / "a", 8, ["q_proj", "v_proj"], std=0.02, seed=1),
                "b": make_adapter(smollm2_path, tmp_path / "b", 64, "all-linear", rslora=True, std=0.02, seed=2)}
    loaded = load_model(smollm2_path, dtype=torch.float32)
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    rows = [(p, name) for p in prompts for name in (None, "a", "b")]
    reference = reference_runs(smollm2_path, adapters, rows, MAX_TOKENS)
    engine = Engine(loaded, EngineConfig(kv_cache_memory="256MiB", max_batch_size=64),
                    lora=LoraConfig({k: str(v) for k, v in adapters.items()}))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    got = {r.id: r.token_ids for r in engine.generate(Request(i, p, sampling, adapter=a)
                                                       for i, (p, a) in enumerate(rows))}
    differ = mismatches(reference, got)
    print(f"{len(rows) - len(differ)}/{len(rows)} identical; differences (row, step, gap): "
          f"{[(m.key, m.step, round(m.gap, 5)) for m in differ]}")
    assert_only_near_ties(reference, got, epsilon=0.01)
    assert len({tuple(got[i]) for i in range(3)}) > 1  # the adapters change the continuation
