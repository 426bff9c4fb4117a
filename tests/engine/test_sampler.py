"""Sampler filters and draws against a plain per-row reference written independently here."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.engine.request import SamplingParams
from pipeline.engine.sampler import adjust, filter_probs, sample
from pipeline.engine.sequence import Sequence


def reference_kept(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """Token -> unnormalized kept probability, with plain Python lists (order: T, top-k, top-p, min-p)."""
    m = max(x / temperature for x in logits)
    exps = [math.exp(x / temperature - m) for x in logits]
    total = sum(exps)
    ranked = sorted(range(len(logits)), key=lambda i: (-exps[i], i))
    if top_k:
        ranked = ranked[:top_k]
    mass = sum(exps[i] for i in ranked)
    kept, acc = [], 0.0
    for i in ranked:
        if kept and top_p < 1 and acc / mass >= top_p:  # top_p 1 is off
            break
        kept.append(i)
        acc += exps[i]
    best = exps[kept[0]]
    return {i: exps[i] / total for i in kept if exps[i] >= min_p * best}


CASES = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.6, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
    dict(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("vocab,scale", [
    (50, 3.0),  # smaller than the sorted head: every row sorted whole
    (3000, 6.0),  # peaked: the filters close inside the head
    (3000, 0.5),  # flat: nuclei reach past the head, those rows are sorted whole
])
def test_filters_match_reference(case, vocab, scale):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=g) * scale
    kept = filter_probs(
        logits,
        torch.full((4,), case["temperature"]),
        torch.full((4,), case["top_k"]),
        torch.full((4,), case["top_p"]),
        torch.full((4,), case["min_p"]),
    )
    for row in range(4):
        expect = reference_kept(logits[row].tolist(), **case)
        got = {int(t): float(kept[row, t]) for t in kept[row].nonzero().squeeze(1)}
        assert got.keys() == expect.keys()
        for token, p in expect.items():
            assert got[token] == pytest.approx(p, rel=1e-5)


def test_filters_mix_rows_closed_in_the_head_and_rows_sorted_whole():
    """One batch: a peaked row, a flat one, top-k past the head, and min-p closing a flat row early."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 3000, generator=g) * torch.tensor([[6.0], [0.5], [0.5], [0.5]])
    params = [dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0), dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
              dict(temperature=1.0, top_k=400, top_p=0.5, min_p=0.0), dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5)]
    kept = filter_probs(logits, *(torch.tensor([p[key] for p in params]) for key in
                                  ("temperature", "top_k", "top_p", "min_p")))
    for row, case in enumerate(params):
        expect = reference_kept(logits[row].tolist(), **case)
        assert set(kept[row].nonzero().squeeze(1).tolist()) == expect.keys()
    assert (kept[1] > 0).sum() > 256 and (kept[2] > 0).sum() > 100  # past the sorted head, found all the same


def _seq(sampling: SamplingParams, seed: int, prompt: list[int] | None = None,
         output: list[int] | None = None) -> Sequence:
    gen = torch.Generator().manual_seed(seed)
    prompt = prompt or [1]
    return Sequence(0, "r", 0, prompt + (output or []), len(prompt), sampling, seed, gen)


def reference_adjusted(logits: list[float], prompt: list[int], output: list[int], sp: SamplingParams,
                       eos: set[int]) -> list[float]:
    """vLLM's order written out per token: logit_bias, min_tokens mask, repetition (prompt + output),
    then frequency and presence (output only)."""
    out = list(logits)
    for token, bias in sp.logit_bias.items():
        out[token] += bias
    if len(output) < sp.min_tokens:
        for token in set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos):
            out[token] = -math.inf
    for token in set(prompt) | set(output):
        out[token] = out[token] / sp.repetition_penalty if out[token] > 0 else out[token] * sp.repetition_penalty
    for token in set(output):
        out[token] -= sp.frequency_penalty * output.count(token) + sp.presence_penalty
    return out


ADJUST_CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, presence_penalty=0.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.3),
    SamplingParams(logit_bias={3: -100.0, 11: 5.0, 29: 0.5}),
    SamplingParams(min_tokens=10, stop_token_ids=(4,), repetition_penalty=1.1, logit_bias={0: 2.0}),
    SamplingParams(min_tokens=10, ignore_eos=True, frequency_penalty=2.0),
    SamplingParams(),
]


