"""The native CPU paged decode attention against the plain-torch reference, and how it is built, cached and
refused. Skipped only where the kernel cannot build (no C compiler or no AVX2); CI machines have both. The
tests of its arithmetic run on both builds (`build`, tests/kernels/conftest.py): for this CPU, and its AVX2
paths with AVX-512 switched off."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import cpu_attention, native_build
from kernels.cpu_attention import NativeKernelUnavailable, dequantize_kv, load_paged_decode, quantize_kv
from kernels.native_build import cpu_identity
from kernels.paged_attention_reference import attention_part, gather_keys, paged_decode_reference
from pipeline.engine.runner import PagedAttention, StepBatch


def kernel_or_skip(head_dim: int, group: int, block: int,
                   kv_dtype: torch.dtype = torch.float32) -> cpu_attention.PagedDecodeKernel:
    try:
        return load_paged_decode(head_dim, group, block, kv_dtype)
    except NativeKernelUnavailable as e:
        pytest.skip(f"native kernel unavailable here: {e}")


def scattered_pools(hkv: int, num_blocks: int, block: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, num_blocks, block, dim, generator=g)
    v = torch.randn(hkv, num_blocks, block, dim, generator=g)
    return k, v, torch.randperm(num_blocks, generator=g)


def stored(k: torch.Tensor, v: torch.Tensor, kv_dtype: torch.dtype):
    """Pools of `kv_dtype` holding k and v, the scale pools the kernel takes with them (int8), and the float32
    keys and values they stand for (the reference's)."""
    if kv_dtype != torch.int8:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
        return (k, v), {}, (k.float(), v.float())
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return (kq, vq), {"k_scales": ks, "v_scales": vs}, (dequantize_kv(kq, ks), dequantize_kv(vq, vs))


def queries_as_scored(kernel: cpu_attention.PagedDecodeKernel, q: torch.Tensor, scale: float) -> torch.Tensor:
    """The queries the kernel's scores see: with integer scores (int8 pools, AVX-512 builds) each query times
    `scale` is rounded to int16 with its own scale, 2^-15 of its largest value (times the scale's float32
    reciprocal, as the kernel: dividing instead rounds some halves the other way); else q itself."""
    if not kernel.integer_scores:
        return q
    scaled = q * scale
    step = scaled.abs().amax(-1, keepdim=True) / 32767
    return torch.round(scaled * torch.where(step > 0, 1 / step, 0.0)) * step / scale


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("dim,group,block", [(64, 3, 16), (32, 1, 16), (64, 4, 32), (128, 2, 16), (64, 3, 64), (64, 8, 16)])
def test_matches_reference_over_scattered_blocks(build, dim, group, block, kv_dtype):
    """Narrower pools: the reference reads the vectors they stand for (bfloat16 widened, int8 times its
    scale) and the queries as the kernel scores them; all other arithmetic is float32."""
    kernel = kernel_or_skip(dim, group, block, kv_dtype)
    hkv, rows = 3, 9
    lens = torch.tensor([1, block - 1, block, block + 1, 3 * block, 5 * block + 7, 2, 40, 4 * block - 1])
    width = -(-int(lens.max()) // block) + 1  # one spare column: tables are padded past a row's blocks
    k, v, perm = scattered_pools(hkv, rows * width, block, dim)
    pools, scales, (k, v) = stored(k, v, kv_dtype)
    tables = perm[: rows * width].view(rows, width).contiguous()
    q = torch.randn(rows, hkv * group, dim, generator=torch.Generator().manual_seed(2))
    out = kernel(q, *pools, tables, lens, torch.zeros_like(lens), dim**-0.5, **scales)
    expect = paged_decode_reference(queries_as_scored(kernel, q, dim**-0.5), k, v, tables, lens, dim**-0.5)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_reads_only_keys_from_first_to_len(build, kv_dtype):
    """Keys before `first` (a sliding window) and past `lens` (the rest of the last block) are NaN: any read
    of them would spread NaN."""
    dim, group, block = 64, 3, 16
    kernel = kernel_or_skip(dim, group, block, kv_dtype)
    lens = torch.tensor([20, 50, 37, 5])
    first = torch.tensor([3, 33, 16, 0])
    k, v, perm = scattered_pools(3, 32, block, dim, seed=1)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    tables = perm[:16].view(4, 4).contiguous()
    for row, (lo, hi) in enumerate(zip(first.tolist(), lens.tolist())):
        for pos in [*range(0, lo), *range(hi, 4 * block)]:
            blk, off = tables[row, pos // block], pos % block
            k[:, blk, off] = v[:, blk, off] = float("nan")
    q = torch.randn(4, 3 * group, dim, generator=torch.Generator().manual_seed(2))
    out = kernel(q, k, v, tables, lens, first, 0.125)
    expect = torch.stack([
        attention_part(q[r : r + 1], gather_keys(k, tables[r], lo, hi).float(),
                       gather_keys(v, tables[r], lo, hi).float(), 0.125)[0][0]
        for r, (lo, hi) in enumerate(zip(first.tolist(), lens.tolist()))])
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_int8_scores_only_keys_from_first_to_len(build):
    """int8 pools (integer scores score whole blocks, then mask): keys before `first` and past `lens` are
    large, so any that leaked into the softmax would take over the output."""
    dim, group, block = 64, 3, 16
    kernel = kernel_or_skip(dim, group, block, torch.int8)
    lens = torch.tensor([20, 50, 37, 5])
    first = torch.tensor([3, 33, 16, 0])
    k, v, perm = scattered_pools(3, 32, block, dim, seed=1)
    tables = perm[:16].view(4, 4).contiguous()
    q = torch.randn(4, 3 * group, dim, generator=torch.Generator().manual_seed(2))
    for row, (lo, hi) in enumerate(zip(first.tolist(), lens.tolist())):
        for pos in [*range(0, lo), *range(hi, 4 * block)]:
            blk, off = tables[row, pos // block], pos % block
            k[:, blk, off] = 50 * q[row].view(3, group, dim).mean(1)  # scores far above the visible keys'
            v[:, blk, off] = 100.0
    pools, scales, (k, v) = stored(k, v, torch.int8)
    out = kernel(q, *pools, tables, lens, first, 0.125, **scales)
    scored = queries_as_scored(kernel, q, 0.125)
    expect = torch.stack([
        attention_part(scored[r : r + 1], gather_keys(k, tables[r], lo, hi), gather_keys(v, tables[r], lo, hi),
                       0.125)[0][0]
        for r, (lo, hi) in enumerate(zip(first.tolist(), lens.tolist()))])
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_int8_scores_are_integer_where_avx512_builds(build):
    """The integer score path is compiled in wherever the CPU has AVX-512 BW and the build uses it (and only
    for int8 pools)."""
    flags = cpu_identity().split()
    assert kernel_or_skip(64, 3, 16, torch.int8).integer_scores == ("avx512bw" in flags and build == "native")
    assert not kernel_or_skip(64, 3, 16, torch.float32).integer_scores


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_large_score_spread_stays_exact(build, kv_dtype):
    """Scores far apart (the online softmax rescales often, exp underflows to 0) match the reference."""
    dim, group, block = 64, 3, 16
    kernel = kernel_or_skip(dim, group, block, kv_dtype)
    k, v, perm = scattered_pools(3, 12, block, dim, seed=2)
    k *= torch.linspace(0.1, 30, block * 12).view(1, 12, block, 1)  # later keys score much higher
    pools, scales, (k, v) = stored(k, v, kv_dtype)
    tables = perm.view(2, 6).contiguous()
    lens = torch.tensor([96, 70])
    q = torch.randn(2, 9, dim, generator=torch.Generator().manual_seed(5))
    # Scores reach ~100 here, so float32's rounding of a score alone moves exp() by ~1e-5 relative: the
    # tolerance is that of the arithmetic (1e-5 failed for about 1 query in 60).
    torch.testing.assert_close(kernel(q, *pools, tables, lens, torch.zeros_like(lens), 0.125, **scales),
                               paged_decode_reference(queries_as_scored(kernel, q, 0.125), k, v, tables, lens, 0.125),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [5, 2000])  # one thread, and the threaded pass
def test_write_matches_cast_and_index_copy(build, kv_dtype, tokens):
    """Exactly what `Tensor.to` + `index_copy_` store, rounding ties, tiny and huge values, infinities and
    NaN included; slots not written stay as they were."""
    kernel = kernel_or_skip(64, 3, 16, kv_dtype)
    hkv, num_blocks, block, dim = 3, 160, 16, 64
    g = torch.Generator().manual_seed(3)
    k = torch.randn(tokens, hkv, dim, generator=g) * 10 ** torch.randint(-30, 30, (tokens, hkv, dim), generator=g)
    v = torch.randn(tokens, hkv, dim, generator=g)
    # exact bfloat16 ties (halfway between two bfloat16 values, both parities) and specials
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0000001, float("nan"), float("inf"), -0.0, 1e-40])
    k.view(-1)[: len(ties)] = ties
    slots = torch.randperm(num_blocks * block, generator=g)[:tokens]
    pools = [torch.randn(hkv, num_blocks, block, dim, generator=g).to(kv_dtype) for _ in range(2)]
    expected = [p.clone() for p in pools]
    for pool, new in zip(expected, (k, v)):
        pool.view(hkv, -1, dim).index_copy_(1, slots, new.transpose(0, 1).to(kv_dtype))
    kernel.write(k, v, slots, *pools)
    for got, want in zip(pools, expected):  # exact; a NaN may carry other payload bits
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("tokens", [5, 2000])
def test_int8_write_matches_quantize_kv(build, tokens):
    """int8 pools: each new vector stored as `quantize_kv` stores it (values and scales, exactly), a zero
    vector included; slots not written stay as they were."""
    kernel = kernel_or_skip(64, 3, 16, torch.int8)
    hkv, num_blocks, block, dim = 3, 160, 16, 64
    g = torch.Generator().manual_seed(4)
    k = torch.randn(tokens, hkv, dim, generator=g) * 10 ** torch.randint(-3, 3, (tokens, hkv, 1), generator=g)
    v = torch.randn(tokens, hkv, dim, generator=g)
    k[0, 1] = 0.0
    slots = torch.randperm(num_blocks * block, generator=g)[:tokens]
    pools = [torch.randint(-127, 128, (hkv, num_blocks, block, dim), generator=g, dtype=torch.int8) for _ in "kv"]
    scales = [torch.rand(hkv, num_blocks, block, generator=g) for _ in "kv"]
    expected = [t.clone() for t in (*pools, *scales)]
    for i, new in enumerate((k, v)):
        q, s = quantize_kv(new.transpose(0, 1))
        expected[i].view(hkv, -1, dim)[:, slots] = q
        expected[2 + i].view(hkv, -1)[:, slots] = s
    kernel.write(k, v, slots, *pools, k_scales=scales[0], v_scales=scales[1])
    for got, want in zip((*pools, *scales), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert expected[2].view(hkv, -1)[1, slots[0]] == 0  # the zero vector's scale


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_write_reads_token_strided_views(build, kv_dtype):
    """Keys and values sliced out of a fused qkv output (tokens a whole qkv row apart) are stored as their
    contiguous copies are."""
    kernel = kernel_or_skip(64, 3, 16, kv_dtype)
    hkv, num_blocks, block, dim, hq = 3, 40, 16, 64, 9
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(37, (hq + 2 * hkv) * dim, generator=g)
    _, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=1)
    k, v = k.view(-1, hkv, dim), v.view(-1, hkv, dim)
    assert not k.is_contiguous() and not v.is_contiguous()
    slots = torch.randperm(num_blocks * block, generator=g)[: len(qkv)]
    int8 = kv_dtype == torch.int8
    results = []
    for keys, values in ((k, v), (k.contiguous(), v.contiguous())):
        pools = [torch.zeros(hkv, num_blocks, block, dim, dtype=kv_dtype) for _ in "kv"]
        scales = [torch.zeros(hkv, num_blocks, block) for _ in "kv"] if int8 else [None, None]
        kernel.write(keys, values, slots, *pools, k_scales=scales[0], v_scales=scales[1])
        results.append([*pools, *(scales if int8 else [])])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert results[0][0].abs().sum() > 0


def test_int8_pools_need_their_scales():
    kernel = kernel_or_skip(64, 3, 16, torch.int8)
    pool = torch.zeros(3, 4, 16, 64, dtype=torch.int8)
    tables, lens = torch.zeros(2, 2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"int8 pools need k_scales shaped \(3, 4, 16\)"):
        kernel(torch.zeros(2, 9, 64), pool, pool, tables, lens, lens, 1.0)
    with pytest.raises(ValueError, match="torch.float32 pools have no scales"):
        kernel_or_skip(64, 3, 16).write(torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), torch.zeros(1, dtype=torch.long),
                                        pool.float(), pool.float(), k_scales=torch.zeros(3, 4, 16))


def test_wrong_inputs_are_refused_with_their_name():
    kernel = kernel_or_skip(64, 3, 16)
    k = torch.zeros(3, 4, 16, 64)
    tables, lens = torch.zeros(2, 2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="tables must be a contiguous torch.int64"):
        kernel(torch.zeros(2, 9, 64), k, k, tables.int(), lens, lens, 1.0)
    with pytest.raises(ValueError, match="built for head_dim/group/block 64/3/16"):
        kernel(torch.zeros(2, 6, 64), k, k, tables, lens, lens, 1.0)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_runs_every_query_through_the_kernel(window, kv_dtype):
    """A step of decodes, a speculating sequence's 5-query chunk and a 30-query prefill chunk, all rows of
    the kernel's pass: the same output as torch's path (batched decode rows, a causal pass for the
    prefill), with and without a sliding window. bfloat16 pools under float32 queries: torch's path
    computes in bfloat16, hence the looser match."""
    kernel_or_skip(16, 3, 16, kv_dtype)
    block, hkv, dim = 16, 2, 16
    tables = [[3, 9, 4], [7, 1], [12, 2, 8, 5], [20, 21, 22], [30, 31, 32]]
    lens, new = [40, 17, 60, 36, 45], [1, 1, 1, 5, 30]
    slots, positions, starts = [], [], [0]
    for table, n, m in zip(tables, lens, new):
        positions += range(n - m, n)
        slots += [table[p // block] * block + p % block for p in range(n - m, n)]
        starts.append(starts[-1] + m)
    batch = StepBatch(
        input_ids=torch.zeros(len(slots), dtype=torch.long), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots), query_start=torch.tensor(starts), context_lens=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (4 - len(t)) for t in tables]), num_decodes=3,
        logits_rows=torch.zeros(0, dtype=torch.long))
    torch.manual_seed(3)
    q = torch.randn(len(slots), hkv * 3, dim)
    k, v = torch.randn(len(slots), hkv, dim), torch.randn(len(slots), hkv, dim)
    pools = torch.randn(2, hkv, 40, block, dim)
    outs = []
    for group in (3, None):
        attn = PagedAttention(1, 40, block, hkv, dim, kv_dtype, torch.device("cpu"), 0.25, window,
                              native_group=group)
        attn.k[0].copy_(pools[0])
        attn.v[0].copy_(pools[1])
        assert (attn.native is not None) == (group is not None)
        attn.prepare(batch)
        assert attn.num_rows == (len(slots) if group else 8)  # torch's pass: the decodes and the 5-query chunk
        outs.append(attn.attend(0, q, k, v))
        assert outs[-1].dtype == torch.float32 and attn.k[0].dtype == kv_dtype
    tol = 1e-5 if kv_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)


