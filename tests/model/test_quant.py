"""Quantized linears: GGUF blocks (bit-exact), tensor-parallel shards, the module swap and the loader hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pipeline.model.collectives import TPGroup
from pipeline.model.layers import ParallelLinear
from pipeline.model.loader import load_model
from pipeline.model.quant import (
    QuantizedTensor,
    QuantLinear,
    from_gguf_blocks,
    quantize_model,
    quantize_tensor,
)
from tests.reference import prompt_logits


def _weights(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_gguf_blocks_dequantize_bit_exact(qtype):
    w = (_weights(48, 160, seed=int(qtype)) * 0.02).numpy()
    blocks = gguf_quantize(w, qtype)
    qt = from_gguf_blocks(blocks, qtype, w.shape)
    expected = torch.from_numpy(gguf_dequantize(blocks, qtype).reshape(w.shape))
    assert qt.group_size == 32 and qt.bits == (8 if qtype == T.Q8_0 else 4)
    assert torch.equal(qt.dequantize(), expected)


def test_gguf_unsupported_type_is_named():
    blocks = np.zeros((4, 210), np.uint8)  # one Q6_K super-block per row of 256
    with pytest.raises(ValueError, match="blk.0.ffn_up: GGUF type Q6_K"):
        from_gguf_blocks(blocks, T.Q6_K, (4, 256), "blk.0.ffn_up")


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int4", 64), ("int8", 32)])
def test_narrow_equals_slice_of_dequantized(scheme, group):
    w = _weights(32, 256, seed=1)
    qt = quantize_tensor(w, scheme, group)
    full = qt.dequantize()
    assert torch.equal(qt.narrow(0, 8, 16).dequantize(), full[8:24])
    assert torch.equal(qt.narrow(1, 128, 128).dequantize(), full[:, 128:])


def test_narrow_off_group_boundary_is_an_error():
    qt = quantize_tensor(_weights(8, 256), "int4", 64)
    with pytest.raises(ValueError, match="group boundaries"):
        qt.narrow(1, 32, 96)


def test_row_parallel_group_must_divide_shard():
    lin = ParallelLinear(192, [64], shard_dim=1, tp=TPGroup(0, 3))  # 64 inputs per rank
    with pytest.raises(ValueError, match="not a multiple of the quantization group size 128"):
        QuantLinear(lin, "int4", 128)
    assert QuantLinear(lin, "int4", 64).in_features == 64


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_tensor_parallel_shards_reassemble(scheme):
    """Column shards are rows of the TP=1 quantized weight; row-parallel partial products sum to the
    full product (the all-reduce)."""
    gen = torch.Generator().manual_seed(3)
    q, kv, h = 64, 32, 128
    parts = [torch.randn(n, h, generator=gen) for n in (q, kv, kv)]

    def build(tp, shard_dim, in_f, sizes, tensors):
        m = QuantLinear(ParallelLinear(in_f, sizes, shard_dim, tp=tp), scheme, 32)
        for i, t in enumerate(tensors):
            m.load(t, i)
        return m

    single = build(TPGroup(), 0, h, [q, kv, kv], parts).dequantize()
    for rank in range(2):
        local = build(TPGroup(rank, 2), 0, h, [q, kv, kv], parts).dequantize()
        expected = torch.cat(
            [p.narrow(0, rank * (p.shape[0] // 2), p.shape[0] // 2) for p in single.split([q, kv, kv])]
        )
        assert torch.equal(local, expected)
    down = torch.randn(h, 256, generator=gen)
    x2 = torch.randn(5, 256, generator=gen)
    full = build(TPGroup(), 1, 256, [h], [down]).linear(x2, None)
    partial = sum(
        build(TPGroup(r, 2), 1, 256, [h], [down]).linear(x2[:, r * 128 : (r + 1) * 128], None)
        for r in range(2)
    )
    # Row-parallel ranks hold exactly the TP=1 weights' column slices: only the summation order differs.
    assert (partial - full).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def tiny_float(tiny_model_dir):
    return load_model(tiny_model_dir)


IDS = [1, 504, 3459, 314, 260, 1789, 28, 1017, 7, 42, 9000, 17]


@pytest.mark.parametrize("scheme,group,rel", [("int8", 32, 0.02), ("int4", 32, 0.12), ("int4", 128, 0.15)])
def test_quantized_tiny_model_close_to_float(tiny_model_dir, tiny_float, scheme, group, rel):
    ref = prompt_logits(tiny_float.model, IDS)
    q = load_model(tiny_model_dir, quant=scheme, quant_group_size=group)
    lin = q.model.layers[0].mlp.down_proj
    assert isinstance(lin, QuantLinear) and lin.bits == (8 if scheme == "int8" else 4)
    out = prompt_logits(q.model, IDS)
    err = (out - ref).norm() / ref.norm()
    assert err < rel
    assert q.weight_bytes < tiny_float.weight_bytes


def test_swap_after_loading_equals_quantized_loading(tiny_model_dir, tiny_float):
    loaded = load_model(tiny_model_dir, quant="int4", quant_group_size=64)
    swapped = load_model(tiny_model_dir)
    quantize_model(swapped.model, "int4", 64, weights_loaded=True)
    for a, b in zip(loaded.model.modules(), swapped.model.modules()):
        if isinstance(a, QuantLinear):
            assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    assert torch.equal(prompt_logits(loaded.model, IDS), prompt_logits(swapped.model, IDS))


@pytest.mark.parametrize("scheme,rel", [("int4", 0.12), ("int8", 0.02)])
def test_bfloat16_model_uses_cpu_kernels(tiny_model_dir, tiny_float, scheme, rel):
    q = load_model(tiny_model_dir, dtype=torch.bfloat16, quant=scheme, quant_group_size=32)
    lin = q.model.layers[1].self_attn.qkv_proj
    assert lin.cpu_packed is not None and lin.qweight is None
    with pytest.raises(RuntimeError, match="original layout"):
        lin.dequantize()
    ref = prompt_logits(tiny_float.model, IDS)
    err = (prompt_logits(q.model, IDS) - ref).norm() / ref.norm()
    assert err < rel


def test_bad_quant_options(tiny_model_dir):
    with pytest.raises(ValueError, match="quant='int3'"):
        load_model(tiny_model_dir, quant="int3")
    with pytest.raises(ValueError, match="quant_group_size=48"):
        load_model(tiny_model_dir, quant="int4", quant_group_size=48)
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        load_model(tiny_model_dir, quant="gguf")
    with pytest.raises(ValueError, match="o_proj: 64 input features per rank"):
        load_model(tiny_model_dir, quant="int4", quant_group_size=128, tp=TPGroup(0, 2))


def test_quantized_blocks_only_for_gguf():
    lin = QuantLinear(ParallelLinear(64, [16], 0), "int4", 32)
    with pytest.raises(TypeError, match="quantizes float weights itself"):
        lin.load(QuantizedTensor(8, torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 1), None))
