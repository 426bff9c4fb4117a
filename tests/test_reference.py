"""The test reference itself (tests/reference.py) on the tiny checkpoint: its greedy loop against
transformers, batched against one at a time, stop tokens, and the near-tie comparison."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.loader import load_model
from tests.reference import Decoded, greedy, greedy_decode, mismatches

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_greedy_matches_transformers(loaded, tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref(torch.tensor([PROMPT]))
        expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    decoded = greedy_decode(loaded.model, [PROMPT], 16)[0]
    assert decoded.tokens == expected[0, len(PROMPT):].tolist()
    top2 = out.logits[0, -1].float().topk(2).values
    assert decoded.gaps[0] == pytest.approx(float(top2[0] - top2[1]), abs=1e-4)


def test_batch_equals_one_at_a_time_and_stops_per_sequence(loaded):
    prompts = [PROMPT, PROMPT[:3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], PROMPT[2:]]
    singles = [greedy(loaded.model, p, 8) for p in prompts]
    assert all(len(s) == 8 for s in singles)
    assert [d.tokens for d in greedy_decode(loaded.model, prompts, 8)] == singles
    # Sequences stop on their own (the stop token included): the others carry on.
    stop = singles[1][2]
    cut = [s[: s.index(stop) + 1] if stop in s else s for s in singles]
    assert cut[1] == singles[1][:3] and any(c == s for c, s in zip(cut, singles))
    assert [d.tokens for d in greedy_decode(loaded.model, prompts, 8, stop_token_ids=[stop])] == cut


def test_mismatches_report_the_first_differing_step_and_its_gap():
    reference = {"a": Decoded([1, 2, 3], [5.0, 0.5, 2.0]), "b": Decoded([4, 5], [1.0, 1.0]),
                 "c": Decoded([6, 7], [0.1, 0.2])}
    found = mismatches(reference, {"a": [1, 9, 9], "b": [4, 5], "c": [6]})
    assert [(m.key, m.step, m.gap) for m in found] == [("a", 1, 0.5), ("c", 1, 0.2)]
