"""GPTQ rounding against round-to-nearest and the properties that define it."""

from __future__ import annotations

import pytest
import torch

from kernels.wq_reference import quantize_int8
from pipeline.model.gptq import BLOCK, gptq_int8


def _correlated_inputs(tokens: int, channels: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels correlate (as a layer's do: what gives error compensation something to use), all
    seeds with the same correlations."""
    mix = torch.randn(channels, channels, generator=torch.Generator().manual_seed(0)) / channels**0.5
    samples = torch.randn(tokens, channels, generator=torch.Generator().manual_seed(seed + 1))
    return samples @ (mix + torch.eye(channels))


def _output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> float:
    return float(((x @ w.T - x @ (q.float() * scales).T) ** 2).sum())


@pytest.mark.parametrize("bound", [63, 127])
def test_gptq_lowers_the_output_error_of_nearest_rounding(bound):
    k = 3 * BLOCK + 17  # several blocks and a partial one
    w = torch.randn(96, k, generator=torch.Generator().manual_seed(1))
    x = _correlated_inputs(512, k)
    q, scales = gptq_int8(w, x.T @ x, bound)
    nearest_q, nearest_scales = quantize_int8(w, bound=bound)
    assert q.dtype == torch.int8 and q.shape == w.shape and int(q.abs().max()) <= bound
    torch.testing.assert_close(scales, nearest_scales)  # the layout's scales are round-to-nearest's
    assert _output_error(x, w, q, scales) < 0.7 * _output_error(x, w, nearest_q, nearest_scales)
    held_out = _correlated_inputs(512, k, seed=2)  # drawn like the calibration inputs, not seen by them
    assert _output_error(held_out, w, q, scales) < _output_error(held_out, w, nearest_q, nearest_scales)


def test_uncorrelated_inputs_give_nearest_rounding():
    # A diagonal Gram matrix spreads no error onto other channels: each weight rounds to its nearest level.
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(3))
    gram = torch.diag(torch.rand(70, generator=torch.Generator().manual_seed(4)) + 0.5)
    assert torch.equal(gptq_int8(w, gram, 63)[0], quantize_int8(w, bound=63)[0])


def test_channels_no_input_reached_are_zero():
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(5))
    x = _correlated_inputs(64, 40)
    x[:, [3, 17]] = 0.0
    q, _ = gptq_int8(w, x.T @ x, 127)
    assert not q[:, [3, 17]].any() and q[:, 0].any()


def test_a_gram_matrix_of_other_channels_is_refused():
    with pytest.raises(ValueError, match="does not match a weight of 8 input channels"):
        gptq_int8(torch.randn(4, 8), torch.eye(9))
