"""Per-row LoRA adapters in the engine: rows of three adapters and the base model mixed in one batch give
the greedy tokens of `transformers` + `peft` with each adapter merged (float32, model.quant=none), whatever
the batch size; the prefix cache never shares a block across adapters; bad adapters are error results."""

from __future__ import annotations

import random

import pytest

from pipeline.engine.adapters import LoraConfig
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.loader import load_model
from tests.lora_adapters import make_adapter, make_adapters, reference_runs
from tests.reference import assert_only_near_ties, mismatches

pytest.importorskip("peft")

MAX_TOKENS = 8
VOCAB = 49152


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("lora"))


def mixed_rows(count: int, seed: int = 0) -> list[tuple[list[int], str | None]]:
    """(prompt, adapter) rows cycling base, a, b, c; prompts of 3..40 tokens, some sharing a 20-token
    prefix (and some the same prompt under every adapter), so the prefix cache has something to share."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    rows = []
    for i in range(count):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 20))]
        prompt = shared + tail if i % 3 == 0 else tail + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 20))]
        rows.append((prompt, [None, "a", "b", "c"][i % 4]))
    rows += [(shared + [7, 8, 9], adapter) for adapter in (None, "a", "b", "c")]
    return rows


def run(loaded, adapters, rows, max_batch_size: int, max_loaded: int = 4, **engine) -> dict:
    config = EngineConfig(**{"kv_cache_memory": "64MiB", "max_batched_tokens": 256, "max_batch_size": max_batch_size,
                             **engine})
    eng = Engine(loaded, config, lora=LoraConfig({k: str(v) for k, v in adapters.items()}, max_loaded))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {r.id: r for r in eng.generate(Request(i, p, sampling, adapter=a) for i, (p, a) in enumerate(rows))}
    assert eng.kv.is_idle_whole()
    return results, eng


@pytest.fixture(scope="module")
def rows_and_reference(tiny_model_dir, adapters):
    rows = mixed_rows(64)
    return rows, reference_runs(tiny_model_dir, adapters, rows, MAX_TOKENS)


@pytest.mark.parametrize("max_batch_size", [1, 64])
def test_mixed_adapters_match_merged_transformers(tiny_model_dir, adapters, rows_and_reference, max_batch_size):
    rows, reference = rows_and_reference
    results, engine = run(load_model(tiny_model_dir), adapters, rows, max_batch_size)
    tokens = {i: r.token_ids for i, r in results.items()}
    assert all(r.finish_reason == "length" for r in results.values())
    assert_only_near_ties(reference, tokens, epsilon=1e-3)
    assert len(mismatches(reference, tokens)) <= 1
    # the adapters move the outputs: the same prompt under base, a, b and c
    last = [tuple(tokens[i]) for i in range(len(rows) - 4, len(rows))]
    assert len(set(last)) >= 3 and last[0] not in last[2:]
    use = engine.stats.adapters
    assert {name: use[name]["rows"] for name in "abc"} == {"a": 17, "b": 17, "c": 17}
    assert all(use[name]["generated_tokens"] == 17 * MAX_TOKENS for name in "abc")
    assert use["a"]["prompt_tokens"] == sum(len(p) for p, a in rows if a == "a")
    assert engine.stats.cached_tokens > 0  # rows of one adapter shared their prefix


def test_prefix_cache_is_never_shared_across_adapters(tiny_model_dir, adapters):
    """The same 40-token prompt under adapter a, then b, the base model and a again: only a's second run
    is served from the cache (its two full blocks), and every run gives its own adapter's tokens."""
    prompt = list(range(100, 140))
    order = ["a", "b", None, "a"]
    rows = [(prompt, a) for a in order]
    reference = reference_runs(tiny_model_dir, adapters, rows, MAX_TOKENS)
    config = EngineConfig(kv_cache_memory="64MiB", block_size=16)
    engine = Engine(load_model(tiny_model_dir), config, lora=LoraConfig({k: str(v) for k, v in adapters.items()}))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    results = [next(iter(engine.generate([Request(i, prompt, sampling, adapter=a)]))) for i, a in enumerate(order)]
    assert [r.cached_tokens for r in results] == [0, 0, 0, 32]
    assert_only_near_ties(reference, {i: r.token_ids for i, r in enumerate(results)}, epsilon=1e-3)


def test_fewer_slots_than_adapters_evicts_and_reloads(tiny_model_dir, adapters, rows_and_reference):
    """max_loaded=1: each adapter change waits for the slot to free and reloads it; tokens unchanged."""
    rows, reference = rows_and_reference
    results, engine = run(load_model(tiny_model_dir), adapters, rows[:24], 16, max_loaded=1)
    assert_only_near_ties({i: reference[i] for i in range(24)}, {i: r.token_ids for i, r in results.items()})
    assert engine.adapters.evictions >= 2 and engine.adapters.loads == engine.adapters.evictions + 1