def test_build_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_KERNEL_CACHE", str(tmp_path))
    cpu_attention._kernel_or_reason.cache_clear()
    kernel_or_skip(32, 2, 16)
    built = list(tmp_path.glob("cpu_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_attention._kernel_or_reason.cache_clear()
    load_paged_decode(32, 2, 16)  # a new process would find the same file
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("cpu_attention-*")] == [stamp]
    cpu_attention._kernel_or_reason.cache_clear()


@pytest.mark.parametrize("why,setup", [
    ("PIPELINE_NATIVE=off leaves out the native attention", lambda mp: mp.setenv("PIPELINE_NATIVE", "off")),
    ("no C compiler", lambda mp: mp.setattr(native_build, "c_compiler", lambda: None)),
])
def test_unavailable_falls_back_to_torch_and_says_why(monkeypatch, caplog, why, setup):
    setup(monkeypatch)
    cpu_attention._kernel_or_reason.cache_clear()
    with pytest.raises(NativeKernelUnavailable, match=why):
        load_paged_decode(64, 3, 16)
    with caplog.at_level(logging.INFO, logger="pipeline.engine.runner"):
        attn = PagedAttention(1, 4, 16, 3, 64, torch.float32, torch.device("cpu"), 0.125, native_group=3)
    assert attn.native is None
    assert why in caplog.text
    cpu_attention._kernel_or_reason.cache_clear()


def test_shapes_the_kernel_does_not_take_are_refused():
    with pytest.raises(NativeKernelUnavailable, match="multiples of 16"):
        load_paged_decode(64, 3, 8)
    with pytest.raises(NativeKernelUnavailable, match="at most 16"):
        load_paged_decode(64, 17, 16)
    with pytest.raises(NativeKernelUnavailable, match="float16"):
        load_paged_decode(64, 3, 16, torch.float16)
    # such pools keep torch's path
    assert PagedAttention(1, 4, 16, 3, 64, torch.float16, torch.device("cpu"), 0.125, native_group=3).native is None
