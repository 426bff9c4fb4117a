"""The engine on a loaded checkpoint with the real SmolLM2 tokenizer: text, stop strings, chat prompts."""

from __future__ import annotations

import pytest

from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.loader import load_model
from tests.reference import greedy

pytestmark = pytest.mark.slow


def test_greedy_text_and_stop_strings_on_tiny_checkpoint(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    tok = loaded.tokenizer
    questions = ["What is 2 + 2?", "Name a colour.", "Café au lait, s'il vous plaît.", "Write ½ as a decimal."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    refs = [greedy(loaded.model, p, 16) for p in prompts]
    texts = [tok.decode(r) for r in refs]
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]
    requests = [Request(i, p, SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(prompts)]
    requests += [
        Request(f"s{i}", p, SamplingParams(max_tokens=16, ignore_eos=True, stop=(stops[i],)))
        for i, p in enumerate(prompts)
        if stops[i].strip()
    ]
    engine = Engine(loaded, EngineConfig(kv_cache_memory="16MiB"))
    results = {r.id: r for r in engine.generate(requests)}
    for i in range(len(prompts)):
        assert results[i].token_ids == refs[i]
        assert results[i].text == texts[i]
        if f"s{i}" in results:
            stopped = results[f"s{i}"]
            assert stopped.finish_reason == "stop"
            assert stopped.text == texts[i][: texts[i].index(stops[i])]
    assert engine.kv.is_idle_whole()
