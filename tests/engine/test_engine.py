"""Engine behaviour on a tiny random float32 Llama, against single-sequence references."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engine import runner
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.seeds import sample_seed
from tests.engine.conftest import EOS, CharTokenizer, TinyLoaded, random_prompts
from tests.reference import Decoded, assert_only_near_ties, gaps_of, greedy, greedy_decode, prompt_logits


def run(loaded, requests, **config) -> tuple[dict, Engine]:
    engine = Engine(loaded, EngineConfig(**{"kv_cache_memory": "8MiB", **config}))
    results = {(r.id, r.sample_index): r for r in engine.generate(requests)}
    assert engine.kv.is_idle_whole()
    return results, engine


# Float32 rounding differs between a batched paged step and a plain single-sequence pass by ~1e-6 on these
# logits; a greedy choice may flip only where the reference's top two logits are closer than this.
NEAR_TIE = 1e-3


@pytest.mark.slow
def test_batch_matches_alone_and_reference(tiny):
    prompts = random_prompts(64, 2, 90, seed=10)
    sp = SamplingParams(max_tokens=12)
    batch, engine = run(tiny, [Request(i, p, sp) for i, p in enumerate(prompts)], max_batched_tokens=300)
    assert engine.stats.mean_running_batch > 16
    reference = dict(enumerate(greedy_decode(tiny.model, prompts, 12, stop_token_ids=(EOS,))))
    alone = {i: run(tiny, [Request(i, p, sp)])[0][i, 0].token_ids for i, p in enumerate(prompts)}
    assert_only_near_ties(reference, {i: batch[i, 0].token_ids for i in range(len(prompts))}, NEAR_TIE)
    assert_only_near_ties(reference, alone, NEAR_TIE)


@pytest.mark.slow
def test_seeded_sampling_same_alone_and_in_batch(tiny):
    prompts = random_prompts(64, 2, 40, seed=11)
    sps = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=100 + i) for i in range(64)]
    batch, _ = run(tiny, [Request(i, p, sps[i]) for i, p in enumerate(prompts)])
    # A row draws from its own seeded stream, so only a draw within float rounding (~1e-6) of a token's
    # cumulative-probability boundary could flip: about 1e-3 chance over these 640 draws. Equal.
    for i, p in enumerate(prompts):
        alone, _ = run(tiny, [Request(i, p, sps[i])])
        assert batch[i, 0].token_ids == alone[i, 0].token_ids, i


def test_chunked_prefill_keeps_decodes_running(tiny):
    engine = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batched_tokens=256, max_batch_size=64))
    decoding = SamplingParams(max_tokens=100, ignore_eos=True)
    for i, p in enumerate(random_prompts(32, 4, 20, seed=12)):
        engine.add_request(Request(i, p, decoding))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    decoders = list(engine.scheduler.running)
    engine.add_request(Request("long", random_prompts(1, 2000, 2000, seed=13)[0], SamplingParams(max_tokens=2)))
    long_steps = 0
    while True:
        before = [s.num_output_tokens for s in decoders]
        engine.step()
        long = [s for s in engine.scheduler.running if s.request_id == "long"]
        assert [s.num_output_tokens for s in decoders] == [b + 1 for b in before]
        long_steps += 1
        if long and long[0].num_output_tokens > 0:
            break
    # 2000 tokens with 256 - 32 = 224 per step: the prefill is spread over 9 steps, decodes in every one.
    assert long_steps == -(-2000 // (256 - 32))


@pytest.mark.slow
def test_tight_kv_budget_preempts_and_completes(tiny):
    prompts = random_prompts(200, 4, 24, seed=14)
    sp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head dim, float32
    results, engine = run(
        tiny, [Request(i, p, sp) for i, p in enumerate(prompts)],
        kv_cache_memory=8 * block_bytes, max_model_len=40, max_batched_tokens=128,
    )
    assert engine.num_blocks == 8
    assert engine.stats.preemptions > 0
    roomy, _ = run(tiny, [Request(i, p, sp) for i, p in enumerate(prompts)])
    reference = {i: Decoded(roomy[i, 0].token_ids, gaps_of(roomy[i, 0].logprobs)) for i in range(200)}
    assert_only_near_ties(reference, {i: results[i, 0].token_ids for i in range(200)}, NEAR_TIE)
    assert all(len(results[i, 0].token_ids) == 10 for i in range(200))


def test_max_tokens_stop_tokens_and_stop_strings(tiny):
    prompt = random_prompts(1, 10, 10, seed=15)[0]
    ref = greedy(tiny.model, prompt, 30)
    res, _ = run(tiny, [Request("a", prompt, SamplingParams(max_tokens=7, ignore_eos=True))])
    assert res["a", 0].token_ids == ref[:7] and res["a", 0].finish_reason == "length"
    stop_token = ref[5]
    cut = ref.index(stop_token)
    res, _ = run(tiny, [Request("b", prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop_token,)))])
    assert res["b", 0].token_ids == ref[: cut + 1] and res["b", 0].finish_reason == "stop"
    assert res["b", 0].text == CharTokenizer().decode(ref[:cut])
    text = CharTokenizer().decode(ref)
    stop = text[8:11]
    res, _ = run(tiny, [Request("c", prompt, SamplingParams(max_tokens=30, stop=(stop, "never-there")))])
    assert res["c", 0].text == text[: text.index(stop)]
    assert res["c", 0].finish_reason == "stop"
    assert len(res["c", 0].token_ids) == text.index(stop) + len(stop)


def test_eos_and_ignore_eos(tiny):
    prompt = random_prompts(1, 12, 12, seed=16)[0]
    ref = greedy(tiny.model, prompt, 20)
    eos = ref[3]
    tokenizer = CharTokenizer()
    tokenizer.eos_token_ids = (eos,)
    loaded = TinyLoaded(tiny.model, tokenizer, tiny.config)
    res, _ = run(loaded, [Request("e", prompt, SamplingParams(max_tokens=20)),
                          Request("i", prompt, SamplingParams(max_tokens=20, ignore_eos=True))])
    assert res["e", 0].token_ids == ref[: ref.index(eos) + 1] and res["e", 0].finish_reason == "stop"
    assert res["i", 0].token_ids == ref and res["i", 0].finish_reason == "length"


def test_n_samples_share_prefill_and_match_separate_requests(tiny):
    prompt = random_prompts(1, 37, 37, seed=17)[0]  # 2 full blocks + a partial one to copy
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=4, ignore_eos=True)
    res, engine = run(tiny, [Request("n", prompt, sp)], prefix_caching=False)
    assert engine.stats.prefill_tokens == len(prompt)  # the prompt went through the model once
    assert sorted(i for _, i in res) == [0, 1, 2, 3]
    outs = [res["n", i].token_ids for i in range(4)]
    assert len({tuple(o) for o in outs}) > 1
    for i in range(4):
        single = dataclasses.replace(sp, n=1, seed=sample_seed(5, i))
        alone, _ = run(tiny, [Request("s", prompt, single)], prefix_caching=False)
        assert alone["s", 0].token_ids == outs[i]
    res, _ = run(tiny, [Request("g", prompt, SamplingParams(max_tokens=8, n=3, ignore_eos=True))])
    ref = greedy(tiny.model, prompt, 8)
    assert all(res["g", i].token_ids == ref for i in range(3))


def test_invalid_requests_become_error_results(tiny):
    requests = [
        Request("empty", []),
        Request("vocab", [1, 2, 999]),
        Request("long", [1] * 64),
        Request("params", [1, 2], {"temperature": -1}),
        Request("ok", [1, 2], SamplingParams(max_tokens=3)),
    ]
    res, engine = run(tiny, requests, max_model_len=64)
    for rid in ("empty", "vocab", "long", "params"):
        assert res[rid, 0].finish_reason == "error" and res[rid, 0].error  # the result's id names the request
    assert "max_model_len=64" in res["long", 0].error
    assert "temperature" in res["params", 0].error
    assert res["ok", 0].finish_reason in ("length", "stop")
    assert engine.stats.errors == 4


def test_on_step_runs_after_every_step_before_any_row_finishes(tiny):
    """The job's progress hangs on this hook: a line must come while the first rows are still decoding."""
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB"))
    seen: list[tuple[int, int]] = []  # (steps, results taken) at each call
    results = []
    requests = [Request(i, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(2)]
    for result in engine.generate(requests, on_step=lambda: seen.append((engine.stats.steps, len(results)))):
        results.append(result)
    assert [steps for steps, _ in seen] == list(range(1, engine.stats.steps + 1))
    assert seen[0][1] == 0 and len(results) == 2  # called before the first result
    assert seen[-1][1] == 2  # a step's results are taken before its call


@pytest.mark.parametrize("group_pass", [False, True])
def test_prefix_caching_same_outputs_and_shared_prefix_computed_once(tiny, monkeypatch, group_pass):
    """group_pass: decodes of a prefix group read their shared blocks once (runner.shared_prefixes), on
    torch's decode path (the native kernel reads each row's table in place); the floor is lowered so that
    these small groups use it. Without it, the native kernel runs where it builds."""
    groups_found = []
    if group_pass:
        monkeypatch.setenv("PIPELINE_NATIVE", "off")
        monkeypatch.setattr(runner, "MIN_SAVED_BLOCKS", 1)
        find = runner.shared_prefixes

        def recording(*args):
            found = find(*args)
            groups_found.extend(found)
            return found

        monkeypatch.setattr(runner, "shared_prefixes", recording)
    prefixes = random_prompts(4, 64, 64, seed=18)
    questions = random_prompts(32, 3, 9, seed=19)
    prompts = [prefixes[i % 4] + q for i, q in enumerate(questions)]
    order = sorted(range(32), key=lambda i: prompts[i])  # what the planner does
    sp = SamplingParams(max_tokens=6)
    reqs = [Request(i, prompts[i], sp) for i in order]
    on, engine_on = run(tiny, reqs, max_batched_tokens=512)
    off, engine_off = run(tiny, reqs, max_batched_tokens=512, prefix_caching=False)
    assert all(on[i, 0].token_ids == off[i, 0].token_ids for i in range(32))
    lower_bound = len({tuple(p[:j]) for p in prompts for j in range(1, len(p) + 1)})  # prefix-tree nodes
    assert engine_off.stats.prefill_tokens == sum(len(p) for p in prompts)
    # Each shared prefix is computed once, including its tail inside a partly shared block.
    assert engine_on.stats.prefill_tokens <= 1.05 * lower_bound
    assert engine_on.stats.cached_tokens == sum(on[i, 0].cached_tokens for i in range(32)) > 0
    assert engine_on.stats.held > 0
    assert bool(groups_found) == group_pass


def test_generate_reads_requests_lazily(tiny):
    pulled = []

    def source():
        for i, p in enumerate(random_prompts(100, 2, 6, seed=20)):
            pulled.append(i)
            yield Request(i, p, SamplingParams(max_tokens=3))

    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB", max_batch_size=4, max_waiting=8))
    stream = engine.generate(source())
    first = next(stream)
    assert first.id is not None and len(pulled) <= 4 + 8 + 1
    assert len(list(stream)) == 99


@pytest.mark.parametrize(
    "bad, key",
    [
        (dict(block_size=0), "block_size"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory"),
        (dict(max_model_len=-3), "max_model_len"),
        (dict(device="tpu"), "device"),
    ],
)
def test_config_errors_name_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        EngineConfig(**bad)


def test_kv_budget_too_small_for_max_model_len(tiny):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        Engine(tiny, EngineConfig(kv_cache_memory="64KiB", max_model_len=4096))


@pytest.mark.slow
def test_rss_flat_over_many_short_requests(tiny):
    import gc

    import psutil

    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB", max_batched_tokens=512))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)

    def batch(offset: int, count: int):
        for i, p in enumerate(random_prompts(count, 3, 12, seed=offset)):
            yield Request(offset + i, p, sp)

    assert sum(1 for _ in engine.generate(batch(0, 500))) == 500
    gc.collect()
    before = psutil.Process().memory_info().rss
    assert sum(1 for _ in engine.generate(batch(10_000, 2000))) == 2000
    gc.collect()
    after = psutil.Process().memory_info().rss
    assert after <= 1.05 * before, (before, after)
    assert engine.kv.is_idle_whole()


def test_step_on_an_idle_engine_does_nothing(tiny):
    """Stepping past the end of the work (a caller's own loop) returns no results instead of failing."""
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB"))
    assert engine.step() == []
    engine.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=2)))
    finished = [r for _ in range(6) for r in engine.step()]
    assert [r.id for r in finished] == ["a"] and len(finished[0].token_ids) == 2
    assert engine.kv.is_idle_whole() and engine.stats.steps == 2


