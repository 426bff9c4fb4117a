"""A bfloat16 KV cache under a float32 model (model.kv_cache_dtype): half the bytes per block, logits within
bfloat16 rounding of the float32 cache's, on the native kernel and on torch's path alike. An int8 cache (a
scale per vector; native kernel only): the logits of a float32 cache holding the vectors it stands for."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_attention import dequantize_kv, machine_reason, quantize_kv
from pipeline.config import resolve_kv_dtype
from pipeline.engine.runner import PagedAttention, Runner, StepBatch, kv_bytes_per_block
from tests.engine.conftest import build_tiny, random_prompts

BLOCK = 16


def prefill_then_decode(prompts: list[list[int]], blocks_each: int) -> tuple[StepBatch, StepBatch]:
    """A prefill of every prompt, then one decode each (token 1), sequence i in blocks i*blocks_each...;
    logits of each sequence's last row."""
    def batch(rows: list[tuple[int, list[int], int]], num_decodes: int) -> StepBatch:
        ids, positions, slots, starts, lens, tables = [], [], [], [0], [], []
        for seq, tokens, first in rows:
            table = list(range(seq * blocks_each, (seq + 1) * blocks_each))
            ids += tokens
            positions += range(first, first + len(tokens))
            slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + len(tokens))]
            starts.append(starts[-1] + len(tokens))
            lens.append(first + len(tokens))
            tables.append(table)
        return StepBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
            query_start=torch.tensor(starts), context_lens=torch.tensor(lens), block_tables=torch.tensor(tables),
            num_decodes=num_decodes, logits_rows=torch.tensor(starts[1:]) - 1)

    prefill = batch([(i, p, 0) for i, p in enumerate(prompts)], 0)
    decode = batch([(i, [1], len(p)) for i, p in enumerate(prompts)], len(prompts))
    return prefill, decode


def rounding(attend):
    """`attend` storing this step's keys and values rounded to bfloat16 (in a float32 cache)."""
    return lambda layer, q, k, v: attend(layer, q, k.bfloat16().float(), v.bfloat16().float())


def int8_rounding(attend):
    """`attend` storing this step's keys and values as the int8 cache's vectors stand for them (float32)."""
    return lambda layer, q, k, v: attend(layer, q, dequantize_kv(*quantize_kv(k)), dequantize_kv(*quantize_kv(v)))


@pytest.mark.parametrize("native", ["on", "off"])
def test_bfloat16_cache_equals_float32_cache_of_rounded_keys(monkeypatch, native):
    """The reference: a float32 cache holding each step's keys and values rounded to bfloat16. All the
    arithmetic stays float32, so only rounding order separates the two; the plain float32 cache differs."""
    if native == "off":
        monkeypatch.setenv("PIPELINE_NATIVE_ATTENTION", "off")
    prompts = random_prompts(6, 20, 60, seed=4)
    steps = prefill_then_decode(prompts, blocks_each=4)
    logits, block_bytes = {}, {}
    for case in ("bfloat16", "rounded", "float32"):
        tiny = build_tiny(seed=2)
        tiny.model.kv_dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
        runner = Runner(tiny.model, 6 * 4, BLOCK, torch.device("cpu"))
        assert runner.attn.k[0].dtype == tiny.model.kv_dtype
        if native == "off":
            assert runner.attn.native is None
        if case == "rounded":
            runner.attn.attend = rounding(runner.attn.attend)
        logits[case] = [runner.execute(step) for step in steps]
        block_bytes[case] = kv_bytes_per_block(tiny.model, BLOCK)
    assert block_bytes["bfloat16"] * 2 == block_bytes["float32"]
    for bf16, rounded, exact in zip(logits["bfloat16"], logits["rounded"], logits["float32"]):
        assert bf16.dtype == torch.float32
        scale = float(exact.abs().max())
        torch.testing.assert_close(bf16, rounded, rtol=0, atol=1e-4 * scale)
        assert (bf16 - exact).abs().max() > 1e-3 * scale  # the cache really holds bfloat16