def test_penalties_bias_and_min_tokens_match_reference():
    """All cases in one batch (rows differ in parameters, prompt and output): each row equals the
    per-token reference on the same fixed logits."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(ADJUST_CASES), 30, generator=g) * 3
    seqs, refs = [], []
    for i, sp in enumerate(ADJUST_CASES):
        prompt = torch.randint(30, (6,), generator=g).tolist()
        output = torch.randint(30, (i + 3,), generator=g).tolist()
        seqs.append(_seq(sp, i, prompt, output))
        refs.append(reference_adjusted(logits[i].tolist(), prompt, output, sp, {0, 1}))
    got = adjust(logits.clone(), seqs, frozenset({0, 1}))
    torch.testing.assert_close(got, torch.tensor(refs), rtol=0, atol=1e-5)


def test_greedy_takes_argmax_of_adjusted_logits_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    sp = SamplingParams(repetition_penalty=2.0, logprobs=1)
    out = sample(logits.clone(), [_seq(sp, 0, prompt=[0], output=[])])
    assert out.token_ids == [1]  # 5 / 2 = 2.5 < 4
    assert out.logprobs[0][1] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))
    assert sample(logits.clone(), [_seq(SamplingParams(min_tokens=1), 0)], frozenset({0})).token_ids == [1]


@pytest.mark.parametrize("case", CASES)
def test_draw_is_exponential_race_over_kept_distribution(case):
    """Each draw equals the reference: Exp(1) per token id from the same seeded generator, largest p / E wins."""
    g = torch.Generator().manual_seed(2)
    for trial in range(20):
        logits = torch.randn(1, 40, generator=g) * 2
        sp = SamplingParams(**case)
        token = sample(logits, [_seq(sp, trial)]).token_ids[0]
        u = torch.rand(40, generator=torch.Generator().manual_seed(trial)).double()
        kept = reference_kept(logits[0].tolist(), **case)
        expect = max(kept, key=lambda i: kept[i] / -math.log1p(-float(u[i])))
        assert token == expect


def test_draws_survive_last_bit_differences_in_logits():
    """Logits of one row differ in their last bits between batch shapes; a near-flat distribution over a
    large vocabulary must still draw the same tokens (an inverse CDF over the sorted vocabulary did not)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(200, 49152, generator=g) * 0.5
    noisy = logits + 1e-6 * torch.randn(logits.shape, generator=g)
    sp = SamplingParams(temperature=0.8)
    a = sample(logits, [_seq(sp, s) for s in range(200)]).token_ids
    b = sample(noisy, [_seq(sp, s) for s in range(200)]).token_ids
    assert sum(x != y for x, y in zip(a, b)) <= 1


def test_sampled_frequencies_follow_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    seqs = [_seq(sp, s) for s in range(4000)]
    tokens = sample(logits.expand(4000, -1).contiguous(), seqs).token_ids
    kept = reference_kept(logits[0].tolist(), 1.0, 0, 0.9, 0.0)
    total = sum(kept.values())
    for token in range(6):
        freq = tokens.count(token) / 4000
        assert freq == pytest.approx(kept.get(token, 0.0) / total, abs=0.03)


def test_greedy_rows_take_argmax_and_seeded_rows_ignore_neighbours():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 30, generator=g)
    greedy = SamplingParams()
    hot = SamplingParams(temperature=1.0, seed=7)
    mixed = [_seq(greedy, 0), _seq(hot, 7), _seq(greedy, 0), _seq(hot, 8), _seq(greedy, 0), _seq(hot, 9)]
    out = sample(logits, mixed).token_ids
    assert [out[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()
    for i, seed in ((1, 7), (3, 8), (5, 9)):
        alone = sample(logits[i : i + 1], [_seq(hot, seed)]).token_ids[0]
        assert out[i] == alone


def test_logprobs_are_model_log_softmax_top_k_plus_chosen():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 25, generator=g)
    sp = SamplingParams(temperature=2.0, logprobs=3)
    out = sample(logits, [_seq(sp, 1), _seq(sp, 2)])
    for row in range(2):
        ref = torch.log_softmax(logits[row].double(), -1)
        top = ref.topk(3).indices.tolist()
        entry = out.logprobs[row]
        assert set(top) | {out.token_ids[row]} == set(entry)
        for token, value in entry.items():
            assert value == pytest.approx(float(ref[token]), abs=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_sample_like_cpu():
    """The engine's logits live on its device; the per-row parameters and draws must follow them there."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02, logprobs=2), SamplingParams()]
    seqs = [_seq(params[i % 2], i) for i in range(4)]
    cpu = sample(logits, seqs)
    seqs = [_seq(params[i % 2], i) for i in range(4)]
    cuda = sample(logits.cuda(), seqs)
    assert cuda.token_ids == cpu.token_ids
