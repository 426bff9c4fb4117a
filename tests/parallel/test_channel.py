"""Step messages, torchrun environment parsing and thread defaults: no processes needed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.engine.runner import StepBatch
from pipeline.model.collectives import SINGLE
from pipeline.parallel.pool import backend_for, threads_per_rank
from pipeline.parallel.runner import pack_batch, unpack_batch
from pipeline.parallel.torchrun import TorchrunEnv
from pipeline.parallel.wire import StepChannel, pack_tensors, unpack_tensors


def roundtrip(tensors):
    return unpack_tensors(torch.frombuffer(bytearray(pack_tensors(tensors)), dtype=torch.uint8))


def test_pack_roundtrip_keeps_dtype_shape_and_values():
    tensors = [
        torch.arange(7, dtype=torch.int64),
        torch.tensor([[1, -2, 3], [4, 5, -6]], dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),
        torch.empty(0, 4, dtype=torch.int64),
        torch.randn(3, 5).t(),  # non-contiguous
        torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        torch.tensor([9, 8, 7], dtype=torch.int16),  # 6 bytes: the next tensor must still be aligned
        torch.tensor([2**40], dtype=torch.int64),
    ]
    out = roundtrip(tensors)
    assert len(out) == len(tensors)
    for a, b in zip(tensors, out):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def test_pack_of_nothing_and_bad_dtype():
    assert roundtrip([]) == []
    with pytest.raises(TypeError, match="complex64"):
        pack_tensors([torch.zeros(2, dtype=torch.complex64)])


def test_decode_step_of_64_sequences_fits_one_broadcast():
    batch, width = 64, 32  # 512-token contexts in blocks of 16
    step = StepBatch(
        input_ids=torch.zeros(batch, dtype=torch.long), positions=torch.zeros(batch, dtype=torch.long),
        slot_mapping=torch.zeros(batch, dtype=torch.long), query_start=torch.arange(batch + 1),
        context_lens=torch.full((batch,), 512), block_tables=torch.zeros(batch, width, dtype=torch.long),
        num_decodes=batch, logits_rows=torch.arange(batch),
    )
    assert len(pack_tensors(pack_batch(step))) + 16 <= StepChannel(SINGLE).capacity


def test_torchrun_env():
    assert TorchrunEnv.from_env({}) is None
    env = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert TorchrunEnv.from_env(env) == TorchrunEnv(2, 3, 2, "127.0.0.1", 29500)
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        TorchrunEnv.from_env({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(ValueError, match="RANK=3 is outside WORLD_SIZE=3"):
        TorchrunEnv.from_env(env | {"RANK": "3"})
    with pytest.raises(ValueError, match="non-integer"):
        TorchrunEnv.from_env(env | {"WORLD_SIZE": "three"})


def test_threads_and_backend():
    assert threads_per_rank(2, cores=2) == 1
    assert threads_per_rank(3, cores=2) == 1
    assert threads_per_rank(2, cores=16) == 8
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda:1") == "nccl"


def test_step_batch_survives_the_channel_format():
    batch = StepBatch(
        input_ids=torch.tensor([5, 6, 7, 8]), positions=torch.tensor([9, 0, 1, 2]),
        slot_mapping=torch.tensor([41, 48, 49, 50]), query_start=torch.tensor([0, 1, 4]),
        context_lens=torch.tensor([10, 3]), block_tables=torch.tensor([[2, 0], [3, 0]]), num_decodes=1,
        logits_rows=torch.tensor([0, 3]), block_copies=torch.tensor([[1, 4]]),
    )
    out = unpack_batch(roundtrip(pack_batch(batch)))
    assert out.num_decodes == 1 and isinstance(out.num_decodes, int)
    for f in dataclasses.fields(StepBatch):
        if f.name != "num_decodes":
            assert torch.equal(getattr(out, f.name), getattr(batch, f.name)), f.name
