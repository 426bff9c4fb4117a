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


def stored(kv_dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """What a `kv_dtype` cache holds of float32 vectors x, as float32: bfloat16-rounded, or int8 times its
    scale."""
    return dequantize_kv(*quantize_kv(x)) if kv_dtype == torch.int8 else x.to(kv_dtype).float()


@pytest.mark.parametrize("kv_dtype,native", [(torch.bfloat16, "on"), (torch.bfloat16, "off"), (torch.int8, "on")])
def test_narrow_cache_equals_float32_cache_of_what_it_stores(monkeypatch, kv_dtype, native):
    """The reference: a float32 cache holding each step's keys and values as the narrower cache stores them.
    All the arithmetic stays float32, so only rounding order separates the two; the plain float32 cache
    differs."""
    if native == "off":
        monkeypatch.setenv("PIPELINE_NATIVE", "off")
    prompts = random_prompts(6, 20, 60, seed=4)
    steps = prefill_then_decode(prompts, blocks_each=4)
    logits, block_bytes = {}, {}
    for case in ("narrow", "stored", "float32"):
        tiny = build_tiny(seed=2)
        tiny.model.kv_dtype = kv_dtype if case == "narrow" else torch.float32
        try:
            runner = Runner(tiny.model, 6 * 4, BLOCK, torch.device("cpu"))
        except ValueError as e:  # int8 where the native kernel cannot build (no C compiler or AVX2)
            if kv_dtype != torch.int8:
                raise
            pytest.skip(str(e))
        assert runner.attn.k[0].dtype == tiny.model.kv_dtype
        if native == "off":
            assert runner.attn.native is None
        if case == "stored":
            attend = runner.attn.attend
            runner.attn.attend = lambda layer, q, k, v, attend=attend: attend(
                layer, q, stored(kv_dtype, k), stored(kv_dtype, v))
        logits[case] = [runner.execute(step) for step in steps]
        block_bytes[case] = kv_bytes_per_block(tiny.model, BLOCK)
    dim = tiny.config.head_dim
    vector_bytes = dim + 4 if kv_dtype == torch.int8 else 2 * dim  # int8: and a float32 scale
    assert block_bytes["narrow"] * 4 * dim == block_bytes["float32"] * vector_bytes
    for narrow, reference, exact in zip(logits["narrow"], logits["stored"], logits["float32"]):
        assert narrow.dtype == torch.float32
        scale = float(exact.abs().max())
        torch.testing.assert_close(narrow, reference, rtol=0, atol=1e-4 * scale)
        assert (narrow - exact).abs().max() > 1e-3 * scale  # the cache really holds the narrower dtype


def test_int8_cache_without_the_native_kernel_is_refused(monkeypatch):
    monkeypatch.setenv("PIPELINE_NATIVE", "gemm,decode")
    tiny = build_tiny(seed=2)
    tiny.model.kv_dtype = torch.int8
    with pytest.raises(ValueError, match="model.kv_cache_dtype=int8 needs the native CPU attention kernel.*"
                                         "PIPELINE_NATIVE=gemm,decode leaves out the native attention"):
        Runner(tiny.model, 8, BLOCK, torch.device("cpu"))


def test_auto_narrows_only_for_model_quant_auto_on_cpu(monkeypatch):
    """With model.quant=auto: int8 where the native kernel builds (which int8 needs), else bfloat16. The exact
    job, a weight-only or W8A8 scheme named explicitly, and CUDA keep the model dtype."""
    narrow = "int8" if machine_reason() is None else "bfloat16"
    assert resolve_kv_dtype("auto", "auto", "float32", "cpu") == narrow
    assert resolve_kv_dtype("auto", "auto", "bfloat16", "cpu") == narrow
    for named in ("none", "gguf", "int8", "int4", "w8a8"):
        assert resolve_kv_dtype("auto", named, "float32", "cpu") == "float32"
    assert resolve_kv_dtype("auto", "auto", "float32", "cuda:0") == "float32"  # the CUDA runner's cache
    assert resolve_kv_dtype("int8", "gguf", "float32", "cpu") == "int8"  # asked for
    monkeypatch.setenv("PIPELINE_NATIVE", "off")
    assert resolve_kv_dtype("auto", "auto", "float32", "cpu") == "bfloat16"


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
