"""oneDNN's int8 GEMM on a weight reordered once into its own blocked layout, for W8A8 on CPU.

`torch._int_mm` hands oneDNN a plain [K, N] int8 weight, which oneDNN reorders into the layout its kernels
read on every call. `onednn::qlinear_prepack` does that once at load, and `onednn::qlinear_pointwise` then
multiplies int8 activations by it and applies the per-channel weight scales in the same pass: float32
sums x weight scale, bit for bit what `torch._int_mm`'s int32 sums give once converted and scaled (the
sums are exact integers either way). Whether it is faster depends on the CPU (with AMX it ran a SmolLM2
step's products ~1.5x faster; on an AVX-512 VNNI Xeon slower), so the model measures both at load
(`pipeline.model.w8a8_gemm`).

The activations go in as uint8 with zero point 128 (q + 128; oneDNN subtracts 128 x the weight's column
sums), the input its u8 x s8 kernels take natively. CPUs without VNNI multiply u8 x s8 pairs with
`vpmaddubsw`, which sums two products in int16 and saturates: full-range weights came out wrong by up to
~20% of the sum on an AVX2 Zen 3. With |weight| <= 63 a pair stays within int16 (2 x 255 x 63 = 32,130), so
`weight_bound` measures which range this CPU's kernel multiplies exactly and W8A8 weights are quantized to
it (SmolLM2's W8A8 perplexity over float32 read +1.49% with 8-bit weights, +1.58-3.01% with 7-bit ones,
1,024 held-out tokens, by how the weights were rounded on the way). On that Zen 3 the packed u8 GEMM ran
at ~125-320 GOP/s, `torch._int_mm` (a reference kernel there) at ~3-4, and float32 `F.linear` at ~60-167
GFLOP/s.

The packed weight is an opaque oneDNN tensor that `torch.compile` cannot take as a graph input. Modules
hold a 0-d int64 handle instead, and the `pipeline::int8_packed_products` operator looks the weight up by
it: every decoder layer keeps sharing one compiled graph, the handle being an input like the weights. The
native VNNI GEMM (`kernels.vnni_gemm`), which takes and gives the same, packs its weights behind the
same handles (`pack_native_int8_weight`), so the rest of the model does not know which GEMM runs.
"""

from __future__ import annotations

import functools
import itertools
import weakref

import torch

from kernels.ops import define_op
from kernels.vnni_gemm import NativeInt8Weight


