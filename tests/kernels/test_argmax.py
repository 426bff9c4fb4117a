"""The chunked row argmax against torch's argmax."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import row_argmax


@pytest.mark.parametrize("vocab", [100, 2048, 49152, 50000])  # one chunk, whole chunks, a ragged tail
def test_row_argmax_is_torch_argmax(vocab):
    """The same index as torch's argmax, ties (first wins, within and across chunks), NaN (wins, the first
    one) and rows of -inf included."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[0, [3, vocab - 1]] = 50.0  # tie across the ends
    x[1, [vocab // 2, vocab // 2 + 1]] = 50.0  # tie inside a chunk
    x[2, [vocab - 1, 7]] = float("nan")
    x[3, vocab - 1] = float("nan")  # NaN only in the tail
    x[4] = float("-inf")
    x[5, vocab - 2 :] = 60.0  # the maximum in the tail, tied
    x[6, 0] = float("inf")
    x[7, -(vocab % 1024 or 1) :] = x[7].max()  # tail ties the body's maximum: the body's index wins
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x[:, :-1]), x[:, :-1].argmax(dim=-1))  # a non-contiguous view
