"""Scores and embeddings of rows that run LoRA adapters, on the CPU runner and on the GPU runner (its Triton
kernels under the interpreter): equal to `transformers` + `peft` with the adapter merged, in float32."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.adapters import LoraConfig
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.prefill import Embed, Score
from pipeline.engine.request import Request
from pipeline.model.loader import load_model
from tests.lora_adapters import make_adapters, merged_model
from tests.task.reference import pooled, reference_hidden, reference_logprobs

pytest.importorskip("peft")

PROMPT = [5, 17, 230, 4096, 77, 12, 9, 310, 41, 8, 1000, 23, 6, 99, 45, 2024, 7, 18]
CANDIDATE = [300, 301, 302]


def gpu_runner(model, num_blocks, block_size, device):
    pytest.importorskip("triton")
    from pipeline.engine.gpu_runner import GpuRunner

    return GpuRunner(model, num_blocks, block_size, device, cuda_graphs=False)


@pytest.mark.parametrize("runner", ["cpu", "gpu"])
def test_scores_and_embeddings_with_adapters_match_merged_transformers(tiny_model_dir, tmp_path, runner):
    adapters = make_adapters(tiny_model_dir, tmp_path)
    loaded = load_model(tiny_model_dir)
    lora = LoraConfig({k: str(v) for k, v in adapters.items()}, 4)
    extra = {"make_runner": gpu_runner} if runner == "gpu" else {}
    engine = Engine(loaded, EngineConfig(kv_cache_memory="16MiB", max_batched_tokens=64), lora=lora, **extra)
    names = [None, "a", "b"]
    requests = [Request(("score", a), PROMPT + CANDIDATE, prefill=Score(len(PROMPT)), adapter=a) for a in names]
    requests += [Request(("embed", a), PROMPT, prefill=Embed("mean", False), adapter=a) for a in names]
    results = {r.id: r for r in engine.generate(requests)}
    for name in names:
        reference = merged_model(tiny_model_dir, adapters.get(name))
        want = torch.tensor(reference_logprobs(reference, PROMPT, CANDIDATE))
        assert torch.allclose(torch.tensor(results["score", name].token_logprobs), want, atol=1e-4), name
        want = pooled(reference_hidden(reference, PROMPT), "mean", False)
        assert torch.allclose(torch.tensor(results["embed", name].embedding), want, atol=1e-4), name
