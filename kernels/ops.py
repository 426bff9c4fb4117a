"""Operators that `torch.compile` calls as they are, without tracing into them, registered the cheap way.

An operator gives compiled graphs an opaque call with a known output shape (its fake implementation), so
Python bookkeeping or an opaque tensor behind it does not break the graph. Registered with
`torch.library.Library`, a call from eager code costs ~1.5-3 us on CPU; the same operators made with
`torch.library.custom_op` cost 6-8 us (its runtime aliasing checks), and up to ~68 us called as the
decorated function (measured on 2 cores), which a decode step calling one per layer and linear feels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_library = torch.library.Library("pipeline", "DEF")


def define_op(name: str, schema: str, impl: Callable, fake: Callable) -> Callable:
    """Register `pipeline::<name><schema>` (e.g. "(Tensor x) -> Tensor": a functional operator, its outputs
    new tensors) with `impl` for every device and `fake` for shapes under compilation; returns the
    operator's overload, the callable to use."""
    _library.define(f"{name}{schema}")
    _library.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pipeline::{name}", fake, lib=_library)
    return getattr(torch.ops.pipeline, name).default
