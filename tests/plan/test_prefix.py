"""Properties of the prefix ordering, against brute-force references."""

from hypothesis import given
from hypothesis import strategies as st

from pipeline.plan.prefix import PrefixTreeCounter, common_prefix_len, prefix_order, unique_prefix_tokens

seqs = st.lists(st.lists(st.integers(0, 4), max_size=8), max_size=30)


@given(seqs)
def test_order_is_a_deterministic_permutation(s):
    order = prefix_order(s)
    assert sorted(order) == list(range(len(s)))
    assert order == prefix_order(s)


@given(seqs)
def test_order_is_sorted_and_stable(s):
    order = prefix_order(s)
    for a, b in zip(order, order[1:]):
        assert s[a] < s[b] or (s[a] == s[b] and a < b)


@given(seqs, st.integers(1, 4))
def test_rows_sharing_a_prefix_are_contiguous(s, k):
    order = prefix_order(s)
    keys = [tuple(s[i][:k]) for i in order if len(s[i]) >= k]
    # every k-token prefix occupies one contiguous run in the ordered rows that have >= k tokens
    seen, prev = set(), None
    for key in keys:
        if key != prev:
            assert key not in seen
            seen.add(key)
        prev = key


@given(seqs)
def test_unique_prefix_tokens_counts_trie_nodes(s):
    nodes = {tuple(x[:n]) for x in s for n in range(1, len(x) + 1)}
    assert unique_prefix_tokens(s) == len(nodes)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5, 6], [5, 6]) == 2


@given(seqs, st.randoms(use_true_random=False))
def test_counter_matches_the_trie_in_any_insertion_order(s, rnd):
    order = list(range(len(s)))
    rnd.shuffle(order)
    counter, added = PrefixTreeCounter(), []
    for k, i in enumerate(order):
        added.append(counter.add(s[i]))
        assert counter.total == unique_prefix_tokens([s[j] for j in order[: k + 1]])
    assert sum(added) == counter.total == unique_prefix_tokens(s)
