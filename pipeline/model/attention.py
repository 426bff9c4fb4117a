"""The one attention interface the model calls, and the plain causal attention of one sequence.

The model computes q/k/v and applies RoPE; where keys and values live (the engine's paged block pool,
or the tests' contiguous per-sequence cache in tests/reference.py) is the backend's business.

The model reaches its backend through one opaque operator, `pipeline::attend`, bound to a backend for the
length of a forward pass (`bound_backend`). Why an operator: `torch.compile` then treats attention (cache
writes, block tables, Python bookkeeping) as one call it does not trace, so the rest of a decoder layer
compiles into one graph that every layer shares, with the layer index as a tensor, not a constant.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from kernels.ops import define_op


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k/v [T, Hkv, D] for `layer` and return attention output [T, Hq, D]."""
        ...


_bound: list[AttentionBackend] = []  # the backend of the forward pass in progress (innermost last)


@contextmanager
def bound_backend(backend: AttentionBackend) -> Iterator[None]:
    """Route `attend` calls to `backend` while the block runs."""
    _bound.append(backend)
    try:
        yield
    finally:
        _bound.pop()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    if not _bound:
        raise RuntimeError("attention called outside a forward pass: no backend is bound (bound_backend)")
    return _bound[-1].attend(int(layer), q, k, v).contiguous()


def _attend_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)


# The bound backend's attention for layer `layer` (a 0-d int64 tensor): q [T, Hq, D] -> [T, Hq, D], contiguous
# (the layout compiled callers are built for), a new tensor.
attend = define_op("attend", "(Tensor q, Tensor k, Tensor v, Tensor layer) -> Tensor", _attend, _attend_shape)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """Attention of one sequence's queries q [n, Hq, D] (positions q_start..q_start+n-1) over its
    keys/values k, v [L, Hkv, D] (positions 0..L-1). Softmax in float32; matmuls in the input dtype.
    With a sliding `window`, the query at p sees only keys p - window < j <= p (Mistral's rule).

    A plain matmul-softmax-matmul: on CPU it is faster than torch's bf16 SDPA.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    # [Hkv, group*n, D] so one batched matmul per KV head serves its whole query group.
    qg = q.reshape(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
    kt = k.permute(1, 2, 0)  # [Hkv, D, L]
    scores = torch.matmul(qg, kt).float() * scale  # [Hkv, group*n, L]
    length = k.shape[0]
    if n > 1 or q_start + n < length or (window is not None and length > window):
        q_pos = torch.arange(q_start, q_start + n, device=q.device).repeat(group)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        mask = k_pos > q_pos
        if window is not None:
            mask |= k_pos <= q_pos - window
        scores.masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.permute(1, 0, 2))  # [Hkv, group*n, D]
    return out.reshape(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


class WholeSequence:
    """The backend of one forward pass over a whole sequence with no cache: each layer attends over this
    pass's own keys (a calibration pass at load time needs nothing more)."""

    def __init__(self, scale: float, window: int | None = None):
        self.scale, self.window = scale, window

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, 0, self.scale, self.window)