class OneDNNWeight:
    """An int8 weight [N, K] packed by oneDNN (`onednn::qlinear_prepack`)."""

    name = "oneDNN packed"

    def __init__(self, qweight: torch.Tensor):
        self.packed = torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None)
        self.zero_points = torch.zeros(qweight.shape[0], dtype=torch.long)

    def products(self, u: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
        """uint8 activations u [M, K] (`uint8_activations`) times the weight: float32 sums x wscale [N]."""
        return _run_packed(u, wscale, self.packed, self.zero_points)


# handle -> (packed weight: a OneDNNWeight or a `kernels.vnni_gemm.NativeInt8Weight`, int8 weight bytes); an
# entry lives as long as the module that packed it
_packed: dict[int, tuple[OneDNNWeight | NativeInt8Weight, int]] = {}
_handles = itertools.count()


FULL_RANGE = 127
PAIR_SAFE_RANGE = 63  # the largest |weight| whose u8 x s8 pair sums fit int16: 2 x 255 x 63 <= 32,767


@functools.cache
def weight_bound() -> int:
    """The largest |int8 weight| this CPU's packed GEMM multiplies exactly: FULL_RANGE, or PAIR_SAFE_RANGE
    where it saturates pair sums in int16 (no VNNI). Measured once on the worst case, every activation 255
    and every weight at the bound. Raises RuntimeError where neither is exact or there is no such kernel."""
    m, k, n = 4, 64, 16
    q = torch.full((m, k), FULL_RANGE, dtype=torch.int8)
    for bound in (FULL_RANGE, PAIR_SAFE_RANGE):
        packed = torch.ops.onednn.qlinear_prepack(torch.full((n, k), bound, dtype=torch.int8), None)
        sums = _run_packed(uint8_activations(q), torch.ones(n), packed, torch.zeros(n, dtype=torch.long))
        if torch.equal(sums, torch.full((m, n), float(FULL_RANGE * bound * k))):
            return bound
    raise RuntimeError("oneDNN's packed int8 GEMM is not exact on this CPU even with 7-bit weights")


def pack_int8_weight(owner: object, qweight: torch.Tensor) -> torch.Tensor:
    """Reorder qweight int8 [N, K] for oneDNN and return its handle (a 0-d int64 tensor); the packed copy
    is freed with `owner`. Raises RuntimeError where this oneDNN build has no such kernel, or where the
    weight exceeds `weight_bound` (the kernel would saturate)."""
    if qweight.device.type != "cpu" or qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise RuntimeError(f"oneDNN int8 packing takes a CPU int8 [N, K] weight, got {qweight.dtype} "
                           f"{tuple(qweight.shape)} on {qweight.device}")
    bound = weight_bound()
    low, high = torch.aminmax(qweight) if qweight.numel() else (0, 0)  # one pass over the weight
    if max(-int(low), int(high)) > bound:
        raise RuntimeError(f"this CPU's packed int8 GEMM is exact for |weight| <= {bound} only (int16 pair "
                           "sums, no VNNI): quantize the weight to that bound")
    return _register(owner, OneDNNWeight(qweight), qweight.numel())


def pack_native_int8_weight(owner: object, qweight: torch.Tensor) -> torch.Tensor:
    """Pack qweight int8 [N, K] for the native GEMM (`kernels.vnni_gemm`) and return its handle, as
    `pack_int8_weight` does for oneDNN's. Raises RuntimeError where that kernel cannot run."""
    return _register(owner, NativeInt8Weight(qweight), qweight.numel())


def _register(owner: object, weight: OneDNNWeight | NativeInt8Weight, nbytes: int) -> torch.Tensor:
    """A handle (a 0-d int64 tensor) for a packed weight, which is freed with `owner`."""
    key = next(_handles)
    _packed[key] = (weight, nbytes)
    weakref.finalize(owner, _packed.pop, key, None)
    return torch.tensor(key, dtype=torch.long)


def packed_gemm_name(handle: torch.Tensor) -> str:
    """Which GEMM a packed weight's handle runs on (its class's `name`)."""
    return packed_weight(handle).name


def packed_weight(handle: torch.Tensor) -> OneDNNWeight | NativeInt8Weight:
    """The packed weight behind a handle (alive as long as the handle's owner)."""
    return _packed[int(handle)][0]


def release_packed(handle: torch.Tensor) -> None:
    """Free a packed weight before its owner goes (one measured and not kept)."""
    _packed.pop(int(handle), None)


def packed_bytes(handle: torch.Tensor) -> int:
    """The int8 weight bytes a handle stands for (oneDNN's blocked copy holds as many, plus padding)."""
    return _packed[int(handle)][1]


def uint8_activations(q: torch.Tensor) -> torch.Tensor:
    """Activations as the packed GEMM takes them: uint8 q + 128 (zero point 128). uint8 ones (from
    `quantize_rows(x, zero_point=128)`, what steps pass) as they are; int8 ones with their sign bit flipped,
    a pass of its own (~40-70 us a call at 256 rows of SmolLM2 on an AVX2 Zen 3, the fresh buffer read back
    cold), which is why steps round straight to uint8."""
    return q if q.dtype == torch.uint8 else q.view(torch.uint8).bitwise_xor(128)


def _run_packed(u: torch.Tensor, wscale: torch.Tensor, packed: torch.Tensor, zero_points: torch.Tensor) -> torch.Tensor:
    """uint8 activations u (`uint8_activations`) times a packed weight: float32 sums x wscale [N]."""
    return torch.ops.onednn.qlinear_pointwise(u.contiguous(), 1.0, 128, packed, wscale.float().contiguous(),
                                              zero_points, None, 1.0, 0, torch.float32, "none", [], "")


def _packed_products(u: torch.Tensor, wscale: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    if u.shape[0] == 0:
        return u.new_empty((0, wscale.shape[0]), dtype=torch.float32)
    return _packed[int(handle)][0].products(u, wscale)


def _products_shape(u: torch.Tensor, wscale: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return u.new_empty((u.shape[0], wscale.shape[0]), dtype=torch.float32)


# uint8 activations u [M, K] (`uint8_activations`) times the packed weight of `handle` (int8 [N, K]):
# float32 [M, N], each int32 sum times its column's scale wscale [N].
_uint8_products = define_op("int8_packed_products", "(Tensor u, Tensor wscale, Tensor handle) -> Tensor",
                            _packed_products, _products_shape)


def packed_int8_products(q: torch.Tensor, wscale: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    """q int8 [M, K] (or uint8 q + 128, `uint8_activations`) times the packed weight of `handle` (int8
    [N, K]): float32 [M, N], each int32 sum times its column's scale wscale [N]."""
    return _uint8_products(uint8_activations(q), wscale, handle)
