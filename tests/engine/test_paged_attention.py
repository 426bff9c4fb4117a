"""Paged decode attention against per-sequence attention over contiguous keys, with and without rows that
share their leading blocks (the prefix cache's hits, read once per group)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine import runner
from pipeline.engine.runner import PagedAttention, StepBatch, shared_prefixes
from pipeline.model.attention import causal_attention

BLOCK, HKV, HQ, DIM, NUM_BLOCKS = 4, 2, 6, 8, 64
SCALE = DIM**-0.5


@pytest.fixture
def any_saving(monkeypatch):
    """Groups here are small: let any saving justify a group pass."""
    monkeypatch.setattr(runner, "MIN_SAVED_BLOCKS", 1)


def decode_batch(tables: list[list[int]], lens: list[int], prefill: tuple[list[int], int] | None = None,
                 new: int = 3) -> StepBatch:
    """One decode row per (table, context length); optionally a prefill chunk (table, length) at the end
    whose last `new` tokens are computed this step."""
    rows = [(t, n, 1) for t, n in zip(tables, lens)] + ([(*prefill, new)] if prefill else [])
    slots, positions, starts = [], [], [0]
    for table, n, new in rows:
        for p in range(n - new, n):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        starts.append(starts[-1] + new)
    width = max(len(t) for t, _, _ in rows)
    block_tables = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (table, _, _) in enumerate(rows):
        block_tables[i, : len(table)] = torch.tensor(table)
    return StepBatch(
        input_ids=torch.zeros(len(slots), dtype=torch.long), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots), query_start=torch.tensor(starts),
        context_lens=torch.tensor([n for _, n, _ in rows]), block_tables=block_tables,
        num_decodes=len(tables), logits_rows=torch.zeros(0, dtype=torch.long))


def reference(attn: PagedAttention, batch: StepBatch, q: torch.Tensor) -> torch.Tensor:
    """Each sequence alone: its keys copied out of the pool in position order, plain causal attention."""
    out = torch.empty_like(q)
    starts = batch.query_start.tolist()
    for b, length in enumerate(batch.context_lens.tolist()):
        positions = torch.arange(length)
        slots = batch.block_tables[b, positions // BLOCK] * BLOCK + positions % BLOCK
        k = attn.k[0].view(HKV, -1, DIM)[:, slots].transpose(0, 1)
        v = attn.v[0].view(HKV, -1, DIM)[:, slots].transpose(0, 1)
        lo, hi = starts[b], starts[b + 1]
        out[lo:hi] = causal_attention(q[lo:hi], k, v, length - (hi - lo), SCALE)
    return out


def attend(tables, lens, prefill=None, dtype=torch.float32, new=3):
    torch.manual_seed(0)
    attn = PagedAttention(1, NUM_BLOCKS, BLOCK, HKV, DIM, dtype, torch.device("cpu"), SCALE)
    attn.k[0].normal_()
    attn.v[0].normal_()
    batch = decode_batch(tables, lens, prefill, new)
    q = torch.randn(batch.num_tokens, HQ, DIM, dtype=dtype)
    k, v = (torch.randn(batch.num_tokens, HKV, DIM, dtype=dtype) for _ in range(2))
    attn.prepare(batch)
    out = attn.attend(0, q, k, v)
    return attn, out, reference(attn, batch, q)


# Rows 0-2 share blocks 1, 2, 3 and row 6 only 1, 2 (its third block is its own): one group sharing 2
# blocks. Rows 3-4 share 2 blocks; row 5 is alone.
TABLES = [[1, 2, 3, 20], [1, 2, 3, 21, 22], [1, 2, 3, 23], [10, 11, 30], [10, 11, 31, 32], [40, 41], [1, 2, 4]]
LENS = [14, 19, 13, 10, 16, 7, 12]


@pytest.mark.parametrize("prefill", [None, ([50, 51, 52], 11)])
def test_shared_prefix_decode_matches_per_sequence_attention(any_saving, prefill):
    attn, out, ref = attend(TABLES, LENS, prefill)
    groups = {tuple(rows): n for rows, n in shared_prefixes(TABLES, LENS, BLOCK)}
    assert groups == {(0, 1, 2, 6): 2, (3, 4): 2}
    # a short chunk's 3 query rows join the batched pass; sharing all their blocks, they form a group too
    assert len(attn._shared) == (2 if prefill is None else 3)
    assert attn.num_rows == out.shape[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("new", [runner.SHORT_CHUNK, runner.SHORT_CHUNK + 1])
def test_short_chunks_join_the_batched_pass_longer_ones_run_alone(new):
    table = list(range(50, 50 + -(-(new + 5) // BLOCK)))
    attn, out, ref = attend(TABLES, LENS, (table, new + 5), new=new)
    assert attn.num_rows == len(TABLES) + (new if new <= runner.SHORT_CHUNK else 0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_without_shared_blocks_the_plain_path_is_used(any_saving):
    tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    attn, out, ref = attend(tables, [11, 6, 15])
    assert attn._shared == []
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_shared_prefix_decode_in_bfloat16(any_saving):
    _, out, ref = attend(TABLES, LENS, dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_shared_blocks_stop_before_each_rows_newest_key(any_saving):
    # Equal tables, but the blocks holding a row's newest key stay in that row's own pass.
    assert shared_prefixes([[1, 2, 3], [1, 2, 3]], [12, 9], BLOCK) == [([0, 1], 2)]
    assert shared_prefixes([[1], [1]], [3, 4], BLOCK) == []


def test_a_group_pass_needs_to_save_enough_block_reads(monkeypatch):
    # Reading k shared blocks once for r rows saves (r - 1) x k reads; a group needs MIN_SAVED_BLOCKS.
    monkeypatch.setattr(runner, "MIN_SAVED_BLOCKS", 12)
    table = list(range(1, 5))
    rows = [table + [100 + i] for i in range(4)]
    assert shared_prefixes(rows, [4 * BLOCK + 1] * 4, BLOCK) == [([0, 1, 2, 3], 4)]  # 3 x 4 = 12: at the floor
    assert shared_prefixes(rows[:3], [4 * BLOCK + 1] * 3, BLOCK) == []  # 2 x 4 = 8
    assert shared_prefixes(rows, [3 * BLOCK + 1] * 4, BLOCK) == []  # 3 blocks before the newest keys: 9


def test_every_decode_in_a_group(any_saving):
    attn, out, ref = attend(TABLES[:5], LENS[:5])
    assert [(lo, hi) for lo, hi, _ in attn._shared] == [(0, 3), (3, 5)]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def dense_window_reference(q, k, v, q_start: int, window: int) -> torch.Tensor:
    """Query by query with an explicit list of visible keys (p - window < j <= p), softmax in float64."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        p = q_start + i
        visible = [j for j in range(k.shape[0]) if p - window < j <= p]
        for h in range(q.shape[1]):
            scores = torch.stack([q[i, h].double() @ k[j, h // group].double() for j in visible]) * SCALE
            out[i, h] = (torch.softmax(scores, 0)[:, None] * v[visible, h // group].double()).sum(0).to(q.dtype)
    return out


@pytest.mark.parametrize("window", [3, 5, 8])
def test_sliding_window_reads_only_blocks_in_the_window(window):
    """Decodes and a prefill chunk at contexts well past the window equal the dense reference, although every
    block wholly before each row's window is poisoned with NaN (one read of it would spread NaN)."""
    torch.manual_seed(1)
    tables, lens = [[1, 2, 3, 20], [5, 6, 7, 8, 9], [40, 41], [42]], [14, 19, 7, 2]
    prefill = ([50, 51, 52, 53], 15)
    attn = PagedAttention(1, NUM_BLOCKS, BLOCK, HKV, DIM, torch.float32, torch.device("cpu"), SCALE, window)
    attn.k[0].normal_()
    attn.v[0].normal_()
    batch = decode_batch(tables, lens, prefill)
    q = torch.randn(batch.num_tokens, HQ, DIM)
    k, v = (torch.randn(batch.num_tokens, HKV, DIM) for _ in range(2))
    attn.prepare(batch)
    # what the step will write, then keys/values in position order for the reference
    flat_k, flat_v = attn.k[0].view(HKV, -1, DIM), attn.v[0].view(HKV, -1, DIM)
    flat_k[:, batch.slot_mapping] = k.transpose(0, 1)
    flat_v[:, batch.slot_mapping] = v.transpose(0, 1)
    starts = batch.query_start.tolist()
    expect = torch.empty_like(q)
    for b, length in enumerate(batch.context_lens.tolist()):
        positions = torch.arange(length)
        slots = batch.block_tables[b, positions // BLOCK] * BLOCK + positions % BLOCK
        lo, hi = starts[b], starts[b + 1]
        expect[lo:hi] = dense_window_reference(q[lo:hi], flat_k[:, slots].transpose(0, 1),
                                               flat_v[:, slots].transpose(0, 1), length - (hi - lo), window)
        first_visible = length - (hi - lo) - window + 1
        for block in batch.block_tables[b, : max(0, first_visible) // BLOCK].tolist():
            attn.k[0][:, block] = float("nan")
            attn.v[0][:, block] = float("nan")
    out = attn.attend(0, q, k, v)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("copies", [
    [(1, 4)],
    [(1, 4), (2, 5), (3, 6)],  # one step admitting several sequences onto shared partial blocks
    [(1, 4), (4, 7)],  # a copy of a block an earlier copy wrote (a fork of a just-copied sequence)
    [(4, 8), (1, 4)],  # a block read before a later copy overwrites it
    [(1, 9), (2, 9)],  # the same block written twice: the last copy wins
])
def test_block_copies_equal_copying_one_by_one(copies):
    """`StepBatch.block_copies`, made in one gather per pool, leave every pool as copying each (src, dst) in
    order would."""
    attn = PagedAttention(3, 12, BLOCK, HKV, DIM, torch.float32, torch.device("cpu"), DIM**-0.5)
    for pool in (*attn.k, *attn.v):
        pool.normal_()
    expected = [p.clone() for p in (*attn.k, *attn.v)]
    for src, dst in copies:
        for pool in expected:
            pool[:, dst] = pool[:, src].clone()
    empty = torch.zeros(0, dtype=torch.long)
    attn.prepare(StepBatch(input_ids=empty, positions=empty, slot_mapping=empty,
                           query_start=torch.zeros(1, dtype=torch.long), context_lens=empty,
                           block_tables=torch.zeros(0, 1, dtype=torch.long), num_decodes=0, logits_rows=empty,
                           block_copies=torch.tensor(copies)))
    for got, want in zip((*attn.k, *attn.v), expected):
        assert torch.equal(got, want)
