"""Triton paged attention under TRITON_INTERPRET=1 on CPU against the plain-torch references: random block
tables, GQA, ragged lengths, split-K, shared prefixes merged by log-sum-exp, (chunked) prefill; block
sizes 16 and 32. Shapes are small: the interpreter costs about a millisecond per program."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import kernels.paged_attention as pa  # noqa: E402
from kernels.paged_attention_reference import (  # noqa: E402
    attention_part,
    decode_part_reference,
    gather_keys,
    merge_reference,
    paged_decode_reference,
    paged_prefill_reference,
)

if type(pa._decode_kernel).__name__ != "InterpretedFunction":  # imported earlier without the interpreter
    pa = importlib.reload(pa)

NUM_BLOCKS, DIM = 48, 16
SCALE = DIM**-0.5
TOL = 2e-5


def pools(hkv: int, block_size: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (hkv, NUM_BLOCKS, block_size, DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def random_tables(lens: list[int], block_size: int, seed: int, shared: dict[int, int] | None = None) -> torch.Tensor:
    """Distinct random blocks per row; rows in `shared` (row -> donor row) start with the donor's first
    blocks (as many as both have full ones)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    for row, donor in (shared or {}).items():
        common = min(lens[row] - 1, lens[donor] - 1) // block_size
        tables[row, :common] = tables[donor, :common]
    assert used <= NUM_BLOCKS
    return tables


CASES = [  # (Hq, Hkv, context lengths)
    (4, 2, [1, 17, 40, 5]),
    (6, 2, [33, 64, 2]),  # group of 3 (padded to 4)
    (4, 4, [70]),
    (8, 1, [16, 31, 9]),  # one KV head for all
]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv,lens", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_equals_reference(block_size, hq, hkv, lens, splits):
    k_pool, v_pool = pools(hkv, block_size, seed=len(lens))
    tables = random_tables(lens, block_size, seed=hq + splits)
    q = torch.randn(len(lens), hq, DIM, generator=torch.Generator().manual_seed(hq))
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = pa.paged_decode(q, k_pool, v_pool, tables, ctx, SCALE, num_splits=splits)
    ref = paged_decode_reference(q, k_pool, v_pool, tables, ctx, SCALE)
    assert (out - ref).abs().max().item() < TOL


def test_decode_bfloat16_pools_read_in_place():
    k_pool, v_pool = pools(2, 16, torch.bfloat16, seed=3)
    lens = [20, 47]
    tables = random_tables(lens, 16, seed=5)
    q = torch.randn(2, 4, DIM).to(torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = pa.paged_decode(q, k_pool, v_pool, tables, ctx, SCALE, num_splits=2)
    ref = paged_decode_reference(q, k_pool, v_pool, tables, ctx, SCALE)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max().item() <= 2 * 2**-8 * ref.float().abs().max().item()


@pytest.mark.parametrize("block_size", [16, 32])
def test_shared_prefix_decode_merges_exactly(block_size):
    """Rows 0, 2 and 3 share their leading blocks (row 1 is alone): the prefix pass over the shared blocks
    plus the per-row pass after them, merged, equals plain attention over each row's whole context."""
    hq, hkv = 6, 2
    lens = [3 * block_size + 5, 40, 2 * block_size + 1, 4 * block_size]
    members = [0, 2, 3]
    k_pool, v_pool = pools(hkv, block_size, seed=11)
    tables = random_tables(lens, block_size, seed=7, shared={2: 0, 3: 0})
    shared_blocks = 2  # full blocks before every member's last key: min(len - 1) // block_size
    q = torch.randn(len(lens), hq, DIM, generator=torch.Generator().manual_seed(2))
    ctx = torch.tensor(lens, dtype=torch.int32)
    start = torch.tensor([shared_blocks, 0, shared_blocks, shared_blocks], dtype=torch.int32)
    splits = 2
    o_parts = torch.zeros(splits + 1, len(lens), hq, DIM)
    lse_parts = torch.full((splits + 1, len(lens), hq), float("-inf"))
    pa.paged_decode_partial(q, k_pool, v_pool, tables, ctx, start, o_parts[:splits], lse_parts[:splits], SCALE)
    # The per-row pass alone equals the reference over the keys after the shared blocks.
    own_o, own_lse = decode_part_reference(q, k_pool, v_pool, tables, ctx, start, SCALE)
    got = merge_reference(list(o_parts[:splits]), list(lse_parts[:splits]))
    assert (got - own_o).abs().max().item() < TOL
    assert (torch.logsumexp(lse_parts[:splits], 0) - own_lse).abs().max().item() < TOL
    rows_per_tile = 2  # two tiles for the group of three rows: exercises a partial tile
    tiles = torch.tensor(pa.prefix_tiles([len(members)], rows_per_tile), dtype=torch.int32).T.contiguous()
    prefix_tables = tables[:1, :shared_blocks].contiguous()
    prefix_blocks = torch.tensor([shared_blocks], dtype=torch.int32)
    pa.prefix_decode_partial(q, k_pool, v_pool, prefix_tables, prefix_blocks, torch.tensor(members),
                             tiles, o_parts[splits], lse_parts[splits], SCALE, rows_per_tile)
    for b in members:  # the prefix part alone equals attention over the shared keys
        keys = gather_keys(k_pool, tables[0], 0, shared_blocks * block_size)
        values = gather_keys(v_pool, tables[0], 0, shared_blocks * block_size)
        o, lse = attention_part(q[b : b + 1], keys, values, SCALE)
        assert (o_parts[splits, b] - o[0]).abs().max().item() < TOL
        assert (lse_parts[splits, b] - lse[0]).abs().max().item() < TOL
    assert torch.isneginf(lse_parts[splits, 1]).all()  # row 1 is in no group: untouched
    out = pa.merge_partials(o_parts, lse_parts, torch.empty_like(q))
    ref = paged_decode_reference(q, k_pool, v_pool, tables, ctx, SCALE)
    assert (out - ref).abs().max().item() < TOL


def test_decode_rows_without_keys_give_zeros():
    """Padding rows of a CUDA graph bucket have context length 0: zeros, no NaN to leak anywhere."""
    k_pool, v_pool = pools(2, 16)
    out = pa.paged_decode(torch.randn(2, 4, DIM), k_pool, v_pool, torch.zeros(2, 1, dtype=torch.int32),
                          torch.tensor([0, 0], dtype=torch.int32), SCALE, num_splits=2)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2), (2, 2)])