def test_stopping_early_returns_every_block(tiny):
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB"))
    stream = engine.generate(Request(i, p, SamplingParams(max_tokens=50)) for i, p in enumerate(random_prompts(20, 5, 30)))
    next(stream)
    stream.close()
    assert engine.kv.is_idle_whole() and not engine.scheduler.has_work()


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    prefixes=st.lists(st.lists(st.integers(1, 127), min_size=1, max_size=20), min_size=1, max_size=3),
    rows=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, 127), max_size=6)), min_size=1, max_size=12),
    num_blocks=st.integers(12, 40),
)
def test_prefix_caching_never_changes_outputs_under_pressure(tiny, prefixes, rows, num_blocks):
    """Random shared-prefix workloads in a small pool (evictions, preemptions): identical greedy outputs
    with the cache on and off, and a whole pool after each run."""
    prompts = [prefixes[p % len(prefixes)] + q for p, q in rows]
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = []
    for caching in (True, False):
        res, _ = run(tiny, [Request(i, p, sp) for i, p in enumerate(prompts)], block_size=4,
                     kv_cache_memory=num_blocks * block_bytes, max_model_len=40, max_batched_tokens=24,
                     max_batch_size=6, prefix_caching=caching)
        outs.append([res[i, 0].token_ids for i in range(len(prompts))])
    assert outs[0] == outs[1]


