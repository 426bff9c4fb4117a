"""Prefill-only requests (`Request.prefill`): scores and embeddings on a tiny random float32 Llama, against a
plain full-sequence forward pass on a contiguous cache (tests/reference.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.prefill import Embed, Score
from pipeline.engine.request import Request, SamplingParams
from pipeline.engine.runner import kv_bytes_per_block
from pipeline.engine.scheduler import Scheduler
from tests.engine.conftest import EOS, random_prompts
from tests.reference import ContiguousKVCache, greedy, prompt_logits

BLOCK = 4


def run(loaded, requests, **config) -> tuple[dict, Engine]:
    engine = Engine(loaded, EngineConfig(**{"kv_cache_memory": "8MiB", "block_size": BLOCK, **config}))
    results = {r.id: r for r in engine.generate(requests)}
    assert engine.kv.is_idle_whole()
    return results, engine


def reference_scores(model, prompt: list[int], candidate: list[int]) -> torch.Tensor:
    """Log-probability of each candidate token after the prompt and the candidate's earlier tokens."""
    ids = prompt + candidate
    lp = torch.log_softmax(prompt_logits(model, ids), -1)
    return torch.stack([lp[p - 1, ids[p]] for p in range(len(prompt), len(ids))])


@torch.no_grad()
def reference_hidden(model, ids: list[int]) -> torch.Tensor:
    """Final hidden states (after the final norm) of every position, in one pass on a fresh cache."""
    cfg = model.config
    return model(torch.tensor(ids), torch.arange(len(ids)), ContiguousKVCache(cfg.num_layers, model.scale))


def scored(prompts: list[list[int]], candidates: list[list[list[int]]],
           sampling: SamplingParams | None = None) -> list[Request]:
    return [Request((i, j), p + c, sampling or SamplingParams(), Score(len(p)))
            for i, (p, cands) in enumerate(zip(prompts, candidates)) for j, c in enumerate(cands)]


def test_scores_match_a_plain_forward_pass(tiny):
    """Candidates that share a prefix with each other and ones that do not, after block-aligned and unaligned
    prompts, prefilled in chunks of 8 tokens: every token's log-probability equals the reference's."""
    prompts = [random_prompts(1, 12, 12, seed=1)[0], random_prompts(1, 13, 13, seed=2)[0], [5]]
    shared = [7, 8, 9]
    candidates = [[shared + [1], shared + [2, 3], [4], [10, 11, 12, 13, 14, 15]],
                  [[3] * 9, [3] * 9 + [4]], [[6, 7], [6]]]
    results, engine = run(tiny, scored(prompts, candidates), max_batched_tokens=8)
    for (i, j), r in results.items():
        ref = reference_scores(tiny.model, prompts[i], candidates[i][j])
        assert r.finish_reason == "stop" and r.token_ids == [] and r.embedding is None
        assert r.prompt_tokens == len(prompts[i]) + len(candidates[i][j])
        assert torch.allclose(torch.tensor(r.token_logprobs), ref, atol=1e-5), (i, j)
    assert engine.stats.decode_tokens == 0 and engine.stats.cached_tokens > 0


def test_a_prompt_shared_by_candidates_is_computed_once(tiny):
    """One prompt, five candidates each filling the prompt's last block: the first candidate computes the
    prompt, the others only the prompt's last token (whose logits score their first token) and their own.
    Block-aligned (12 tokens) and not (14): the last prompt position is always computed."""
    for length in (12, 14):
        prompt = random_prompts(1, length, length, seed=length)[0]
        candidates = [random_prompts(1, 5, 5, seed=20 + j)[0] for j in range(5)]
        results, engine = run(tiny, scored([prompt], [candidates]))
        assert [results[0, j].cached_tokens for j in range(5)] == [0] + [length - 1] * 4
        assert engine.stats.prefill_tokens == length + 5 * 5 + 4
        for j, c in enumerate(candidates):
            assert torch.allclose(torch.tensor(results[0, j].token_logprobs), reference_scores(tiny.model, prompt, c),
                                  atol=1e-5)


def test_score_top_logprobs(tiny):
    prompt, candidate = random_prompts(1, 9, 9, seed=3)[0], [1, 2, 3]
    results, _ = run(tiny, scored([prompt], [[candidate]], SamplingParams(logprobs=2)))
    r = results[0, 0]
    lp = torch.log_softmax(prompt_logits(tiny.model, prompt + candidate), -1)
    assert len(r.logprobs) == 3 and len(r.logprob_tokens) == 3
    for k, (entry, token) in enumerate(zip(r.logprobs, candidate)):
        row = lp[len(prompt) - 1 + k]
        assert set(entry) == set(row.topk(2).indices.tolist()) | {token}
        for t, value in entry.items():
            assert value == pytest.approx(float(row[t]), abs=1e-5)
        assert entry[token] == r.token_logprobs[k]


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_match_pooled_reference_hidden_states(tiny, pooling, normalize):
    """Prompts sharing a prefix (the cache serves `last` pooling, not `mean`), prefilled in chunks."""
    shared = random_prompts(1, 10, 10, seed=4)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 9, seed=5)] + random_prompts(2, 3, 30, seed=6)
    task = Embed(pooling, normalize)
    results, engine = run(tiny, [Request(i, p, prefill=task) for i, p in enumerate(prompts)], max_batched_tokens=8)
    for i, p in enumerate(prompts):
        hidden = reference_hidden(tiny.model, p)
        want = hidden[-1] if pooling == "last" else hidden.mean(0)
        want = torch.nn.functional.normalize(want, dim=0) if normalize else want
        assert results[i].token_logprobs is None
        assert torch.allclose(torch.tensor(results[i].embedding), want, atol=1e-5), i
    assert (engine.stats.cached_tokens > 0) == (pooling == "last")


