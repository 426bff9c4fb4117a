"""Roofline arithmetic against public figures and real tensors.

The figures: NVIDIA's H100 SXM data sheet (989 TFLOP/s dense BF16, about 1,000; 3.35 TB/s of HBM3; 80 GB), as in
conf/hardware/h100.yaml; the parameter counts of Meta's Llama 3 model cards (70.6 B, 8.03 B); and the usual
back-of-the-envelope decode estimate, HBM bandwidth / weight bytes (3,350 GB/s / 71 GB = 47 tokens/s for a 70B
model at 8 bits).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.model.config import ModelConfig
from pipeline.model.llama import LlamaModel
from pipeline.model.roofline import (
    HardwareProfile,
    Roofline,
    aggregate_bandwidth,
    cost_per_million_tokens,
    decode_ceiling,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    max_batch,
    precision,
    prefill_seconds,
    ridge_point,
    weight_bytes,
    weight_read_bytes,
)
from pipeline.perf.probe import (
    ProbeResult,
    fill_hardware_config,
    measure_bandwidth,
    measure_int8_gemms,
    measure_matmul_peak,
)
from tests.reference import ContiguousKVCache

HARDWARE = Path(__file__).resolve().parents[2] / "conf" / "hardware"

LLAMA_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                        num_heads=64, num_kv_heads=8, head_dim=128)
LLAMA_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128)
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8)


def hardware(name: str) -> HardwareProfile:
    return HardwareProfile.from_config(yaml.safe_load((HARDWARE / f"{name}.yaml").read_text()))


H100 = hardware("h100")


# ---------------------------------------------------- published figures: H100 data sheet, Meta's model cards
def test_h100_ridge_point_is_about_295_flop_per_byte():
    assert ridge_point(H100, "bf16") == pytest.approx(295, abs=1)


def test_published_model_sizes():
    # Meta's model cards: 70.6 B and 8.03 B parameters
    assert LLAMA_70B.num_parameters() == pytest.approx(70.6e9, rel=0.002)
    assert LLAMA_8B.num_parameters() == pytest.approx(8.03e9, rel=0.002)
    assert SMOLLM2.num_parameters() == pytest.approx(134.5e6, rel=0.001)  # counted on the GGUF's tensors


def test_70b_at_8_and_4_bits():
    assert weight_bytes(LLAMA_70B, "int8") == pytest.approx(71e9, rel=0.01)
    assert weight_bytes(LLAMA_70B, "int4") == pytest.approx(35.3e9, rel=0.01)
    # The usual estimate: 3,350 GB/s / 71 GB = 47 tokens/s, 95 at 4 bits. We do not count the untied input
    # embedding (1.05 GB, only gathered a row per token), so our ceilings are 2.6 % higher.
    one8 = decode_ceiling(LLAMA_70B, H100, "int8")
    one4 = decode_ceiling(LLAMA_70B, H100, "int4")
    assert one8.tokens_per_s == pytest.approx(47, rel=0.03)
    assert one4.tokens_per_s == pytest.approx(95, rel=0.03)
    step = weight_bytes(LLAMA_70B, "int8") - 8192 * 128256 + kv_bytes_per_token(LLAMA_70B)  # + the new KV row
    assert one8.tokens_per_s == pytest.approx(3.35e12 / step, rel=1e-9)
    assert one8.bound == one4.bound == "memory"


def test_eight_way_tensor_parallel_bandwidth():
    assert aggregate_bandwidth(H100, 8) == pytest.approx(26.8e12)
    assert decode_ceiling(LLAMA_70B, H100, "int8", tp=8).tokens_per_s == pytest.approx(
        8 * decode_ceiling(LLAMA_70B, H100, "int8").tokens_per_s)


def test_batch_32_reads_the_weights_once_for_32_tokens():
    one = decode_ceiling(LLAMA_70B, H100, "int8", batch=1)
    b32 = decode_ceiling(LLAMA_70B, H100, "int8", batch=32)
    # the step's extra traffic is only the 31 extra rows of new KV: the weights are read once
    assert b32.step_bytes - one.step_bytes == 31 * kv_bytes_per_token(LLAMA_70B)
    assert b32.bandwidth_bound / one.bandwidth_bound == pytest.approx(32, rel=1e-3)
    assert b32.intensity == pytest.approx(64, rel=1e-3)  # 2 FLOP per weight per token, 1 byte per weight
    assert b32.bound == "memory"


def test_compute_bound_from_ridge_times_bytes_per_weight_over_two():
    # at context 0 a step does 2 B FLOP per weight byte-per-weight: compute-bound once 2B/b > ridge
    for name, bytes_per_weight in (("int8", 1), ("bf16", 2)):
        first = next(b for b in range(1, 2000) if decode_ceiling(LLAMA_70B, H100, name, batch=b).bound == "compute")
        assert first == pytest.approx(ridge_point(H100) * bytes_per_weight / 2, abs=1.5)


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(LLAMA_70B, "bf16") == 320 * 1024
    assert kv_bytes_per_token(LLAMA_8B, "bf16") == 128 * 1024
    assert kv_bytes_per_token(SMOLLM2, "fp32") == 46_080
    assert kv_bytes_per_token(SMOLLM2, "bf16") == 23_040
    assert kv_bytes_per_sequence(LLAMA_8B, 8192, "bf16") == 1024**3  # 1 GiB for an 8k context
    assert kv_bytes_per_token(LLAMA_70B, "bf16", tp=8) == 40 * 1024  # one KV head per device


# ------------------------------------------------------------------------------- against real tensors
def test_kv_bytes_match_what_the_model_caches():
    torch.manual_seed(0)
    model = LlamaModel(TINY)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    cache = ContiguousKVCache(TINY.num_layers, model.scale)
    tokens = 7
    model(torch.arange(tokens), torch.arange(tokens), cache)
    stored = sum(t.nbytes for t in cache.k + cache.v)
    assert stored == tokens * kv_bytes_per_token(TINY, "fp32")


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_match_the_model_parameters(tied):
    cfg = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": tied})
    model = LlamaModel(cfg)
    params = dict(model.named_parameters())  # tied: one table, shared by the embedding and the head
    assert weight_bytes(cfg, "fp32") == sum(p.nbytes for p in params.values()) == 4 * cfg.num_parameters()
    read = sum(p.nbytes for n, p in model.named_parameters(remove_duplicate=False) if n != "embed_tokens.weight")
    assert weight_read_bytes(cfg, "fp32") == read


# ------------------------------------------------------------------------------------------ precisions
def test_group_scales_are_counted():
    assert precision("q4_1").bytes_for(32) == 20  # 16 B of nibbles + fp16 scale + fp16 min (GGUF block)
    assert precision("q8_0").bytes_for(64) == 68
    assert precision("int4-g32").bits_per_weight == 5
    assert precision("int4-g128").bits_per_weight == 4.25
    assert precision("int4-g128").bytes_for(129) == 129 / 2 + 2 * 4  # a partial group pays its scale
    assert weight_bytes(SMOLLM2, "q4_1", embedding="q8_0") == pytest.approx(
        (SMOLLM2.num_parameters() - 49152 * 576 - 61 * 576) * 5 / 8 + 49152 * 576 * 8.5 / 8 + 61 * 576 * 2)


@pytest.mark.parametrize("bad", ["int3", "int4-g0", "fp64", ""])
def test_unknown_precision_is_named(bad):
    with pytest.raises(ValueError, match="unknown precision"):
        precision(bad)


# ------------------------------------------------------------------------------- budgets, time, money
def test_max_batch_is_the_largest_that_fits():
    memory = 8 * H100.memory
    n = max_batch(LLAMA_70B, "bf16", 4096, memory)
    used = lambda b: weight_bytes(LLAMA_70B, "bf16") + b * kv_bytes_per_sequence(LLAMA_70B, 4096)  # noqa: E731
    assert used(n) <= memory < used(n + 1)
    assert max_batch(LLAMA_70B, "bf16", 4096, H100.memory) == 0  # 141 GB of weights do not fit in 80 GB


def test_prefill_is_compute_bound_and_grows_with_prompt_length():
    short = prefill_seconds(LLAMA_8B, H100, "bf16", tokens=100_000, prompt_len=100)
    # 2 FLOP per parameter per token, the input-embedding gather aside; attention at 100 tokens is ~0.2 %
    assert short == pytest.approx(100_000 * 2 * (8.03e9 - 128256 * 4096) / 989e12, rel=0.01)
    # Kaplan et al.'s forward cost per token, 2 N + 2 n_layer n_ctx d_attn, with n_ctx the causal prompt length
    long = prefill_seconds(LLAMA_8B, H100, "bf16", tokens=100_000, prompt_len=8000)
    attention = 2 * 32 * 8000 * 4096
    assert long == pytest.approx(100_000 * (2 * (8.03e9 - 128256 * 4096) + attention) / 989e12, rel=0.01)
    assert prefill_seconds(LLAMA_8B, H100, "bf16", tokens=0, prompt_len=10) == 0


def test_cost_per_million_tokens():
    assert cost_per_million_tokens(1000, price_per_hour=3.6) == pytest.approx(1.0)
    assert cost_per_million_tokens(8000, price_per_hour=3.6, devices=8) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        cost_per_million_tokens(0, 1.0)


def test_roofline_work_of_a_decode_step_equals_the_ceiling_step():
    r = Roofline(LLAMA_8B, H100, precision("bf16"))
    c = r.ceiling(batch=16, context=1000)
    moved, flops = r.work(steps=1, tokens=16, kv_positions_read=16 * 1000)
    assert (moved, flops) == (c.step_bytes, c.step_flops)
    assert 16 / r.seconds(moved, flops) == pytest.approx(c.tokens_per_s)


# ----------------------------------------------------------------------------------------- hardware
@pytest.mark.parametrize("name", ["h100", "h200", "a100", "l40s"])
def test_hardware_profiles_load(name):
    hw = hardware(name)
    assert 10 < ridge_point(hw) < 500
    assert hw.memory >= 48e9


def test_h200_is_an_h100_with_more_bandwidth():
    h200 = hardware("h200")
    assert h200.peak("bf16") == H100.peak("bf16") and h200.bandwidth == 4.8e12 and h200.memory == 141e9
    assert decode_ceiling(LLAMA_70B, h200, "int8").tokens_per_s / decode_ceiling(LLAMA_70B, H100, "int8").tokens_per_s \
        == pytest.approx(4.8 / 3.35)


def test_missing_hardware_figure_is_named():
    with pytest.raises(ValueError, match="bandwidth_tbs"):
        HardwareProfile.from_config({"name": "x", "peak_tflops": {"bf16": 1}, "memory_gb": 1})
    with pytest.raises(ValueError, match=r"unknown keys \['bandwith_tbs'\]"):
        HardwareProfile.from_config({"name": "x", "bandwith_tbs": 1, "peak_tflops": {"bf16": 1}, "memory_gb": 1})
    with pytest.raises(ValueError, match="hardware 'x': could not convert string to float: 'fast'"):
        HardwareProfile.from_config({"name": "x", "bandwidth_tbs": "fast", "peak_tflops": {"bf16": 1}, "memory_gb": 1})
    with pytest.raises(ValueError, match="no peak for 'fp8'"):
        H100.__class__("x", 1.0, {"bf16": 1.0}, 1.0).peak("fp8")


def test_probe_fills_only_missing_figures():
    fake = ProbeResult(bandwidth=25e9, flops={"fp32": 2e11, "bf16": 4e11, "int8": 8e11}, memory=24e9, threads=2)
    cpu = yaml.safe_load((HARDWARE / "cpu.yaml").read_text())
    filled = fill_hardware_config({**cpu, "bandwidth_tbs": 0.03}, measure=lambda: fake)
    hw = HardwareProfile.from_config({k: v for k, v in filled.items() if k != "probe"})
    assert hw.bandwidth == pytest.approx(30e9)  # given, not measured
    assert hw.peak("bf16") == pytest.approx(4e11) and hw.peak("fp32") == pytest.approx(2e11)
    assert hw.peak("int8") == pytest.approx(8e11)
    assert hw.memory == pytest.approx(24e9)
    complete = {"name": "h", "bandwidth_tbs": 1, "memory_gb": 1, "peak_tflops": {"bf16": 1}}
    assert fill_hardware_config(complete, measure=lambda: pytest.fail("probed a complete profile")) == complete


def test_probe_measures_plausible_figures():
    bandwidth = measure_bandwidth(mib=32, reps=2)
    flops = measure_matmul_peak(torch.float32, n=256, reps=2)
    int8_gemms = measure_int8_gemms(n=256, reps=2)
    assert 1e8 < bandwidth < 1e13  # 0.1 GB/s .. 10 TB/s
    assert 1e8 < flops < 1e15 and "_int_mm" in int8_gemms and all(1e8 < v < 1e16 for v in int8_gemms.values())
    assert math.isfinite(bandwidth / flops)
