"""Constrained decoding in the engine on the tiny random Llama with the SmolLM2 tokenizer: outputs checked
against the constraint itself (jsonschema, Python's re, the choice list), not against the grammar library."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.constraints import Constraints
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.loader import load_model

SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["positive", "negative"]}, "score": {"type": "integer", "maximum": 9},
                   "ok": {"type": "boolean"}},
    "required": ["label", "score", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


def run(loaded, requests, **engine):
    e = Engine(loaded, EngineConfig(kv_cache_memory="64MiB", **engine))
    return e, sorted(e.generate(requests), key=lambda r: (r.id, r.sample_index))


def prompts(loaded, count):
    return [loaded.tokenizer.encode(f"Review {i}: the product was fine, rate it.") for i in range(count)]


def test_json_regex_and_choice_outputs_satisfy_their_constraints(loaded):
    kinds = [
        SamplingParams(max_tokens=40, json_schema=json.dumps(SCHEMA)),
        SamplingParams(max_tokens=20, regex=r"[0-9]{3}-[a-z]{2}"),
        SamplingParams(max_tokens=20, choice=("yes", "no", "maybe not")),
        SamplingParams(max_tokens=40, json_schema=json.dumps(SCHEMA), temperature=1.0, seed=3, n=3),
        SamplingParams(max_tokens=20, choice=("yes", "no", "maybe not"), temperature=1.5, seed=4, n=4),
    ]
    requests = [Request((k, i), p, kinds[k]) for k in range(len(kinds)) for i, p in enumerate(prompts(loaded, 4))]
    _, results = run(loaded, requests, max_batch_size=16)
    assert len(results) == 4 * (1 + 1 + 1 + 3 + 4)
    for r in results:
        kind = kinds[r.id[0]]
        assert r.finish_reason == "stop" and r.error is None, (r.text, r.error)
        if kind.json_schema:
            jsonschema.validate(json.loads(r.text), SCHEMA)
        elif kind.regex:
            assert re.fullmatch(kind.regex, r.text)
        else:
            assert r.text in kind.choice
    sampled = {r.text for r in results if r.id[0] == 4}
    assert len(sampled) > 1  # sampled choices vary: the mask restricts, it does not pick


def test_prefix_cached_rows_still_satisfy_the_schema(loaded):
    """Many rows behind one long shared prompt: their prompts come from the prefix cache."""
    shared = loaded.tokenizer.encode("You label reviews as JSON. " * 8)
    requests = [Request(i, shared + loaded.tokenizer.encode(f"Review {i}"),
                        SamplingParams(max_tokens=40, json_schema=json.dumps(SCHEMA))) for i in range(12)]
    engine, results = run(loaded, requests, block_size=16, max_batch_size=12)
    assert engine.stats.cached_tokens > 0
    for r in results:
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_unfinished_and_bad_constraints(loaded):
    p = prompts(loaded, 1)[0]
    requests = [
        Request("short", p, SamplingParams(max_tokens=3, json_schema=json.dumps(SCHEMA))),
        Request("regex", p, SamplingParams(max_tokens=5, regex="[a-z", n=2)),
        Request("schema", p, SamplingParams(max_tokens=5, json_schema='{"type": 3}')),
    ]
    _, results = run(loaded, requests)
    by_id = {}
    for r in results:
        by_id.setdefault(r.id, []).append(r)
    short = by_id["short"][0]
    assert short.finish_reason == "incomplete" and short.completion_tokens == 3
    assert "did not complete its json_schema within max_tokens=3" in short.error
    assert [r.finish_reason for r in by_id["regex"]] == ["error", "error"]
    assert "regex" in by_id["regex"][0].error and "unclosed character class" in by_id["regex"][0].error
    assert by_id["schema"][0].finish_reason == "error" and "json_schema" in by_id["schema"][0].error
    assert all("\n" not in r.error for r in by_id["regex"] + by_id["schema"])  # one line, for a job's error


def test_mask_allows_exactly_the_tokens_that_keep_a_prefix_possible(loaded):
    """For a choice list, the allowed first tokens are those whose text starts some choice."""
    tok = loaded.tokenizer
    constraints = Constraints(tok.hf.to_str(), loaded.config.vocab_size, tok.eos_token_ids)
    choices = ("yes", "no", "maybe not")
    mask = constraints.masks([constraints.matcher(SamplingParams(choice=choices))])[0]
    allowed = set(torch.nonzero(mask).flatten().tolist())
    expect = {t for t in range(tok.vocab_size)
              if (text := tok.decode([t])) and any(c.startswith(text) for c in choices)}
    assert allowed == expect