def test_configured_adapters_are_resident_before_the_first_row(tiny_model_dir, adapters):
    """The job's own adapters (model.lora.adapters) load as the engine is made, as many as there are slots:
    rows naming them load nothing more; another adapter's rows load it in the least recently used slot."""
    names = list(adapters)
    lora = LoraConfig({name: str(adapters[name]) for name in names}, max_loaded=2)
    engine = Engine(load_model(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB"), lora=lora)
    assert (engine.adapters.loads, engine.adapters.evictions) == (2, 0)
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    list(engine.generate([Request(i, [5, 6, 7], sampling, adapter=name) for i, name in enumerate(names[:2])]))
    assert (engine.adapters.loads, engine.adapters.evictions) == (2, 0)
    (result,) = engine.generate([Request("third", [5, 6, 7], sampling, adapter=names[2])])
    assert result.finish_reason == "length" and (engine.adapters.loads, engine.adapters.evictions) == (3, 1)


def test_bad_adapters_are_error_results(tiny_model_dir, adapters, tmp_path):
    """A row naming an unknown adapter, or one the model cannot take, gets an error result; the others run."""
    vocab = make_adapter(tiny_model_dir, tmp_path / "vocab", 4, ["q_proj"], modules_to_save=["lm_head"])
    engine = Engine(load_model(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB"),
                    lora=LoraConfig({"a": str(adapters["a"])}))
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    requests = [Request("unknown", [5, 6, 7], sampling, adapter="nope"), Request("vocab", [5, 6, 7], sampling, adapter=str(vocab)),
                Request("ok", [5, 6, 7], sampling, adapter="a"), Request("path", [5, 6, 7], sampling, adapter=str(adapters["b"]))]
    results = {r.id: r for r in engine.generate(requests)}
    assert results["unknown"].finish_reason == "error"
    assert "unknown adapter 'nope'" in results["unknown"].error
    assert results["vocab"].finish_reason == "error" and "changes the vocabulary" in results["vocab"].error
    assert results["ok"].finish_reason == "length" and results["path"].finish_reason == "length"
    plain = Engine(load_model(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB"))
    (result,) = plain.generate([Request("x", [5, 6, 7], sampling, adapter="a")])
    assert result.finish_reason == "error" and "runs no LoRA adapters" in result.error


@pytest.mark.parametrize("quant", ["int8", "w8a8"])
def test_quantized_base_runs_the_deltas(tiny_model_dir, adapters, rows_and_reference, quant):
    """The base GEMMs quantized (W8A8: the native decoder layers where they build, adapter steps with
    them): each row's first token is still its merged float reference's for nearly every row. Without the deltas, the adapters' rows (three in four) would mostly follow the base model."""
    rows, reference = rows_and_reference
    loaded = load_model(tiny_model_dir, quant=quant)
    results, _ = run(loaded, adapters, rows[:32], 32)
    agree = sum(results[i].token_ids[0] == reference[i].tokens[0] for i in range(32))
    assert agree >= 29, agree


def test_gpu_runner_applies_the_deltas_outside_graphs(tiny_model_dir, adapters, rows_and_reference):
    """The CUDA runner (its Triton kernels on the interpreter, graphs emulated): steps with adapter rows run
    eagerly with the deltas, the base-only ones may replay a graph; tokens as the merged reference's."""
    from tests.engine.test_gpu_runner import emulated_graphs

    rows, reference = rows_and_reference
    picked = [0, 4, 8, 1, 2, 3]  # base rows first (a base-only step replays), then a, b, c
    config = EngineConfig(kv_cache_memory="16MiB", block_size=16, max_batch_size=8)
    engine = Engine(load_model(tiny_model_dir), config, make_runner=emulated_graphs({}, 8),
                    lora=LoraConfig({k: str(v) for k, v in adapters.items()}))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {r.id: r.token_ids for r in engine.generate(
        Request(i, rows[i][0], sampling, adapter=rows[i][1]) for i in picked)}
    assert_only_near_ties({i: reference[i] for i in picked}, results, epsilon=1e-3)


def test_preempted_rows_give_back_and_retake_their_adapter(tiny_model_dir, adapters, rows_and_reference):
    """A KV pool of 6 blocks: rows are preempted and recomputed, releasing and retaking their adapter's
    slot (two slots for three adapters); tokens unchanged, the pool and the slots free at the end."""
    rows, reference = rows_and_reference
    results, engine = run(load_model(tiny_model_dir), adapters, rows[:16], 16, max_loaded=2,
                          kv_cache_memory=6 * 16 * 1024)
    assert engine.stats.preemptions > 0
    assert_only_near_ties({i: reference[i] for i in range(16)}, {i: r.token_ids for i, r in results.items()})
    assert engine.adapters._holders == [0, 0]


def test_compiled_layers_run_adapter_steps_as_eager_ones_do(tiny_model_dir, adapters, rows_and_reference):
    """engine.compile=on (W8A8 layers in compiled graphs): adapter steps run the compiled graphs too, with
    the deltas as an operator they call, and give the eager run's tokens (up to float near-ties)."""
    from tests.reference import Decoded

    rows, _ = rows_and_reference
    eager, _ = run(load_model(tiny_model_dir, quant="w8a8"), adapters, rows[:24], 24, compile="off")
    loaded = load_model(tiny_model_dir, quant="w8a8")
    compiled, engine = run(loaded, adapters, rows[:24], 24, compile="on")
    assert loaded.model.compiled and engine.stats.adapters["b"]["generated_tokens"] > 0
    reference = {i: Decoded(r.token_ids, [float("inf")] * MAX_TOKENS) for i, r in eager.items()}
    assert len(mismatches(reference, {i: r.token_ids for i, r in compiled.items()})) <= 2