def test_int8_cache_equals_float32_cache_of_the_vectors_it_stands_for():
    prompts = random_prompts(6, 20, 60, seed=4)
    steps = prefill_then_decode(prompts, blocks_each=4)
    logits, block_bytes = {}, {}
    for case in ("int8", "rounded", "float32"):
        tiny = build_tiny(seed=2)
        tiny.model.kv_dtype = torch.int8 if case == "int8" else torch.float32
        try:
            runner = Runner(tiny.model, 6 * 4, BLOCK, torch.device("cpu"))
        except ValueError as e:  # no native kernel on this machine (no C compiler or AVX2)
            pytest.skip(str(e))
        if case == "rounded":
            runner.attn.attend = int8_rounding(runner.attn.attend)
        logits[case] = [runner.execute(step) for step in steps]
        block_bytes[case] = kv_bytes_per_block(tiny.model, BLOCK)
    dim = tiny.config.head_dim
    assert block_bytes["int8"] * 4 * dim == block_bytes["float32"] * (dim + 4)  # a float32 scale per vector
    for int8, rounded, exact in zip(logits["int8"], logits["rounded"], logits["float32"]):
        scale = float(exact.abs().max())
        torch.testing.assert_close(int8, rounded, rtol=0, atol=1e-4 * scale)
        assert (int8 - exact).abs().max() > 1e-3 * scale  # the cache really holds int8


def test_int8_cache_without_the_native_kernel_is_refused(monkeypatch):
    monkeypatch.setenv("PIPELINE_NATIVE_ATTENTION", "off")
    tiny = build_tiny(seed=2)
    tiny.model.kv_dtype = torch.int8
    with pytest.raises(ValueError, match="model.kv_cache_dtype=int8 needs the native CPU attention kernel.*"
                                         "PIPELINE_NATIVE_ATTENTION is off"):
        Runner(tiny.model, 8, BLOCK, torch.device("cpu"))


def test_auto_narrows_only_quantized_models_on_cpu(monkeypatch):
    """int8 where the native kernel builds (which int8 needs), else bfloat16; the exact job and CUDA keep
    the model dtype."""
    narrow = "int8" if machine_reason() is None else "bfloat16"
    assert resolve_kv_dtype("auto", "gguf", "float32", "cpu") == narrow
    assert resolve_kv_dtype("auto", "w8a8", "float32", "cpu") == narrow
    assert resolve_kv_dtype("auto", "gguf", "bfloat16", "cpu") == narrow
    assert resolve_kv_dtype("auto", "none", "float32", "cpu") == "float32"  # the exact job stays exact
    assert resolve_kv_dtype("auto", "int8", "float32", "cuda:0") == "float32"  # the CUDA runner's cache
    assert resolve_kv_dtype("float32", "gguf", "float32", "cpu") == "float32"
    monkeypatch.setenv("PIPELINE_NATIVE_ATTENTION", "off")
    assert resolve_kv_dtype("auto", "gguf", "float32", "cpu") == "bfloat16"


def test_int8_block_copy_takes_the_scales_along():
    """Copy-on-write of a shared block (`StepBatch.block_copies`) copies the vectors' scales with them."""
    try:
        attn = PagedAttention(2, 6, BLOCK, 2, 32, torch.int8, torch.device("cpu"), 0.25, native_group=2)
    except ValueError as e:  # no native kernel on this machine
        pytest.skip(str(e))
    for pool in (*attn.k, *attn.v):
        pool.copy_(torch.randint(-127, 128, pool.shape, dtype=torch.int8))
    for pool in (p for pools in attn.scales.values() for p in pools):
        pool.uniform_()
    before = [p.clone() for p in (*attn.k, *attn.v, *attn.scales["k_scales"], *attn.scales["v_scales"])]
    empty = torch.zeros(0, dtype=torch.long)
    attn.prepare(StepBatch(input_ids=empty, positions=empty, slot_mapping=empty, query_start=torch.zeros(1, dtype=torch.long),
                           context_lens=empty, block_tables=torch.zeros(0, 1, dtype=torch.long), num_decodes=0,
                           logits_rows=empty, block_copies=torch.tensor([[1, 4]])))
    after = (*attn.k, *attn.v, *attn.scales["k_scales"], *attn.scales["v_scales"])
    for old, new in zip(before, after):
        assert torch.equal(new[:, 4], old[:, 1])
        assert torch.equal(new[:, [0, 1, 2, 3, 5]], old[:, [0, 1, 2, 3, 5]])
