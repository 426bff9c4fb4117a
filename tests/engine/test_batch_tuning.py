"""engine.max_batch_size=auto: which sizes it tries, how it picks, and that the engine it leaves behind runs
jobs as a fixed size would."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.engine import batch_tuning
from pipeline.engine.batch_tuning import PROMPT_TOKENS, candidates, decode_rate, pick
from pipeline.engine.config import BATCH_CANDIDATES, EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from tests.engine.conftest import random_prompts


def test_pick_is_the_largest_within_the_margin():
    assert pick({16: 400.0, 32: 700.0, 64: 960.0, 128: 1000.0, 256: 960.0}) == 256  # 960 >= 95% of 1000
    assert pick({16: 400.0, 32: 700.0, 64: 990.0, 128: 1000.0, 256: 940.0}) == 128  # 940 < 95%: 64 ties, 256 lost
    assert pick({16: 400.0, 32: 700.0, 64: 1000.0, 128: 900.0}) == 64  # a larger batch that measured slower
    assert pick({16: 400.0, 32: 700.0}, within=0.5) == 32
    assert pick({64: 5.0}) == 64


def test_candidates_fit_the_kv_cache_the_token_budget_and_the_rows():
    assert candidates(10**6, 512, 100, None) == list(BATCH_CANDIDATES)
    assert candidates(64 * 100, 512, 100, None) == [16, 32, 64]  # KV holds 64 sequences of 100 positions
    assert candidates(10**6, 100, 100, None) == [16, 32, 64]  # a decode step of B tokens fits 100
    assert candidates(10**6, 512, 100, 40) == [16, 32]
    assert candidates(10, 512, 100, 1) == [16]  # nothing fits: the smallest, and the scheduler copes


def test_decode_rate_counts_generated_tokens_and_leaves_the_engine_idle(tiny):
    engine = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size=32, max_batched_tokens=256))
    rate = decode_rate(engine, 32, prompt_tokens=20, steps=3)
    assert rate > 0
    assert not engine.scheduler.has_work() and engine.kv.num_free == engine.kv.num_blocks
    # prefill took ceil(32 x 20 / 256) = 3 steps with sequences already decoding: none finished before the end
    assert engine.stats.decode_tokens >= 32 * (1 + 2 + 3)


def test_decode_rate_times_the_whole_batch_when_decodes_slow_the_prefill(tiny):
    """A token budget that decoding sequences mostly use up makes the prefill take many more steps than
    batch x prompt / budget; the sequences decoding all along must still be running in every timed step."""
    engine = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size=32, max_batched_tokens=40))
    generated: list[int] = []
    step = engine.step

    def counting_step():
        before = engine.stats.decode_tokens
        results = step()
        generated.append(engine.stats.decode_tokens - before)
        return results

    engine.step = counting_step
    decode_rate(engine, 32, prompt_tokens=20, steps=3)
    assert len(generated) > 32 * 20 // 40 + batch_tuning.WARMUP_STEPS + 3  # the prefill did take longer
    assert generated[-3:] == [32, 32, 32]


def test_decode_rate_is_the_rate_of_the_fastest_timed_step(tiny, monkeypatch):
    """A slow spell during some of the timed steps does not lower a size's rate: each step is timed on its own
    and the fastest counts (a scripted clock: every step takes a set number of seconds)."""
    engine = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size=32, max_batched_tokens=1024))
    now, seconds = [0.0], [4.0, 1.0, 3.0, 0.5, 2.0, 8.0, 1.5]
    taken: list[float] = []
    step = engine.step

    def scripted_step():
        results = step()
        taken.append(seconds[len(taken) % len(seconds)])
        now[0] += taken[-1]
        return results

    engine.step = scripted_step
    monkeypatch.setattr(batch_tuning, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    rate = decode_rate(engine, 32, prompt_tokens=20, steps=3)
    timed = taken[-3:]
    assert rate == 32 / min(timed)
    assert rate > 3 * 32 / sum(timed)  # the mean over the same steps would be lower


def test_close_sizes_are_timed_again_in_the_opposite_order_and_keep_their_faster_rate(monkeypatch):
    """One pass put 128 ahead of 256 (a slow spell while 256 ran); the second, smallest first, shows 256
    ahead by more than the margin. 64, far behind, is not timed again."""
    passes = {256: [900.0, 1100.0], 128: [1000.0, 950.0], 64: [600.0], 32: [300.0]}
    timed: list[int] = []

    def scripted_rate(engine, batch):
        timed.append(batch)
        return passes[batch][timed.count(batch) - 1]

    monkeypatch.setattr(batch_tuning, "decode_rate", scripted_rate)
    choice = batch_tuning.measure(None, [32, 64, 128, 256])
    assert timed == [256, 128, 64, 32, 128, 256]
    assert choice.rates == {32: 300.0, 64: 600.0, 128: 1000.0, 256: 1100.0}
    assert choice.batch == 256


def test_auto_measures_then_runs_a_job_like_the_fixed_size_it_picked(tiny, monkeypatch):
    monkeypatch.setattr(batch_tuning, "SHORT_RUN_TOKENS", 0)  # 40 x 12 tokens: measured all the same
    prompts = random_prompts(40, 5, 30, seed=4)
    sp = SamplingParams(max_tokens=12)
    auto = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size="auto", max_batched_tokens=512))
    assert auto.max_batch_size == max(BATCH_CANDIDATES)  # sized for the largest until measured
    choice = auto.tune_batch_size(max_tokens=12, rows=len(prompts))
    assert set(choice.rates) == {16, 32} and choice.batch in choice.rates and choice.seconds > 0
    assert choice.rates[choice.batch] >= 0.95 * max(choice.rates.values())
    assert auto.max_batch_size == auto.scheduler.max_batch_size == choice.batch
    assert auto.waiting_window == 4 * choice.batch
    assert auto.stats.steps == 0 and not auto.scheduler.has_work()  # the measuring steps are not the job's
    fixed = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size=choice.batch, max_batched_tokens=512))
    running: list[int] = []
    step = auto.step
    auto.step = lambda: (step(), running.append(len(auto.scheduler.running)))[0]
    runs = [{r.id: r.token_ids for r in e.generate(Request(i, p, sp) for i, p in enumerate(prompts))}
            for e in (auto, fixed)]
    assert runs[0] == runs[1] and len(runs[0]) == len(prompts)
    assert max(running) <= choice.batch


@pytest.mark.parametrize("rows,expected", [(40, 32), (3000, 64)])
def test_a_short_run_takes_up_to_64_without_measuring(tiny, rows, expected):
    engine = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size="auto"))
    choice = engine.tune_batch_size(max_tokens=5, rows=rows)  # 40 x 5, 3000 x 5 < SHORT_RUN_TOKENS
    assert choice.batch == engine.max_batch_size == expected and choice.rates == {}
    assert "short run" in choice.reason and engine.stats.decode_tokens == 0


def test_fixed_size_is_not_measured(tiny):
    engine = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size=8))
    assert engine.tune_batch_size(max_tokens=16) is None and engine.max_batch_size == 8


def test_tuning_a_busy_engine_is_refused(tiny):
    engine = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size="auto"))
    engine.add_request(Request(0, [1] * PROMPT_TOKENS, SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.tune_batch_size(max_tokens=4)


@pytest.mark.parametrize("value", ["big", 0, True])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="engine.max_batch_size must be an integer >= 1 or auto"):
        EngineConfig(max_batch_size=value)