def test_prompt_logprobs_match_a_plain_forward_pass(tiny):
    """Chunked prefill (8 tokens a step), a repeated prompt that the prefix cache would otherwise serve, and
    n=2 (both samples report the one scoring of the prompt): every entry equals log_softmax of a plain
    full-prompt forward pass, top-k plus the actual next token."""
    prompts = random_prompts(3, 12, 30, seed=4)
    prompts.append(list(prompts[0]))
    sp = SamplingParams(max_tokens=3, prompt_logprobs=2, n=2, temperature=1.0, seed=1)
    results, engine = run(tiny, [Request(i, p, sp) for i, p in enumerate(prompts)], max_batched_tokens=8,
                          block_size=4)
    model = tiny.model
    for (rid, _), r in results.items():
        prompt = prompts[rid]
        ref = torch.log_softmax(prompt_logits(model, prompt), -1)
        assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            entry = r.prompt_logprobs[p]
            assert set(entry) == set(ref[p - 1].topk(2).indices.tolist()) | {prompt[p]}
            for token, value in entry.items():
                assert value == pytest.approx(float(ref[p - 1, token]), abs=1e-4)
    assert engine.stats.cached_tokens == 0  # prompt logprobs need every position computed


def test_compiled_layers_match_eager_and_auto_keeps_float_eager():
    from tests.engine.conftest import build_tiny

    fresh = build_tiny(seed=3)  # its own model: compiling changes it for good
    prompts = random_prompts(6, 2, 40, seed=4)
    sp = SamplingParams(max_tokens=8)
    requests = [Request(i, p, sp) for i, p in enumerate(prompts)]
    reference = dict(enumerate(greedy_decode(fresh.model, prompts, 8, stop_token_ids=(EOS,))))
    _, engine = run(fresh, [], compile="auto")
    assert not fresh.model.compiled  # exact float32 stays eager unless asked
    results, _ = run(fresh, requests, compile="on", max_batched_tokens=64)
    assert fresh.model.compiled
    assert_only_near_ties(reference, {i: results[i, 0].token_ids for i in range(len(prompts))}, NEAR_TIE)
    with pytest.raises(ValueError, match="engine.compile"):
        EngineConfig(compile="yes")


def test_first_token_time_is_the_wait_from_generate_to_the_first_sample(tiny):
    """`first_token_s` is unset before generating, then lies within the generate call's span, and a later
    call does not move it (the first token of the run, compile included)."""
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB"))
    assert engine.stats.first_token_s is None
    sp = SamplingParams(max_tokens=3)
    start = time.perf_counter()
    list(engine.generate([Request(0, [5, 6, 7], sp)]))
    span = time.perf_counter() - start
    first = engine.stats.first_token_s
    assert first is not None and 0 < first <= span
    list(engine.generate([Request(1, [5, 6], sp)]))
    assert engine.stats.first_token_s == first
    assert engine.stats.compile_s == 0.0  # the float32 model runs eager: nothing compiled in its steps
