"""Speculative decoding: greedy outputs equal plain decoding's, sampled outputs keep the sampler's
distribution (chi-square), and the KV pools are whole again after any pattern of rejections."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engine import sampler
from pipeline.engine.config import EngineConfig, SpeculativeConfig
from pipeline.engine.engine import Engine
from pipeline.engine.kv_cache import KVCacheManager
from pipeline.engine.request import Request, SamplingParams
from pipeline.engine.sampler import verify
from pipeline.engine.sequence import Sequence
from pipeline.engine.speculative import NgramProposer
from pipeline.model.loader import load_model
from tests.engine.conftest import CharTokenizer, TinyLoaded, build_tiny, random_prompts
from tests.reference import greedy, prompt_logits

NEAR_TIE = 1e-4  # a greedy difference is allowed only where the reference's top-2 logits are closer than this


def perturbed(loaded: TinyLoaded, scale: float, seed: int = 1) -> torch.nn.Module:
    """A copy of the model with noise on its weights: a draft that agrees often, not always."""
    draft = build_tiny().model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return draft


def generate(loaded, requests, spec: SpeculativeConfig | None = None, draft=None, **config) -> tuple[dict, Engine]:
    engine = Engine(loaded, EngineConfig(**{"kv_cache_memory": "8MiB", **config}), speculative=spec,
                    draft_model=draft)
    results = {r.id: r for r in engine.generate(requests)}
    assert engine.kv.is_idle_whole()
    if hasattr(engine.proposer, "kv"):
        assert engine.proposer.kv.is_idle_whole() and not engine.proposer.shadows
    return results, engine


def assert_same_or_near_tie(reference: dict, got: dict) -> None:
    """Identical tokens, text and finish reasons; where tokens differ, the reference's top-2 logit gap at
    the first difference (its logprobs carry the top 2) must be below NEAR_TIE."""
    for rid, ref in reference.items():
        other = got[rid]
        if other.token_ids == ref.token_ids:
            assert (other.text, other.finish_reason) == (ref.text, ref.finish_reason), rid
            continue
        step = next(s for s, (a, b) in enumerate(zip(ref.token_ids, other.token_ids)) if a != b)
        top = sorted(ref.logprobs[step].values(), reverse=True)
        print(f"request {rid}: differs at step {step}, reference top-2 logit gap {top[0] - top[1]:.2e}")
        assert top[0] - top[1] < NEAR_TIE, (rid, step, top)


def varied_requests(tiny, count: int = 12) -> list[Request]:
    """Random prompts, prompts that repeat themselves (n-gram hits), stop strings, stop tokens, lengths."""
    prompts = random_prompts(count, 3, 40, seed=21)
    prompts = [p + p if i % 2 else p for i, p in enumerate(prompts)]
    requests = []
    for i, p in enumerate(prompts):
        ref = greedy(tiny.model, p, 24)
        if i % 4 == 1:
            sp = SamplingParams(max_tokens=24, stop=(CharTokenizer().decode(ref[9:11]),), logprobs=2)
        elif i % 4 == 2:
            sp = SamplingParams(max_tokens=24, stop_token_ids=(ref[7],), logprobs=2)
        else:
            sp = SamplingParams(max_tokens=3 + i * 2, ignore_eos=i % 3 == 0, logprobs=2)
        requests.append(Request(i, p, sp))
    return requests


SPECS = {
    "ngram": lambda tiny: (SpeculativeConfig(method="ngram", k=4, ngram_min=1, min_gain=0), None),
    "draft-self": lambda tiny: (SpeculativeConfig(method="draft", k=3, min_gain=0), tiny.model),
    "draft-noisy": lambda tiny: (SpeculativeConfig(method="draft", k=5, min_gain=0, adaptive_k=True),
                                 perturbed(tiny, 0.05)),
}


@pytest.mark.parametrize("method", SPECS)
def test_greedy_identical_at_batch_one(tiny, method):
    spec, draft = SPECS[method](tiny)
    requests = varied_requests(tiny)
    reference, got = {}, {}
    accepted = 0
    for request in requests:
        reference.update(generate(tiny, [request])[0])
        results, engine = generate(tiny, [request], spec, draft)
        got.update(results)
        accepted += engine.stats.spec_accepted
    assert_same_or_near_tie(reference, got)
    assert any(r.finish_reason == "stop" for r in got.values())
    assert accepted > 0  # guesses were accepted, not only rejected


@pytest.mark.parametrize("method", SPECS)
def test_greedy_identical_in_a_mixed_batch(tiny, method):
    """Speculating decodes share steps with prefill chunks (small token budget) and plain decodes (the
    batch grows past max_batch while requests arrive)."""
    spec, draft = SPECS[method](tiny)
    spec = SpeculativeConfig(**{**vars(spec), "max_batch": 6})
    requests = varied_requests(tiny, 16)
    reference, _ = generate(tiny, requests, max_batched_tokens=40, max_batch_size=8)
    got, engine = generate(tiny, requests, spec, draft, max_batched_tokens=40, max_batch_size=8)
    assert_same_or_near_tie(reference, got)
    assert 0 < engine.stats.spec_step_share < 1  # some steps speculated, some did not (batch above 6)
    assert engine.stats.spec_proposed > 0


def test_logprobs_of_accepted_tokens_equal_plain_decoding(tiny):
    requests = [Request(i, p + p, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3))
                for i, p in enumerate(random_prompts(4, 5, 20, seed=22))]
    reference, _ = generate(tiny, requests)
    got, engine = generate(tiny, requests, SpeculativeConfig(method="draft", min_gain=0), tiny.model)
    assert engine.stats.spec_accepted > 0
    for rid, ref in reference.items():
        assert got[rid].token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, got[rid].logprobs):
            assert a.keys() == b.keys()
            assert all(math.isclose(a[t], b[t], abs_tol=1e-4) for t in a)


def test_regime_threshold_turns_speculation_off_for_a_full_batch(tiny):
    requests = [Request(i, p, SamplingParams(max_tokens=6)) for i, p in enumerate(random_prompts(8, 3, 10))]
    _, engine = generate(tiny, requests, SpeculativeConfig(method="draft", max_batch=7), tiny.model)
    assert engine.stats.spec_steps == 0  # all 8 ran together the whole time


def test_closed_gate_speculates_only_to_learn_and_probe(tiny):
    """A gain no speculation can reach: guesses are checked until the gate has learnt the acceptance
    rate (MIN_GUESSES), then only by one sequence every PROBE_EVERY steps; tokens are unchanged."""
    from pipeline.engine.spec_gate import MIN_GUESSES, PROBE_EVERY

    k, batch = 4, 8
    requests = [Request(i, p, SamplingParams(max_tokens=60, ignore_eos=True))
                for i, p in enumerate(random_prompts(batch, 3, 10, seed=30))]
    reference, _ = generate(tiny, requests)
    got, engine = generate(tiny, requests, SpeculativeConfig(method="draft", k=k, min_gain=1e6), tiny.model)
    assert all(got[i].token_ids == reference[i].token_ids for i in reference)
    stats = engine.stats
    learning = MIN_GUESSES + k * batch  # the step that reaches MIN_GUESSES may check a whole batch
    assert MIN_GUESSES <= stats.spec_proposed <= learning + k * (stats.steps // PROBE_EVERY + 1)
    assert stats.spec_steps < stats.steps // 2


def test_ngram_lookup_prefers_longest_then_latest_match():
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 9, 6, 7]
    assert proposer.lookup(tokens, 3) == [2, 9, 6]  # "9 6 7" never seen before; "6 7" last seen at 5..6
    assert proposer.lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # suffix "1 2" seen at 0..1
    assert proposer.lookup([1, 2, 3, 4], 2) == []
    assert NgramProposer(2, 3).lookup([4, 1, 2, 3, 1], 2) == []  # only a 1-gram match, below ngram_min
    assert proposer.lookup([7, 7, 7], 4) == [7]  # the match may overlap the suffix


# -- sampling: the distribution is the plain sampler's ----------------------------------------------------

def chi_square_p_value(observed: dict, expected: dict, n: int) -> float:
    """Pearson chi-square over outcomes, pooling those with expected count < 5; upper-tail p-value by the
    Wilson-Hilferty normal approximation (no scipy)."""
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for outcome, prob in expected.items():
        e, o = n * prob, observed.get(outcome, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    assert not set(observed) - set(expected), "drew an outcome of probability zero"
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    df = bins - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def speculative_draws(logits: torch.Tensor, draft: list[int], sp: SamplingParams, n: int) -> dict:
    """Counts of what n independent verifications of `draft` against `logits` [len(draft) + 1, V] emit
    (its first two tokens)."""
    seqs = [Sequence(i, i, 0, [1], 1, sp, i, torch.Generator().manual_seed(1000 + i), draft=list(draft))
            for i in range(n)]
    out: dict[tuple, int] = {}
    for s in verify(logits.repeat(n, 1), seqs):
        key = tuple(s.token_ids[:2])
        out[key] = out.get(key, 0) + 1
    return out


def plain_distribution(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The plain sampler's distribution, written out independently: softmax(logits / T) over the top k."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    keep = p.topk(top_k).indices
    out = torch.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


@pytest.fixture(scope="module")
def two_rows(tiny):
    """The tiny model's logits after a prompt, and after the prompt plus a guess: the guess is the
    second most likely token (so it is rejected often enough to test the residual)."""
    prompt = random_prompts(1, 12, 12, seed=23)[0]
    with torch.inference_mode():
        first = prompt_logits(tiny.model, prompt)[-1]
        guess = int(first.topk(2).indices[1])
        ids = prompt + [guess]
        second = prompt_logits(tiny.model, ids)[-1]
    return torch.stack([first, second]).float(), guess


def expected_pairs(logits: torch.Tensor, guess: int, temperature: float, top_k: int) -> dict:
    """Outcome probabilities: a first token t != guess alone (the correction), or (guess, next token)."""
    p0 = plain_distribution(logits[0], temperature, top_k)
    p1 = plain_distribution(logits[1], temperature, top_k)
    out = {(t,): float(p0[t]) for t in range(p0.numel()) if p0[t] > 0 and t != guess}
    out.update({(guess, t): float(p0[guess] * p1[t]) for t in range(p1.numel()) if p1[t] > 0})
    return out


@pytest.mark.slow
def test_speculative_sampling_keeps_the_distribution(two_rows, monkeypatch):
    """20k draws: (first token, second token when the guess was accepted) against the plain sampler's
    distribution, chi-square at significance 0.001; an acceptance rule that resamples from p without
    removing the rejected guess fails the same test."""
    logits, guess = two_rows
    sp = SamplingParams(temperature=0.8, top_k=20)
    expected = expected_pairs(logits, guess, 0.8, 20)
    n = 20_000
    assert 0.1 < sum(v for k, v in expected.items() if k[0] == guess) < 0.9  # both branches well exercised
    assert chi_square_p_value(speculative_draws(logits, [guess], sp, n), expected, n) > 1e-3

    def wrong_rule(p, d, generator):  # resample from all of p on rejection: over-weights the guess
        return d if float(torch.rand(1, generator=generator)) < float(p[d]) else sampler.draw(p, generator)

    monkeypatch.setattr(sampler, "accept_or_resample", wrong_rule)
    assert chi_square_p_value(speculative_draws(logits, [guess], sp, n), expected, n) < 1e-3


# -- KV accounting ------------------------------------------------------------------------------------

class CorruptedOracle:
    """Proposes the true greedy continuation with one token changed at a random place: every check then
    accepts exactly the guesses before the change (random accept lengths, all of them exercised)."""

    def __init__(self, continuations: dict, seed: int):
        self.continuations = continuations  # request id -> (prompt length, greedy tokens)
        self.rng = torch.Generator().manual_seed(seed)
        self.expected_accepted = 0

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks):
            plen, tokens = self.continuations[seq.request_id]
            guess = tokens[seq.num_tokens - plen : seq.num_tokens - plen + k]
            bad = int(torch.randint(len(guess) + 1, (1,), generator=self.rng)) if guess else 0
            if bad < len(guess):
                guess = guess[:bad] + [(guess[bad] + 1) % 128] + guess[bad + 1 :]
            self.expected_accepted += bad
            out.append(guess)
        return out

    def release(self, seq):
        pass


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), num_blocks=st.integers(6, 14), k=st.integers(1, 6),
       prefix_caching=st.booleans())
def test_kv_pool_whole_after_random_rejections(tiny, seed, num_blocks, k, prefix_caching):
    """Random accept lengths under a tight pool (preemptions, prefix-cache reuse): outputs equal plain
    greedy decoding and the pool is whole when idle."""
    prompts = random_prompts(6, 3, 30, seed=seed)
    prompts[1] = prompts[0][:20] + prompts[1]  # shared prefix blocks
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    config = {"kv_cache_memory": num_blocks * block_bytes, "max_model_len": 16 * min(num_blocks, 6),
              "prefix_caching": prefix_caching}
    requests = [Request(i, p[: 16 * min(num_blocks, 6) - 21], sp) for i, p in enumerate(prompts)]
    reference, _ = generate(tiny, requests, **config)
    engine = Engine(tiny, EngineConfig(**config), speculative=SpeculativeConfig(method="ngram", k=k, min_gain=0))
    oracle = CorruptedOracle({r.id: (len(r.prompt_token_ids), reference[r.id].token_ids) for r in requests}, seed)
    engine.proposer = oracle
    got = {r.id: r for r in engine.generate(requests)}
    assert engine.kv.is_idle_whole()
    assert all(got[i].token_ids == reference[i].token_ids for i in reference)
    # Every check accepts exactly the guesses before the corruption, unless the scheduler cut the guesses
    # short (token budget, or no free block for them: guesses never preempt).
    assert 0 < engine.stats.spec_accepted <= oracle.expected_accepted


def test_truncate_drops_only_tail_blocks_and_keeps_shared_ones():
    kv = KVCacheManager(8, 4)
    a = Sequence(0, "a", 0, list(range(1, 11)), 10, SamplingParams(), 0, None)
    assert kv.allocate(a, 10)
    a.num_computed = 10
    kv.commit(a)  # blocks 0, 1 full and registered
    b = Sequence(1, "b", 0, list(range(1, 11)) + [50], 11, SamplingParams(), 0, None)
    kv.admit(b, kv.match_prefix(b))
    assert kv.allocate(b, 3 + 6)  # 2 cached blocks + guesses reaching into 2 fresh ones
    b.num_computed += 9
    kv.truncate(b, 9)  # keep 9 positions: blocks 0, 1 (shared) and one of the fresh ones
    assert len(b.block_table) == 3 and b.block_table[:2] == a.block_table[:2]
    assert kv.ref_count[a.block_table[0]] == 2
    kv.release(b)
    kv.release(a)
    assert kv.is_idle_whole()


def test_accepted_guesses_counted_exactly_when_none_are_cut(tiny):
    prompts = random_prompts(4, 3, 30, seed=24)
    requests = [Request(i, p, SamplingParams(max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)]
    reference, _ = generate(tiny, requests)
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB"), speculative=SpeculativeConfig(k=5, min_gain=0))
    engine.proposer = oracle = CorruptedOracle({i: (len(p), reference[i].token_ids) for i, p in enumerate(prompts)}, 3)
    got = {r.id: r for r in engine.generate(requests)}
    assert all(got[i].token_ids == reference[i].token_ids for i in reference)
    assert engine.stats.spec_accepted == oracle.expected_accepted > 0
    assert engine.kv.is_idle_whole()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_smollm2_greedy_identical(smollm2_path, method):
    """The real model (float32), drafting for itself or by prompt lookup: alone and in a batch of five."""
    loaded = load_model(smollm2_path)
    tok = loaded.tokenizer
    texts = ["Rewrite this fixing the spelling: The comittee met on Tusday to discus the budjet for next yaer.",
             "Name three colours.", "Repeat exactly: alpha beta gamma delta alpha beta gamma delta",
             "What is 12 times 7?", "Write a haiku about the sea."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    sps = [SamplingParams(max_tokens=32, logprobs=2), SamplingParams(max_tokens=32, stop=(",",), logprobs=2),
           SamplingParams(max_tokens=32, logprobs=2), SamplingParams(max_tokens=6, logprobs=2),
           SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2)]
    requests = [Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    spec = SpeculativeConfig(method=method, min_gain=0)
    draft = loaded.model if method == "draft" else None
    reference, _ = generate(loaded, requests, kv_cache_memory="64MiB")
    got, engine = generate(loaded, requests, spec, draft, kv_cache_memory="64MiB")
    assert_same_or_near_tie(reference, got)
    alone, _ = generate(loaded, requests[:1], spec, draft, kv_cache_memory="64MiB")
    assert_same_or_near_tie({0: reference[0]}, alone)
    assert engine.stats.spec_accepted > 0


def engine_pairs(tiny, prompt: list[int], sp: SamplingParams, n: int) -> dict:
    """Counts of the first two tokens of n seeded requests run with speculation (the model drafting for
    itself; each request's second token comes out of a check of one guess)."""
    engine = Engine(tiny, EngineConfig(kv_cache_memory="32MiB", max_batch_size=64, max_batched_tokens=1024),
                    speculative=SpeculativeConfig(method="draft", k=1, min_gain=0), draft_model=tiny.model)
    requests = (Request(i, prompt, SamplingParams(**{**vars(sp), "seed": i})) for i in range(n))
    counts: dict[tuple, int] = {}
    for r in engine.generate(requests):
        key = tuple(r.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    assert engine.stats.spec_checks == n and engine.kv.is_idle_whole()
    return counts


@pytest.mark.slow
def test_engine_speculative_sampling_keeps_the_joint_distribution(tiny, monkeypatch):
    """Through the whole engine, 20k seeded requests: the joint distribution of the first two tokens
    equals p(t1) p(t2 | t1) of the plain sampler (chi-square, significance 0.001), and the wrong rule fails."""
    prompt = random_prompts(1, 9, 9, seed=25)[0]
    sp = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True)
    with torch.inference_mode():
        first = prompt_logits(tiny.model, prompt)[-1]
        p1 = plain_distribution(first, 1.0, 6)
        expected = {}
        for t1 in p1.nonzero().flatten().tolist():
            ids = prompt + [t1]
            logits = prompt_logits(tiny.model, ids)[-1]
            p2 = plain_distribution(logits, 1.0, 6)
            expected.update({(t1, t2): float(p1[t1] * p2[t2]) for t2 in p2.nonzero().flatten().tolist()})
    n = 20_000
    assert chi_square_p_value(engine_pairs(tiny, prompt, sp, n), expected, n) > 1e-3

    def wrong_rule(p, d, generator):
        return d if float(torch.rand(1, generator=generator)) < float(p[d]) else sampler.draw(p, generator)

    monkeypatch.setattr(sampler, "accept_or_resample", wrong_rule)
    assert chi_square_p_value(engine_pairs(tiny, prompt, sp, n), expected, n) < 1e-3
