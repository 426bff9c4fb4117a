"""Plain generation on the tiny checkpoint: greedy against transformers, sampling by its distribution."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.request import SamplingParams
from pipeline.generate import generate, generate_batch, generate_ids, sample_next
from pipeline.model.loader import load_model

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_greedy_matches_transformers(loaded, tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    ours = generate_ids(loaded.model, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    assert ours == expected[0, len(PROMPT) :].tolist()


def test_batch_equals_one_at_a_time(loaded):
    prompts = [PROMPT, PROMPT[:3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], PROMPT[2:]]
    greedy = SamplingParams(max_tokens=8)
    singles = [generate_ids(loaded.model, p, greedy) for p in prompts]
    assert generate_batch(loaded.model, prompts, greedy) == singles
    # Sequences stop on their own: the others carry on after one hits its end-of-sequence token.
    eos = [singles[1][2]]
    cut = [s[: s.index(eos[0]) + 1] if eos[0] in s else s for s in singles]
    assert generate_batch(loaded.model, prompts, greedy, eos) == cut
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    together = generate_batch(loaded.model, prompts, sampled)
    alone = [
        generate_ids(loaded.model, p, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i))
        for i, p in enumerate(prompts)
    ]
    assert together == alone


def test_stops_at_eos_and_stop_tokens(loaded):
    free = generate_ids(loaded.model, PROMPT, SamplingParams(max_tokens=6))
    assert len(free) == 6
    assert (
        generate_ids(loaded.model, PROMPT, SamplingParams(max_tokens=6), eos_token_ids=[free[2]]) == free[:3]
    )
    assert (
        generate_ids(loaded.model, PROMPT, SamplingParams(max_tokens=6, stop_token_ids=(free[1],)))
        == free[:2]
    )
    ignoring = SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=(free[1],))
    assert generate_ids(loaded.model, PROMPT, ignoring, eos_token_ids=[free[0]]) == free


def test_seeded_sampling_is_reproducible(loaded):
    def run(seed):
        return generate_ids(loaded.model, PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=seed))

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_sampling_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    gen = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.bincount(
        torch.tensor([sample_next(logits, SamplingParams(temperature=1.0), gen) for _ in range(n)]),
        minlength=5,
    )
    expected = torch.softmax(logits, 0) * n
    assert ((counts - expected).abs() < 4 * expected.sqrt() + 5).all(), (counts, expected)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.9, 1.0, 0.0, -1.0])
    probs = torch.softmax(logits, 0)
    gen = torch.Generator().manual_seed(1)

    def support(**kw) -> set[int]:
        return {sample_next(logits, SamplingParams(temperature=1.0, **kw), gen) for _ in range(300)}

    assert support(top_k=2) == {0, 1}
    assert support(top_p=float(probs[0]) - 1e-3) == {0}
    assert support(top_p=float(probs[0] + probs[1]) + 1e-3) == {0, 1, 2}
    assert support(min_p=0.5) == {0, 1}
    assert sample_next(logits, SamplingParams(), None) == 0


def test_text_generation_and_errors(loaded):
    texts = generate(loaded, ["Hi", "Hello there"], SamplingParams(max_tokens=4))
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch(loaded.model, [[5], []], SamplingParams())
    with pytest.raises(
        ValueError, match=r"prompt 0 \(2040 tokens\) \+ max_tokens \(10\) exceeds the model's 2048"
    ):
        generate_ids(loaded.model, [5] * 2040, SamplingParams(max_tokens=10))