def test_prefill_equals_reference(block_size, hq, hkv):
    """Two decode rows (skipped), then a whole-prompt prefill, a chunk after cached context, and a chunk
    longer than one BLOCK_M tile after context."""
    k_pool, v_pool = pools(hkv, block_size, seed=hq)
    lens = [9, 30, 21, 50, 45]
    new = [1, 1, 21, 7, 20]
    tables = random_tables(lens, block_size, seed=block_size + hq)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, DIM, generator=torch.Generator().manual_seed(1))
    query_start = torch.tensor(starts, dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    block_m = pa.prefill_block_m()
    tiles = torch.tensor(pa.prefill_tiles(starts, 2, block_m), dtype=torch.int32).T.contiguous()
    out = pa.paged_prefill(q, k_pool, v_pool, tables, query_start, ctx, tiles, SCALE, block_m, torch.zeros_like(q))
    ref = paged_prefill_reference(q, k_pool, v_pool, tables, query_start, ctx, 2, SCALE)
    assert (out - ref).abs().max().item() < TOL
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))  # decode rows are not the prefill kernel's


def poison_before_window(pools_, tables, first_keys, block_size):
    """NaN in every block wholly before each row's first visible key: one read of it would spread NaN."""
    for b, first in enumerate(first_keys):
        for j in range(first // block_size):
            for pool in pools_:
                pool[:, tables[b, j]] = float("nan")


@pytest.mark.parametrize("window", [5, 16, 40])
@pytest.mark.parametrize("splits", [1, 3])
def test_windowed_decode_equals_reference(window, splits):
    """Each row sees its last `window` keys; blocks wholly before that are never read."""
    block_size, hq, hkv = 16, 6, 2
    lens = [3, 17, 60, 95, 40]
    k_pool, v_pool = pools(hkv, block_size, seed=window)
    tables = random_tables(lens, block_size, seed=window + splits)
    q = torch.randn(len(lens), hq, DIM, generator=torch.Generator().manual_seed(window))
    ctx = torch.tensor(lens, dtype=torch.int32)
    ref = paged_decode_reference(q, k_pool, v_pool, tables, ctx, SCALE, window)
    poison_before_window((k_pool, v_pool), tables, [max(0, n - window) for n in lens], block_size)
    out = pa.paged_decode(q, k_pool, v_pool, tables, ctx, SCALE, num_splits=splits, window=window)
    assert (out - ref).abs().max().item() < TOL


@pytest.mark.parametrize("window", [4, 16, 33])
def test_windowed_prefill_equals_reference(window):
    """Chunks longer and shorter than the window, after cached context: the query at p sees keys
    p - window < j <= p, and blocks before the chunk's first window are never read."""
    block_size, hq, hkv = 16, 4, 2
    lens = [9, 30, 50, 80]
    new = [1, 30, 7, 40]
    k_pool, v_pool = pools(hkv, block_size, seed=window)
    tables = random_tables(lens, block_size, seed=window)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, DIM, generator=torch.Generator().manual_seed(window))
    query_start = torch.tensor(starts, dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    block_m = pa.prefill_block_m()
    tiles = torch.tensor(pa.prefill_tiles(starts, 1, block_m), dtype=torch.int32).T.contiguous()
    ref = paged_prefill_reference(q, k_pool, v_pool, tables, query_start, ctx, 1, SCALE, window)
    firsts = [max(0, n - m - window + 1) for n, m in zip(lens, new)]
    poison_before_window((k_pool, v_pool), tables, firsts, block_size)
    out = pa.paged_prefill(q, k_pool, v_pool, tables, query_start, ctx, tiles, SCALE, block_m, torch.zeros_like(q),
                           window=window)
    assert (out[new[0]:] - ref[new[0]:]).abs().max().item() < TOL


def test_window_reference_is_mistral_rule():
    """The windowed references against explicit key lists: the query at p sees p - window < j <= p."""
    k_pool, v_pool = pools(1, 16, seed=4)
    tables = random_tables([40], 16, seed=4)
    q = torch.randn(40, 2, DIM, generator=torch.Generator().manual_seed(4))
    prefill = paged_prefill_reference(q, k_pool, v_pool, tables, torch.tensor([0, 40]), torch.tensor([40]), 0,
                                      SCALE, window=7)
    for p in (0, 6, 7, 39):
        keys = gather_keys(k_pool, tables[0], max(0, p - 6), p + 1)
        values = gather_keys(v_pool, tables[0], max(0, p - 6), p + 1)
        assert torch.allclose(prefill[p], attention_part(q[p : p + 1], keys, values, SCALE)[0][0], atol=1e-6)
    decode = paged_decode_reference(q[39:], k_pool, v_pool, tables, torch.tensor([40]), SCALE, window=7)
    assert torch.allclose(decode[0], prefill[39], atol=1e-6)


def test_rejects_a_window_without_positions():
    k_pool, v_pool = pools(1, 16)
    with pytest.raises(ValueError, match="sliding window"):
        pa.paged_decode(torch.zeros(1, 2, DIM), k_pool, v_pool, torch.zeros(1, 1, dtype=torch.int32),
                        torch.ones(1, dtype=torch.int32), SCALE, window=0)


def test_prefix_tiles_cover_each_group_in_order():
    assert pa.prefix_tiles([3, 1, 4], 2) == [(0, 0, 2), (0, 2, 3), (1, 3, 4), (2, 4, 6), (2, 6, 8)]


def test_decode_splits_choice():
    assert pa.decode_splits(1, 8, 100, 132) == 16  # one long row: as many splits as allowed
    assert pa.decode_splits(1, 8, 3, 132) == 2  # never more splits than blocks
    assert pa.decode_splits(256, 8, 100, 132) == 1  # a full batch fills the GPU alone
    assert pa.decode_splits(8, 4, 64, 132) == 8  # ceil(2 * 132 / 32) = 9, rounded down to a compiled count
    chosen = {pa.decode_splits(b, h, blocks, 132) for b in range(1, 300) for h in (1, 3, 8) for blocks in (1, 7, 64)}
    assert chosen == set(pa.SPLIT_CHOICES)  # a few compiled variants serve every step


def test_step_metadata_does_not_specialize_the_kernels(monkeypatch):
    """The per-step index arrays and table widths (views at any offset of one upload, widths of any value)
    must not pick a compiled variant, or a new step layout would compile mid-run: the kernels' decorator
    turns Triton's specialization off for the arguments it names, and names only real parameters."""
    import triton

    def kernel(q_ptr, tables_ptr, stride_tb, BLOCK: tl.constexpr):
        pass

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)  # the compiled path's JITFunction
    compiled = pa._step_jit("tables_ptr", "stride_tb")(kernel)
    flags = {p.name: (p.do_not_specialize, p.do_not_specialize_on_alignment) for p in compiled.params}
    assert flags == {"q_ptr": (False, False), "tables_ptr": (True, True), "stride_tb": (True, True),
                     "BLOCK": (False, False)}
    with pytest.raises(TypeError, match="no parameters"):
        pa._step_jit("table_ptr")(kernel)


def test_rejects_block_sizes_the_kernels_cannot_tile():
    k_pool = torch.zeros(2, 4, 8, DIM)
    with pytest.raises(ValueError, match="block size"):
        pa.paged_decode(torch.zeros(1, 4, DIM), k_pool, k_pool, torch.zeros(1, 1, dtype=torch.int32),
                        torch.ones(1, dtype=torch.int32), SCALE)
