"""oneDNN's int8 GEMM on a weight reordered once into its own blocked layout, for W8A8 on CPU.

`torch._int_mm` hands oneDNN a plain [K, N] int8 weight, which oneDNN reorders into the layout its kernels
read on every call. `onednn::qlinear_prepack` does that once at load, and `onednn::qlinear_pointwise` then
multiplies int8 activations by it and applies the per-channel weight scales in the same pass: float32
sums x weight scale, bit for bit what `torch._int_mm`'s int32 sums give once converted and scaled (the
sums are exact integers either way). Whether it is faster depends on the CPU (with AMX it ran a SmolLM2
step's products ~1.5x faster; on an AVX-512 VNNI Xeon slower), so the model measures both at load
(`pipeline.model.int8_gemm`).

The packed weight is an opaque oneDNN tensor that `torch.compile` cannot take as a graph input. Modules
hold a 0-d int64 handle instead, and the `pipeline::int8_packed_products` operator looks the weight up by
it: every decoder layer keeps sharing one compiled graph, the handle being an input like the weights.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from kernels.ops import define_op

# handle -> (packed weight, zero points [N], int8 weight bytes); an entry lives as long as the module that
# packed it
_packed: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
_handles = itertools.count()


def pack_int8_weight(owner: object, qweight: torch.Tensor) -> torch.Tensor:
    """Reorder qweight int8 [N, K] for oneDNN and return its handle (a 0-d int64 tensor); the packed copy
    is freed with `owner`. Raises RuntimeError where this oneDNN build has no such kernel."""
    if qweight.device.type != "cpu" or qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise RuntimeError(f"oneDNN int8 packing takes a CPU int8 [N, K] weight, got {qweight.dtype} "
                           f"{tuple(qweight.shape)} on {qweight.device}")
    packed = torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None)
    key = next(_handles)
    _packed[key] = (packed, torch.zeros(qweight.shape[0], dtype=torch.long), qweight.numel())
    weakref.finalize(owner, _packed.pop, key, None)
    return torch.tensor(key, dtype=torch.long)


def release_packed(handle: torch.Tensor) -> None:
    """Free a packed weight before its owner goes (one measured and not kept)."""
    _packed.pop(int(handle), None)


def packed_bytes(handle: torch.Tensor) -> int:
    """The int8 weight bytes a handle stands for (oneDNN's blocked copy holds as many, plus padding)."""
    return _packed[int(handle)][2]


def _packed_products(q: torch.Tensor, wscale: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    packed, zero_points, _ = _packed[int(handle)]
    if q.shape[0] == 0:
        return q.new_empty((0, wscale.shape[0]), dtype=torch.float32)
    return torch.ops.onednn.qlinear_pointwise(q.contiguous(), 1.0, 0, packed, wscale.float().contiguous(),
                                              zero_points, None, 1.0, 0, torch.float32, "none", [], "")


def _products_shape(q: torch.Tensor, wscale: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return q.new_empty((q.shape[0], wscale.shape[0]), dtype=torch.float32)


# q int8 [M, K] times the packed weight of `handle` (int8 [N, K]): float32 [M, N], each int32 sum times its
# column's scale wscale [N].
packed_int8_products = define_op("int8_packed_products", "(Tensor q, Tensor wscale, Tensor handle) -> Tensor",
                                 _packed_products, _products_shape)