def test_mixed_batch_of_generation_scores_and_embeddings(tiny):
    """One engine run with all three kinds in the same steps: the embedding rows' hidden states and the other
    rows' logits come from one forward pass."""
    prompts = random_prompts(6, 5, 20, seed=7)
    requests = []
    for i, p in enumerate(prompts):
        requests.append(Request(("gen", i), p, SamplingParams(max_tokens=5)))
        requests.append(Request(("score", i), p + [3, 4], prefill=Score(len(p))))
        requests.append(Request(("embed", i), p, prefill=Embed("mean", False)))
    results, _ = run(tiny, requests, max_batched_tokens=64)
    for i, p in enumerate(prompts):
        assert results["gen", i].token_ids == greedy(tiny.model, p, 5, stop_token_ids=[EOS])
        assert torch.allclose(torch.tensor(results["score", i].token_logprobs),
                              reference_scores(tiny.model, p, [3, 4]), atol=1e-5)
        assert torch.allclose(torch.tensor(results["embed", i].embedding), reference_hidden(tiny.model, p).mean(0),
                              atol=1e-5)


@pytest.mark.parametrize("task", [Score(3), Embed("mean")])
def test_preempted_requests_record_each_position_once(tiny, monkeypatch, task):
    """Long generations growing in a pool of 12 blocks preempt the prefill-only requests admitted after them
    (prefilled 8 tokens a step), which compute again positions they recorded already: every score (of
    tokens 3.. of 10-20) and mean embedding still equals the reference."""
    prompts = random_prompts(8, 10, 20, seed=8)
    requests = [Request(("g", i), [i + 1] * 4, SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(4)]
    requests += [Request(i, p, prefill=task) for i, p in enumerate(prompts)]
    block_bytes = kv_bytes_per_block(tiny.model, BLOCK)
    recorded = []  # preempted prefill-only sequences that had recorded positions
    preempt = Scheduler._preempt

    def spy(scheduler, seq):
        state = seq.prefill
        recorded.extend([seq] if state is not None and (state.logprobs or state.pooled_positions) else [])
        preempt(scheduler, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    results, _ = run(tiny, requests, kv_cache_memory=12 * block_bytes, max_batched_tokens=8, max_model_len=40)
    assert recorded
    for i, p in enumerate(prompts):
        if isinstance(task, Score):
            assert torch.allclose(torch.tensor(results[i].token_logprobs), reference_scores(tiny.model, p[:3], p[3:]),
                                  atol=1e-5)
        else:
            want = torch.nn.functional.normalize(reference_hidden(tiny.model, p).mean(0), dim=0)
            assert torch.allclose(torch.tensor(results[i].embedding), want, atol=1e-5)


def test_bad_prefill_requests_are_error_results(tiny):
    ok = random_prompts(1, 6, 6, seed=9)[0]
    requests = [
        Request("start past the end", ok, prefill=Score(6)),
        Request("two samples", ok, SamplingParams(n=2), prefill=Embed()),
        Request("not a task", ok, prefill="mean"),
        Request("too long", [1] * 33, prefill=Embed()),
        Request("fills max_model_len", [1] * 32, prefill=Embed()),
    ]
    results, engine = run(tiny, requests, max_model_len=32)
    assert "no token to score" in results["start past the end"].error
    assert "n=2" in results["two samples"].error
    assert "must be Score, Embed or None" in results["not a task"].error
    assert "more than max_model_len=32" in results["too long"].error
    assert results["fills max_model_len"].finish_reason == "stop" and engine.stats.errors == 4
    with pytest.raises(ValueError, match="pooling"):
        Embed("max")
    with pytest.raises(ValueError, match="start"):
        Score(0)


def test_embeddings_and_scores_on_the_gpu_runner(tiny):
    """`GpuRunner.execute_hidden` (Triton kernels, run by the interpreter on CPU) in steps with sampling,
    score and embedding rows."""
    pytest.importorskip("triton")
    from pipeline.engine.gpu_runner import GpuRunner

    def make(model, num_blocks, block_size, device):
        return GpuRunner(model, num_blocks, block_size, device, cuda_graphs=False)

    prompts = random_prompts(3, 20, 40, seed=10)
    requests = [Request(("embed", i), p, prefill=Embed("last", False)) for i, p in enumerate(prompts)]
    requests += [Request(("score", i), p + [9], prefill=Score(len(p))) for i, p in enumerate(prompts)]
    requests += [Request(("gen", i), p, SamplingParams(max_tokens=3)) for i, p in enumerate(prompts)]
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB", block_size=16, max_batched_tokens=48),
                    make_runner=make)
    results = {r.id: r for r in engine.generate(requests)}
    for i, p in enumerate(prompts):
        assert torch.allclose(torch.tensor(results["embed", i].embedding), reference_hidden(tiny.model, p)[-1],
                              atol=1e-4)
        assert torch.allclose(torch.tensor(results["score", i].token_logprobs),
                              reference_scores(tiny.model, p, [9]), atol=1e-4)
        assert results["gen", i].token_ids == greedy(tiny.model, p, 3, stop_token_ids=[EOS])
