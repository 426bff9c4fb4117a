"""Compiled decoder layers (`LlamaModel.compile_layers`) against the same model run eagerly."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.loader import load_model
from tests.reference import assert_only_near_ties, greedy_decode, prompt_logits

IDS = [1, 504, 3459, 314, 260, 1789, 28, 1017, 7, 42, 9000, 17]
PROMPTS = [IDS, IDS[:5], [1, 77, 5000, 12, 900, 33, 2, 8]]


def test_compiled_w8a8_layers_match_eager(tiny_model_dir):
    eager = load_model(tiny_model_dir, quant="w8a8").model
    compiled = load_model(tiny_model_dir, quant="w8a8").model
    compiled.compile_layers()
    assert compiled.compiled and not eager.compiled
    ref = prompt_logits(eager, IDS)
    # fused quantization and reductions may round the last float32 bits differently, nothing more
    torch.testing.assert_close(prompt_logits(compiled, IDS), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # steps of 3, 2 and 1 rows (prefills of several lengths first): one graph for every token count
    reference = dict(enumerate(greedy_decode(eager, PROMPTS, 6)))
    other = {i: d.tokens for i, d in enumerate(greedy_decode(compiled, PROMPTS, 6))}
    assert_only_near_ties(reference, other)


def test_without_a_cpp_compiler_compiling_fails_clearly_and_auto_stays_eager(tiny_model_dir, monkeypatch):
    from pipeline.engine.engine import compile_layers_wanted

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    model = load_model(tiny_model_dir, quant="w8a8").model
    assert not compile_layers_wanted("auto", model, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        model.compile_layers()
    assert not model.compiled
