"""Block accounting and the prefix cache: exact reuse, sound ref counts, a whole pool when idle."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engine.kv_cache import KVCacheManager
from pipeline.engine.request import SamplingParams
from pipeline.engine.sequence import Sequence

BS = 4


def _seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, seq_id, 0, list(tokens), len(tokens), SamplingParams(), 0, None)


def _run(kv: KVCacheManager, seq: Sequence) -> list[int]:
    """Admit with the prefix match, compute everything, register: returns the matched blocks."""
    matched = kv.match_prefix(seq)
    kv.admit(seq, matched)
    assert kv.allocate(seq, seq.num_tokens - seq.num_computed)
    seq.num_computed = seq.num_tokens
    kv.commit(seq)
    return matched


def test_allocate_release_accounting():
    kv = KVCacheManager(5, BS)
    a, b = _seq(list(range(1, 10))), _seq([7] * 8, 1)
    assert kv.allocate(a, 9) and len(a.block_table) == 3
    assert not kv.allocate(b, 9)  # needs 3, only 2 free: nothing taken
    assert b.block_table == [] and kv.num_free == 2
    assert kv.allocate(b, 8)
    kv.release(a)
    kv.release(b)
    assert kv.is_idle_whole()


def test_match_stops_short_of_the_last_token_and_reuses_only_equal_prefixes():
    kv = KVCacheManager(16, BS)
    first = _seq(list(range(1, 9)))  # exactly two blocks
    assert _run(kv, first) == []
    kv.release(first)
    same = _seq(list(range(1, 9)), 1)
    # The whole prompt is cached but the last token must be computed: only the first block matches.
    assert len(kv.match_prefix(same)) == 1
    longer = _seq(list(range(1, 9)) + [42], 2)
    assert len(kv.match_prefix(longer)) == 2
    differs_in_first = _seq([9, 2, 3, 4, 5, 6, 7, 8, 42], 3)
    assert kv.match_prefix(differs_in_first) == []
    differs_in_second = _seq([1, 2, 3, 4, 5, 6, 0, 8, 42], 4)
    assert len(kv.match_prefix(differs_in_second)) == 1


def test_prefix_caching_off_never_matches():
    kv = KVCacheManager(8, BS, prefix_caching=False)
    a = _seq(list(range(1, 10)))
    _run(kv, a)
    kv.release(a)
    assert kv.match_prefix(_seq(list(range(1, 10)), 1)) == []


def test_lru_evicts_least_recently_freed_cached_blocks_last_uncached_first():
    kv = KVCacheManager(4, BS)
    old, new = _seq([1] * 5), _seq([2] * 5, 1)
    _run(kv, old)  # blocks: one full (cached) + one partial (not cached)
    assert old.block_table == [0, 1]
    kv.release(old)
    _run(kv, new)
    assert new.block_table == [1, 2]
    kv.release(new)
    assert list(kv.free) == [2, 3, 0, 1]
    taker = _seq([3] * 4, 2)
    assert kv.allocate(taker, 4) and taker.block_table == [2]  # a never-cached block first
    assert kv.allocate(taker, 8) and taker.block_table == [2, 3]  # then the other uncached one
    assert kv.evictions == 0
    assert kv.allocate(taker, 12) and taker.block_table == [2, 3, 0]  # now a cached one: the older
    assert kv.evictions == 1
    assert kv.match_prefix(_seq([1] * 5, 3)) == []
    assert len(kv.match_prefix(_seq([2] * 5, 4))) == 1


def test_blocks_are_handed_out_in_id_order_and_uncached_frees_come_back_first():
    kv = KVCacheManager(6, BS, prefix_caching=False)
    a, b = _seq(list(range(1, 10))), _seq([7] * 5, 1)
    assert kv.allocate(a, 9) and a.block_table == [0, 1, 2]
    assert kv.allocate(b, 5) and b.block_table == [3, 4]
    assert list(kv.free) == [5]
    kv.release(a)  # nothing cached: a's blocks go to the front, its head first
    assert list(kv.free) == [0, 1, 2, 5]
    c = _seq([9] * 6, 2)
    assert kv.allocate(c, 6) and c.block_table == [0, 1]
    assert kv.ref_count == [1, 1, 0, 1, 1, 0]


def test_cached_blocks_queue_at_the_back_tail_first_and_are_evicted_in_that_order():
    kv = KVCacheManager(8, BS)
    a = _seq(list(range(1, 10)))  # two full blocks (cached) and one partial (not cached)
    assert _run(kv, a) == [] and a.block_table == [0, 1, 2]
    assert kv.hash_of[0] is not None and kv.hash_of[1] is not None and kv.hash_of[2] is None
    kv.release(a)
    # The partial block is reusable at once (front); the cached ones queue at the back, the tail before
    # the head, so a prefix loses its last block first.
    assert list(kv.free) == [2, 3, 4, 5, 6, 7, 1, 0]
    filler = _seq([50] * 28, 1)
    assert kv.allocate(filler, 24) and filler.block_table == [2, 3, 4, 5, 6, 7]
    assert kv.evictions == 0 and list(kv.free) == [1, 0]
    assert kv.allocate(filler, 28) and filler.block_table[-1] == 1
    assert kv.evictions == 1 and kv.hash_of[1] is None and list(kv.free) == [0]
    assert kv.match_prefix(_seq(list(range(1, 10)), 2)) == [0]  # the head survived its tail
    kv.release(filler)  # never committed: all uncached, to the front in table order
    assert list(kv.free) == [2, 3, 4, 5, 6, 7, 1, 0]


def test_a_shared_prefix_gets_the_same_block_ids():
    kv = KVCacheManager(10, BS)
    first = _seq(list(range(1, 13)) + [90])  # 3 full blocks + 1 token
    assert _run(kv, first) == [] and first.block_table == [0, 1, 2, 3]
    second = _seq(list(range(1, 13)) + [91, 92], 1)  # same 3 blocks while `first` still holds them
    assert _run(kv, second) == [0, 1, 2] and second.block_table == [0, 1, 2, 4]
    assert kv.ref_count[:5] == [2, 2, 2, 1, 1]
    branch = _seq(list(range(1, 9)) + [0, 0, 0, 0, 93], 2)  # shares the first 2 blocks, then differs
    assert _run(kv, branch) == [0, 1] and branch.block_table == [0, 1, 5, 6]
    assert kv.ref_count[:7] == [3, 3, 2, 1, 1, 1, 1]
    # The chain, not the block's own tokens, decides: block 2's tokens after a different first block miss.
    moved = _seq([0, 0, 0, 0] + list(range(5, 13)) + [94], 3)
    assert kv.match_prefix(moved) == []
    for seq in (first, second, branch):
        kv.release(seq)
    assert kv.is_idle_whole()


def test_an_evicted_block_breaks_the_chain_after_it():
    kv = KVCacheManager(4, BS)
    a = _seq(list(range(1, 14)))  # 3 full blocks + 1 token: table [0, 1, 2, 3]
    _run(kv, a)
    kv.release(a)
    assert list(kv.free) == [3, 2, 1, 0]
    taker = _seq([60] * 8, 1)
    assert kv.allocate(taker, 8) and taker.block_table == [3, 2]  # evicts the chain's last block (2)
    assert kv.evictions == 1
    assert kv.match_prefix(_seq(list(range(1, 14)), 2)) == [0, 1]
    kv.release(taker)  # uncached: back to the front, its head first
    assert list(kv.free) == [3, 2, 1, 0]
    # The lost block is recomputed into whichever block comes next, and the chain continues through it.
    again = _seq(list(range(1, 14)) + [7], 3)
    assert _run(kv, again) == [0, 1] and again.block_table == [0, 1, 3, 2]
    assert kv.match_prefix(_seq(list(range(1, 14)), 4)) == [0, 1, 3]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(8, BS)
    parent = _seq(list(range(1, 7)))  # 1 full block + 2 tokens
    _run(kv, parent)
    child = _seq(parent.token_ids, 1)
    assert kv.fork(parent, child)
    assert child.block_table[0] == parent.block_table[0]
    assert kv.pending_copies == [(parent.block_table[1], child.block_table[1])]
    assert kv.ref_count[parent.block_table[0]] == 2 and kv.ref_count[parent.block_table[1]] == 1
    kv.release(parent)
    kv.release(child)
    assert kv.is_idle_whole()


def test_partial_block_reuse_copies_the_longest_matching_continuation():
    kv = KVCacheManager(16, BS)
    for i, tokens in enumerate(([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 0, 0, 9])):
        seq = _seq(tokens, i)
        _run(kv, seq)
        kv.release(seq)
    seq = _seq([1, 2, 3, 4, 5, 6, 7, 1, 1], 2)
    matched = kv.match_prefix(seq)
    block, r = kv.match_partial(seq, matched)
    assert len(matched) == 1 and r == 3 and kv.tokens_of[block] == (5, 6, 7, 8)
    kv.admit(seq, matched, (block, r))
    assert seq.num_computed == 7 and kv.pending_copies == [(block, seq.block_table[1])]
    # Never the whole prompt: the last token stays to be computed.
    short = _seq([1, 2, 3, 4, 5, 6], 3)
    assert kv.match_partial(short, kv.match_prefix(short))[1] == 1
    assert kv.match_partial(_seq([9, 9, 9], 4), []) is None


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=14), min_size=1, max_size=12),
    num_blocks=st.integers(4, 12),
    data=st.data(),
)
def test_cache_properties(prompts, num_blocks, data):
    """Random admissions/releases: every hit holds exactly the tokens it stands for (recorded here
    independently at registration), ref counts stay >= 0 and the pool is whole once all are released."""
    kv = KVCacheManager(num_blocks, BS)
    content: dict[int, tuple[int, ...]] = {}  # block -> full token prefix it completes, set on registration
    live: list[Sequence] = []
    for i, tokens in enumerate(prompts):
        seq = _seq(tokens, i)
        matched = kv.match_prefix(seq)
        for j, block in enumerate(matched):
            assert content[block] == tuple(tokens[: (j + 1) * BS])
        assert len(matched) * BS <= len(tokens) - 1
        partial = kv.match_partial(seq, matched)
        if partial is not None:
            block, r = partial
            start = len(matched) * BS
            assert content[block][: start + r] == tuple(tokens[: start + r])
            assert start + r <= len(tokens) - 1
        needed = kv.blocks_needed(seq, len(tokens)) - len(matched)
        reclaimed = sum(1 for b in matched if kv.ref_count[b] == 0)
        if needed + reclaimed > kv.num_free:
            continue
        kv.admit(seq, matched, partial)
        kv.pending_copies.clear()
        assert kv.allocate(seq, len(tokens) - seq.num_computed)
        seq.num_computed = len(tokens)
        kv.commit(seq)
        for j, block in enumerate(seq.block_table[: len(tokens) // BS]):
            if kv.hash_of[block] is not None:
                content[block] = tuple(tokens[: (j + 1) * BS])
        live.append(seq)
        assert all(c >= 0 for c in kv.ref_count)
        assert sum(1 for c in kv.ref_count if c == 0) == kv.num_free
        if live and data.draw(st.booleans()):
            kv.release(live.pop(data.draw(st.integers(0, len(live) - 1))))
    for seq in live:
        kv.release(seq)
    assert kv.is_idle_whole()
