"""The shared weight-only storage format and its plain-torch reference (the ground truth for all kernels).

A weight W [N, K] (out_features x in_features) is stored as
- int4: `qweight` uint8 [N, K/2], byte j of a row holds k = 2j in its low nibble and k = 2j+1 in its high
  nibble; `scales` and `mins` [N, K/G]; w = q * scale + min with q in 0..15 (asymmetric; GGUF Q4_1 as is,
  Q4_0 with min = -8 * scale).
- int8: `qweight` int8 [N, K]; `scales` [N, K/G]; w = q * scale (symmetric; G = K is per output channel).
Scales and mins may be any float dtype; dequantization computes in float32 as `float(q) * scale + min`
(a multiply, then an add: the same operations, in the same order, as the `gguf` package).
"""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> uint8 [N, K/2] (even k in the low nibble)."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] with values 0..15 (inverse of `pack_int4`)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def group_size_of(k: int, scales: torch.Tensor) -> int:
    """Group size implied by K and the number of scale columns."""
    groups = scales.shape[-1]
    if groups == 0 or k % groups:
        raise ValueError(f"{groups} scale groups do not divide K={k}")
    return k // groups


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """float32 [N, K] weights from the stored format (see the module docstring)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    q = unpack_int4(qweight) if bits == 4 else qweight
    g = group_size_of(q.shape[-1], scales)
    w = q.float().unflatten(-1, (-1, g)).mul_(scales.float().unsqueeze(-1))  # in place: one float32 pass each
    if mins is not None:
        w.add_(mins.float().unsqueeze(-1))
    return w.flatten(-2)


def wq_matmul_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """y = x W^T computed in float32 from the dequantized weight, returned in x's dtype."""
    return (x.float() @ dequantize(qweight, scales, mins, bits).T).to(x.dtype)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 per group of `group_size` inputs -> (qweight, scales, mins) fp16.

    Scale and min are rounded to float16 first and q is computed against the rounded values, so the
    stored triple reproduces w within half a step of the stored scale.
    """
    n, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"in_features {k} is not a multiple of the (even) group size {group_size}")
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // group_size, dtype=torch.float16, device=w.device)
    mins = torch.empty_like(scales)
    for rows in _row_slices(w):
        wg = w[rows].float().reshape(-1, k // group_size, group_size)
        lo, hi = wg.amin(-1), wg.amax(-1)  # torch.aminmax over a short last dimension ran ~5x slower
        scales[rows] = (hi - lo) / 15
        mins[rows] = lo
        s = scales[rows].float().unsqueeze(-1)
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = (wg - mins[rows].float().unsqueeze(-1)).div_(safe).round_().clamp_(0, 15)
        packed[rows] = pack_int4(q.reshape(-1, k))
    return packed, scales, mins


def quantize_int8(w: torch.Tensor, group_size: int | None = None, bound: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 (q in -bound..bound, bound <= 127) per group (None: per output
    channel) -> (q, scales). A smaller bound serves int8 kernels that cannot take the full range exactly.

    Scales are float32 per channel (N of them: negligible bytes) and float16 for smaller groups.
    """
    if not 1 <= bound <= 127:
        raise ValueError(f"int8 bound must be in 1..127, got {bound}")
    n, k = w.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"in_features {k} is not a multiple of the group size {g}")
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scales = torch.empty(n, k // g, dtype=torch.float32 if g == k else torch.float16, device=w.device)
    for rows in _row_slices(w):
        wg = w[rows].float().reshape(-1, k // g, g)
        scales[rows] = wg.abs().amax(-1) / bound
        s = scales[rows].float().unsqueeze(-1)
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q[rows] = (wg / safe).round_().clamp_(-bound, bound).reshape(-1, k)
    return q, scales


SLICE_ELEMENTS = 1 << 17  # 512 KiB of float32 per slice: the passes over it stay in the core's L2


def _row_slices(w: torch.Tensor) -> list[slice]:
    """Row ranges of about SLICE_ELEMENTS elements each. The quantizers make several elementwise passes;
    run slice by slice, every pass after the first reads from cache, not DRAM (on a 2048 x 8192 weight
    int8 rounding ran ~6x and int4 ~1.5x faster than whole-tensor passes, with the same results)."""
    n = w.shape[0]
    step = max(1, SLICE_ELEMENTS // max(1, w[0].numel() if n else 1))
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]
