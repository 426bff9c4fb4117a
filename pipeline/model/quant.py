"""Weight-only quantized linears (int8, int4, GGUF blocks) swapped in for the model's ParallelLinear.

Schemes (`model.quant`):
- int8: symmetric, one scale per output channel, round-to-nearest from float weights (W8A16).
- int4: asymmetric, one (scale, min) per group of `group_size` inputs, round-to-nearest (W4A16).
- gguf: the checkpoint's own Q4_0 / Q4_1 / Q8_0 blocks, rearranged but never re-quantized; dequantized
  they equal `gguf.quants.dequantize` bit for bit.
- w8a8: int8 weights per output channel (from float weights, or GGUF blocks dequantized then requantized)
  times int8 activations per token, int32 sums (`kernels.w8a8_reference`): int8 arithmetic, for the
  compute-bound large batches.
- fp8: FP8 W8A8 on CUDA GPUs with FP8 tensor cores (`pipeline.model.fp8_linear`).
Weight-only schemes can also switch per call: `attach_w8a8` gives each linear a second, int8 per-channel
layout used for calls with at least `KernelChoice.w8a8_rows` rows (large batches, where dequantizing per
call or bfloat16 emulation would be slower than float32). Under model.quant=auto on CPU, int4 linears also
keep a copy for the native W4A8 GEMM (`kernels.cpu_w4a8`), which weight-only calls of fewer than
`KernelChoice.w4a8_below` rows run (small steps, where it reads the weights faster than torch's kernel).
Embeddings stay in the model dtype; the LM head too, except in W8A8 calls (`QuantLMHead`: an int8 or
bfloat16 copy).

Tensor parallelism: each rank keeps exactly its slice of the TP=1 quantized weight. Column-parallel ranks
quantize their own rows; row-parallel ranks quantize whole rows and slice the inputs, so a rank's inputs
must be whole groups (int4, gguf), otherwise construction fails with an error naming the layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_decode_layers, cpu_w4a8
from kernels.argmax import ARGMAX_CHUNK, argmax_by_chunks, chunk_maxima
from kernels.cpu_quantize import dequantize, quantize_int4, quantize_int8
from kernels.dispatch import (
    as_products,
    int8_outputs,
    packed_matmul,
    quantize_for_gemm,
    w8a8_matmul,
    w8a8_weight_bound,
    wq_matmul,
)
from kernels.packed_int8 import FULL_RANGE, packed_bytes, packed_weight
from kernels.vnni_gemm import NativeInt8Weight
from kernels.wq_cpu import (
    CPU_ACTIVATION_DTYPE,
    CpuPacked,
    cpu_supports,
    pack_for_cpu,
    weight_only_kernels_fast,
)
from kernels.wq_reference import group_size_of, pack_int4
from pipeline.model.calibration import LinearInput, calibrate
from pipeline.model.config import QUANT_GROUP_SIZES, QUANT_SCHEMES
from pipeline.model.fp8_linear import Fp8Linear
from pipeline.model.gptq import gptq_int8
from pipeline.model.layers import LMHead, ParallelLinear, compiled_copy

GGUF_BLOCK = 32


@dataclass
class KernelChoice:
    """Which matmul a model step runs, by its number of rows (tokens), shared by all quantized linears of
    a model; `steps` counts the forward passes per kernel (reported in _metrics.json)."""

    weight_only: str  # the weight-only kernel's name, e.g. "gguf"; "" when every call is W8A8
    w8a8_rows: int | None  # calls with at least this many rows run W8A8; None: never
    steps: Counter = field(default_factory=Counter)
    int8_gemm: dict[str, str] = field(default_factory=dict)  # CPU: the int8 GEMM per part (`pipeline.model.w8a8_gemm`)
    weight_bound: int | None = None  # the W8A8 weights' largest |int8| (`kernels.dispatch.w8a8_weight_bound`)
    native_layer_steps: int = 0  # steps whose layers ran in one native call (`pipeline.model.native_decode`)
    # the LM head's own switch to its compact copy (`QuantLMHead`); None: with the linears, at `w8a8_rows`
    head_rows: int | None = None
    # weight-only calls of fewer rows run the native W4A8 GEMM where a linear has its layout; None: never
    w4a8_below: int | None = None

    def uses_w8a8(self, rows: int) -> bool:
        """quant=w8a8 (no weight-only kernel) at any row count, even none; else from `w8a8_rows` rows."""
        return self.w8a8_rows is not None and (rows >= self.w8a8_rows or not self.weight_only)

    def uses_w4a8(self, rows: int) -> bool:
        """Whether a weight-only call of `rows` rows runs the native W4A8 GEMM (where the linear has it)."""
        return self.w4a8_below is not None and rows < self.w4a8_below and not self.uses_w8a8(rows)

    def head_uses_compact(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the LM head's compact copy rather than its float weight."""
        return rows >= self.head_rows if self.head_rows is not None else self.uses_w8a8(rows)

    def reads_torch_int4(self) -> bool:
        """Whether a weight-only call of some row count runs torch's int4 kernel: not where every call runs
        W8A8, nor where the W4A8 GEMM runs every weight-only call (below the switch)."""
        if not self.weight_only or self.w8a8_rows == 1:
            return False
        return self.w4a8_below is None or self.w8a8_rows is None or self.w4a8_below < self.w8a8_rows

    def record(self, rows: int) -> None:
        self.steps["w8a8" if self.uses_w8a8(rows) else "w4a8" if self.uses_w4a8(rows) else self.weight_only] += 1

    def clear(self) -> None:
        """Forget the steps counted so far (a measuring run's, before the job's own)."""
        self.steps.clear()
        self.native_layer_steps = 0


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized weight [N, K] in the kernels' format (`kernels.wq_reference`); `narrow` shards it
    like a tensor so `ParallelLinear.shard_of` works unchanged."""

    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        n, cols = self.qweight.shape
        return n, cols * (2 if self.bits == 4 else 1)

    @property
    def group_size(self) -> int:
        return group_size_of(self.shape[1], self.scales)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        if dim == 0:
            return QuantizedTensor(
                self.bits,
                self.qweight.narrow(0, start, length),
                self.scales.narrow(0, start, length),
                None if self.mins is None else self.mins.narrow(0, start, length),
            )
        g, k = self.group_size, self.shape[1]
        per_byte = 2 if self.bits == 4 else 1
        if start % per_byte or length % per_byte:
            raise ValueError(f"int4 shard of inputs [{start}, {start + length}) splits a packed byte")
        q = self.qweight.narrow(1, start // per_byte, length // per_byte)
        if g == k:  # one group per row: any slice of inputs keeps the row's scale (and min)
            return QuantizedTensor(self.bits, q, self.scales, self.mins)
        if start % g or length % g:
            raise ValueError(
                f"tensor-parallel shard of inputs [{start}, {start + length}) does not fall on the "
                f"quantization group boundaries (group size {g}); use a group size dividing {length}"
            )
        groups = (start // g, length // g)
        mins = None if self.mins is None else self.mins.narrow(1, *groups)
        return QuantizedTensor(self.bits, q, self.scales.narrow(1, *groups), mins)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.mins, self.bits)


def quantize_tensor(w: torch.Tensor, scheme: str, group_size: int) -> QuantizedTensor:
    """Round-to-nearest quantization of a float weight [N, K] (int8: per channel; int4: per group)."""
    if scheme in ("int8", "w8a8"):
        q, s = quantize_int8(w)
        return QuantizedTensor(8, q, s, None)
    if scheme == "int4":
        q, s, m = quantize_int4(w, group_size)
        return QuantizedTensor(4, q, s, m)
    raise ValueError(f"cannot quantize float weights with scheme {scheme!r} (int8, int4 or w8a8)")


def from_gguf_blocks(blocks: np.ndarray, qtype, shape: tuple[int, ...], name: str = "tensor") -> QuantizedTensor:
    """GGUF Q4_0 / Q4_1 / Q8_0 blocks [N, bytes per row] -> QuantizedTensor (group 32), no re-quantizing.

    Q4_1 block: fp16 d, fp16 m, 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31
    (w = d q + m). Q4_0: fp16 d, 16 such bytes (w = d (q - 8), stored as min = -8 d: exact in fp16 and
    in the float32 arithmetic). Q8_0: fp16 d, 32 int8 (w = d q).
    """
    from gguf import GGMLQuantizationType as T

    n, k = shape
    if qtype not in (T.Q4_0, T.Q4_1, T.Q8_0) or k % GGUF_BLOCK:
        raise ValueError(
            f"{name}: GGUF type {getattr(qtype, 'name', qtype)} with shape {shape} cannot be used as is "
            "(supported: Q4_0, Q4_1, Q8_0); load with quant=int8, int4 or none instead"
        )
    # np.array copies: the file's memory map is read-only.
    raw = torch.from_numpy(np.array(blocks)).view(n, k // GGUF_BLOCK, -1)
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if qtype == T.Q8_0:
        q = raw[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return QuantizedTensor(8, q, d.clone(), None)
    body = raw[..., 4:] if qtype == T.Q4_1 else raw[..., 2:]
    q = torch.cat((body & 0xF, body >> 4), dim=-1).reshape(n, k)  # weights 0..15 then 16..31 per block
    mins = raw[..., 2:4].contiguous().view(torch.float16)[..., 0].clone() if qtype == T.Q4_1 else d * -8
    return QuantizedTensor(4, pack_int4(q), d.clone(), mins)


class QuantLinear(ParallelLinear):
    """A ParallelLinear whose weight is stored quantized; sharding, fusion and bias are inherited.

    Buffers `qweight`, `scales`, `mins` hold this rank's rows in the kernels' format and are allocated by
    the first part loaded (so GGUF blocks decide bits and group). `pack_for_cpu()` converts them once for
    torch's CPU kernels (bfloat16 activations), and for the native W4A8 GEMM where asked, and frees the
    original layout.
    """

    def __init__(self, linear: ParallelLinear, scheme: str, group_size: int):
        device = linear.weight.device
        with torch.device(device):
            super().__init__(*linear.init_args())
        del self.weight
        self.device = device
        if scheme not in QUANT_SCHEMES[1:]:
            raise ValueError(f"quant scheme {scheme!r} is not one of {QUANT_SCHEMES[1:]}")
        group = GGUF_BLOCK if scheme == "gguf" else group_size
        if scheme in ("int4", "gguf") and self.in_features % group:
            raise ValueError(
                f"{self.in_features} input features per rank (tensor_parallel={self.tp.size}) are not a "
                f"multiple of the quantization group size {group}"
            )
        self.scheme = scheme
        self.group_size = group_size
        self.bits = 0
        for buffer in ("qweight", "scales", "mins", "packed_weight", "packed_scales", "w8a8_weight", "w8a8_scales",
                       "w8a8_smooth", "w8a8_packed", "w4a8_packed"):
            self.register_buffer(buffer, None)
        self.packed_group = 0
        self.rows_loaded = 0
        self.choice: KernelChoice | None = None  # set by `attach_w8a8`

    def _allocate(self, part: QuantizedTensor) -> None:
        rows, dev = self.out_features, self.device
        self.bits = part.bits
        self.register_buffer("qweight", part.qweight.new_empty(rows, part.qweight.shape[1], device=dev))
        self.register_buffer("scales", part.scales.new_empty(rows, part.scales.shape[1], device=dev))
        if part.mins is not None:
            self.register_buffer("mins", part.mins.new_empty(rows, part.mins.shape[1], device=dev))

    def load(self, full, shard_id: int = 0, is_bias: bool = False) -> None:
        """Load part `shard_id` from a full float tensor (quantized here) or a QuantizedTensor (GGUF)."""
        if is_bias:
            super().load(full, shard_id, is_bias)
            return
        if isinstance(full, torch.Tensor) and self.shard_dim == 1 and self.tp.size > 1:
            # Row-parallel: quantize whole rows, then shard, so per-row int8 scales match one rank's exactly.
            part = self.shard_of(quantize_tensor(full, self.scheme, self.group_size), shard_id)
        elif isinstance(full, torch.Tensor):
            part = quantize_tensor(self.shard_of(full, shard_id), self.scheme, self.group_size)
        elif self.scheme != "gguf":
            raise TypeError(f"quant={self.scheme} quantizes float weights itself; got pre-quantized blocks")
        else:
            part = self.shard_of(full, shard_id)
        if self.qweight is None:
            self._allocate(part)
        same = (
            part.bits == self.bits
            and part.scales.shape[1] == self.scales.shape[1]
            and part.scales.dtype == self.scales.dtype
            and (part.mins is None) == (self.mins is None)
        )
        if not same:
            raise ValueError("fused parts of one linear (e.g. q, k, v) must share one quantization format")
        start, n = self.local_rows(shard_id)
        self.qweight.narrow(0, start, n).copy_(part.qweight)
        self.scales.narrow(0, start, n).copy_(part.scales)
        if part.mins is not None:
            self.mins.narrow(0, start, n).copy_(part.mins)
        self.rows_loaded += n

    def quantize_from(self, weight: torch.Tensor) -> None:
        """Quantize this rank's already-loaded float weight [out_features, in_features] as a whole."""
        part = quantize_tensor(weight, self.scheme, self.group_size)
        self._allocate(part)
        self.qweight.copy_(part.qweight)
        self.scales.copy_(part.scales)
        if part.mins is not None:
            self.mins.copy_(part.mins)
        self.rows_loaded = self.out_features

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out_features, in_features] of this rank (bit-exact: what the reference path uses), written
        into `out` where given (`kernels.cpu_quantize.dequantize`)."""
        if self.qweight is None:
            raise RuntimeError("dequantize() needs the original layout (weights not loaded, or packed for CPU)")
        return dequantize(self.qweight, self.scales, self.mins, self.bits, out)

    def pack_for_cpu(self, w4a8: bool = False) -> bool:
        """Convert to torch's CPU kernel layout (scales rounded to bfloat16) if one exists; True if done.
        With `w4a8`, an int4 weight the native W4A8 GEMM takes is packed for it (`kernels.cpu_w4a8`) instead,
        where that layout holds it exactly (float16 scales and mins): torch's is made from it only where a
        call reads it (`pack_torch_int4`), as under auto the W4A8 GEMM mostly runs every weight-only call
        (building torch's for a 1B model, storing and reading it took ~3 s of a first start)."""
        if self.qweight is None or not cpu_supports(self.qweight, self.scales, self.mins, self.bits):
            return False
        if w4a8 and self.bits == 4 and cpu_w4a8.weight_reason(self.qweight, self.scales, self.mins) is None:
            self.w4a8_packed = cpu_w4a8.pack_w4a8(self.qweight, self.scales, self.mins)
            if self.scales.dtype == self.mins.dtype == torch.float16:
                self.qweight = self.scales = self.mins = None
                return True
        packed = pack_for_cpu(self.qweight, self.scales, self.mins, self.bits)
        self.qweight = self.scales = self.mins = None
        self.packed_weight, self.packed_scales = packed.weight, packed.scales
        self.packed_group = packed.group_size
        return True

    def pack_torch_int4(self) -> None:
        """Make torch's int4 layout from the W4A8 one where `pack_for_cpu` left it out: the same layout as
        from the original weight (`cpu_w4a8.unpack_w4a8` gives it back exactly)."""
        if self.packed_weight is None and self.w4a8_packed is not None:
            packed = pack_for_cpu(*cpu_w4a8.unpack_w4a8(self.w4a8_packed, self.out_features), 4)
            self.packed_weight, self.packed_scales = packed.weight, packed.scales
            self.packed_group = packed.group_size

    @property
    def cpu_packed(self) -> CpuPacked | None:
        """The weight in torch's CPU kernel layout (built from the buffers, so `.to()` keeps it valid)."""
        if self.packed_weight is None:
            return None
        return CpuPacked(self.bits, self.packed_weight, self.packed_scales, self.packed_group)

    def attach_w8a8(self, choice: KernelChoice, seen: LinearInput | None = None) -> None:
        """Add the int8 per-channel layout W8A8 calls use: with what calibration fed this linear (`seen`;
        its float32 weight, if any, is consumed: scaled in place), smoothed (`smoothing_factors`) and
        rounded, against the smoothed inputs (`gptq_int8`) where `seen` has their Gram matrix, else to
        nearest; without, the weight itself when it already is one, else rounded to nearest. quant=w8a8 has
        no other calls, so there a calibrated layout replaces the original."""
        if self.qweight is None:
            raise RuntimeError("attach_w8a8 needs the loaded weights in their original layout")
        bound = w8a8_weight_bound(self.qweight.device)
        if seen is not None:
            weight = self.dequantize() if seen.weight is None else seen.weight
            smooth = smoothing_factors(seen.absmax.to(weight.device), weight)
            # the float32 copy is this call's own: smoothed in place, not into a new one (a fresh 1B model's
            # worth of float32 pages to fault in: 63 ms against 8 for a 16384 x 2048 weight on 2 cores)
            smoothed = weight.mul_(smooth)
            if seen.gram is None:
                self.w8a8_weight, self.w8a8_scales = quantize_int8(smoothed, bound=bound)
            else:  # the smoothed layer's inputs are x / smooth: their Gram matrix is H / (smooth smooth^T)
                gram = seen.gram.to(weight.device) / torch.outer(smooth, smooth)
                self.w8a8_weight, self.w8a8_scales = gptq_int8(smoothed, gram, bound)
            self.w8a8_smooth = 1.0 / smooth
            if self.scheme == "w8a8":
                self.qweight = self.scales = None
        elif (self.bits == 8 and self.scales.shape[1] == 1 and self.scales.dtype == torch.float32
              and bound == FULL_RANGE):
            self.w8a8_weight, self.w8a8_scales = self.qweight, self.scales
        else:
            self.w8a8_weight, self.w8a8_scales = quantize_int8(self.dequantize(), bound=bound)
        self.choice = choice

    @property
    def int8_layout(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The W8A8 weight as W8A8 calls read it: int8 [N, K] (None once packed), scales [N, 1] and the
        oneDNN handle (`kernels.packed_int8`; None while unpacked)."""
        return self.w8a8_weight, self.w8a8_scales, self.w8a8_packed

    def use_packed_int8(self, handle: torch.Tensor) -> None:
        """Run W8A8 calls on the oneDNN-packed copy `handle` and drop the plain int8 weight."""
        self.w8a8_packed, self.w8a8_weight = handle, None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = self.cpu_packed
        if self.choice is not None and self.choice.uses_w8a8(x.shape[0]):
            smoothed = x if self.w8a8_smooth is None else x * self.w8a8_smooth
            y = w8a8_matmul(smoothed, self.w8a8_weight, self.w8a8_scales, self.w8a8_packed)
        elif self.w4a8_packed is not None and self.choice is not None and self.choice.uses_w4a8(x.shape[0]):
            y = cpu_w4a8.w4a8_matmul(x, self.w4a8_packed, self.out_features)
        elif packed is not None:
            y = packed_matmul(x, packed)
        elif self.qweight is None:
            raise RuntimeError("QuantLinear used before its weights were loaded")
        else:
            y = wq_matmul(x, self.qweight, self.scales, self.mins, self.bits)
        return y if bias is None else y + bias


LM_HEAD_MODES = ("int8", "bf16", "none")

# The LM head's int8 activations: the final hidden state has a few outlier channels (max |h| 56 on SmolLM2,
# against a median channel max of 3.3) that would set every token's int8 step. Measured once at load
# (`pipeline.model.calibration`), they are first smoothed (as the linears' inputs, with a milder
# HEAD_SMOOTHING_ALPHA), then the OUTLIER_CHANNELS largest are split over several int8 columns each (x/r in
# r columns, the weight column repeated), so the step follows the ordinary channels. SmolLM2's head alone
# over ~4,200 tokens of text, against float32: plain int8 +1.80% perplexity (91.9% of argmaxes agree);
# 32 channels split, no smoothing, 59 more columns: +0.36% (96.3%); smoothed, 8 split, 8 more columns:
# -0.02% (96.1%), 8% fewer multiply-adds in the head.
OUTLIER_CHANNELS = 8
HEAD_SMOOTHING_ALPHA = 0.3
MAX_COPIES = 16  # bounds the added columns

# SmoothQuant's migration strength: s_j = max|x_j|^a / max|W_j|^(1-a). 0.5 took SmolLM2's W8A8 perplexity
# from +3.0% to +0.7-1.7% over float32 (depending on the calibration text); 0.7 was no better.
SMOOTHING_ALPHA = 0.5


def smoothing_factors(input_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """Per input channel s [K] for a linear of weight [N, K] whose inputs reached `input_absmax` [K]: the
    W8A8 layout multiplies weight column j by s_j and divides input channel j by it, the same product with
    the activations' range moved into the weights (which are quantized per output channel)."""
    a = input_absmax.float().clamp_min(1e-5)
    w = column_absmax(weight).float().clamp_min(1e-5)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp_min(1e-5)


def column_absmax(weight: torch.Tensor, block: int = 32) -> torch.Tensor:
    """max |w| per input channel [K] of a weight [N, K], with no |w| copy, reduced within blocks of `block`
    rows first: torch reduces a tall matrix's columns in one pass at half the speed (a 1B model's weights
    and head: 1.7 s of CPU in a first start against 0.8 s)."""
    n, k = weight.shape
    blocks = weight.reshape(n // block, block, k) if n % block == 0 else weight[None]
    return torch.maximum(blocks.amax(1).amax(0), blocks.amin(1).amin(0).neg())


def column_copies(absmax: torch.Tensor, outliers: int = OUTLIER_CHANNELS) -> torch.Tensor:
    """int8 columns per input channel [K] from calibrated channel maxima [K]: each of the `outliers` largest
    gets ceil(its max / the next channel's max), at most MAX_COPIES; the others one."""
    copies = torch.ones(absmax.numel(), dtype=torch.long)
    if absmax.numel() > outliers:
        top = absmax.float().topk(outliers + 1)
        floor = top.values[-1]
        if floor > 0:
            copies[top.indices[:outliers]] = torch.ceil(top.values[:outliers] / floor).long().clamp_(max=MAX_COPIES)
    return copies


def head_layout(absmax: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 LM head's (smoothing factors [K], int8 columns per channel [K]) for a final hidden state whose
    channels reached `absmax` [K]: smoothed with HEAD_SMOOTHING_ALPHA, then the outliers left split."""
    smooth = smoothing_factors(absmax, weight, HEAD_SMOOTHING_ALPHA)
    return smooth, column_copies(absmax.float() / smooth)


class QuantLMHead(LMHead):
    """The LM head with a compact copy of its weight for W8A8 calls: "int8" (per-channel weights, W8A8, its
    inputs smoothed by `smooth` and the outlier channels split over `copies` columns each (`head_layout`):
    fastest) or "bf16" (bfloat16 weight and activations, float32 sums: fast where bf16 is native). The float
    weight stays for the other calls and, when tied, as the embedding table."""

    def __init__(self, head: LMHead, choice: KernelChoice, mode: str, copies: torch.Tensor | None = None,
                 smooth: torch.Tensor | None = None):
        nn.Module.__init__(self)
        self.tp, self.vocab_size, self.local_vocab = head.tp, head.vocab_size, head.local_vocab
        self.weight = head.weight
        self.mode = mode
        self.register_buffer("columns", None)
        self.register_buffer("column_scale", None)
        if mode == "int8":
            weight = head.weight.data.float()
            if smooth is not None:
                weight = weight * smooth.to(weight.device)
            q, s = quantize_int8(weight, bound=w8a8_weight_bound(head.weight.device))
            if copies is not None or smooth is not None:
                copies = torch.ones(q.shape[1], dtype=torch.long) if copies is None else copies
                divisor = copies.float() * (1.0 if smooth is None else smooth.float().cpu())
                columns = torch.repeat_interleave(torch.arange(copies.numel()), copies).to(q.device)
                self.register_buffer("columns", columns)
                self.register_buffer("column_scale", (1.0 / divisor).to(q.device)[columns])
                q = q[:, columns].contiguous()
        else:
            q, s = head.weight.data.to(torch.bfloat16), None
        self.register_buffer("fast_weight", q)
        self.register_buffer("fast_scales", s)
        self.register_buffer("fast_packed", None)  # the int8 weight's oneDNN handle, once packed
        self.in_features = q.shape[1]  # the fast weight's inputs (the int8 one's include the split columns)
        self.choice = choice

    @property
    def int8_layout(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The int8 head's weight as `QuantLinear.int8_layout` gives a linear's."""
        if self.mode != "int8":
            raise RuntimeError(f"the {self.mode} LM head has no int8 layout")
        return self.fast_weight, self.fast_scales, self.fast_packed

    def use_packed_int8(self, handle: torch.Tensor) -> None:
        """Run W8A8 calls on the oneDNN-packed copy `handle` and drop the plain int8 weight."""
        self.fast_packed, self.fast_weight = handle, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.choice.head_uses_compact(hidden.shape[0]):
            return super().forward(hidden)
        if self.mode == "int8":
            logits = w8a8_matmul(self._int8_input(hidden), self.fast_weight, self.fast_scales, self.fast_packed).float()
        else:
            logits = F.linear(hidden.to(torch.bfloat16), self.fast_weight).float()
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of `forward(hidden)`, without the [rows, vocab] logits (25 MB at 128 rows of SmolLM2)
        where the int8 head runs on CPU: on the native GEMM, each row's best column is kept in the GEMM's own
        pass (`NativeInt8Weight.argmax`), its input quantized natively where the native layers' library
        runs (`cpu_decode_layers.quantize_rows`: no compiled graph to build at a process's first step); on the others, the chunk maxima (`kernels.argmax`) are taken from
        the GEMM's outputs in one read pass and only the winning chunks' columns are recomputed."""
        fused = (self.mode == "int8" and hidden.device.type == "cpu" and self.tp.size == 1
                 and (self.columns is not None or hidden.dtype == torch.float32)  # float32 logits in forward
                 and self.vocab_size >= 2 * ARGMAX_CHUNK and self.choice.head_uses_compact(hidden.shape[0]))
        if not fused:
            return super().greedy(hidden)
        weight = None if self.fast_packed is None else packed_weight(self.fast_packed)
        if isinstance(weight, NativeInt8Weight):
            u, row_scales = (cpu_decode_layers.quantize_rows(self._int8_input(hidden))
                             if cpu_decode_layers.unavailable_reason() is None else self._greedy_rows(hidden))
            if bool(row_scales.isfinite().all()):  # else NaN logits, where torch's argmax picks the first NaN
                return weight.argmax(u, self.fast_scales, row_scales, self.vocab_size)
        outputs, row_scales, maxima = self._greedy_outputs(hidden)
        scales = self.fast_scales.reshape(-1)
        return argmax_by_chunks(
            maxima, lambda cols: as_products(outputs.gather(1, cols), scales[cols]).mul_(row_scales), self.vocab_size)

    def compile(self, **options: Any) -> None:
        super().compile(**options)
        self._greedy_outputs = compiled_copy(self._greedy_outputs, **options)
        self._greedy_rows = compiled_copy(self._greedy_rows, **options)

    def _greedy_rows(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 head's GEMM input for `hidden`: quantized rows and their scales [N, 1]."""
        return quantize_for_gemm(self._int8_input(hidden), self.fast_packed)

    def _greedy_outputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int8 head's GEMM outputs [N, vocab] (`int8_outputs`: int32 sums, or the packed GEMM's
        products), row scales [N, 1] and the chunk maxima of the logits they make, products x row scale
        (compiled, the maxima fuse into one read pass over the outputs: no float32 products or logits are
        stored; at 256 rows of SmolLM2 that pass took 2.4 ms against 5.6 storing the products)."""
        q, row_scales = QuantLMHead._greedy_rows(self, hidden)  # the plain method: one graph, not two nested
        outputs = int8_outputs(q, self.fast_weight, self.fast_scales, self.fast_packed)
        return outputs, row_scales, chunk_maxima(as_products(outputs, self.fast_scales.reshape(1, -1)) * row_scales)

    def _int8_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The int8 head's activations: smoothed, the outlier channels split over their columns."""
        return hidden if self.columns is None else hidden.float()[:, self.columns] * self.column_scale


def attach_w8a8(model: nn.Module, scheme: str, w8a8_rows: int | None, lm_head: str,
                calibration: list[int] | None = None) -> KernelChoice:
    """Let a loaded quantized model run calls of >= `w8a8_rows` rows in W8A8 (None: never; quant=w8a8
    always); `lm_head` ("int8", "bf16", "none") is the LM head's kernel for those calls. With `calibration`
    token ids, one pass over them measures the activation ranges that smooth the linears' inputs and split
    the int8 head's outlier channels, and where weights are held to 7 bits the inputs' Gram matrices they
    are rounded against (`pipeline.model.calibration`); not under tensor parallelism (the pass
    would need every rank's collectives at load). Sets `model.kernel_choice`."""
    rows = 1 if scheme == "w8a8" else w8a8_rows
    if rows is not None and rows < 1:
        raise ValueError(f"w8a8_rows must be >= 1 or None, got {rows}")
    if lm_head not in LM_HEAD_MODES:
        raise ValueError(f"quant_lm_head={lm_head!r} is not one of {LM_HEAD_MODES}")
    choice = KernelChoice("" if scheme == "w8a8" else scheme, rows)
    if rows is not None:
        choice.weight_bound = w8a8_weight_bound(model.norm.weight.device)
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        final = None
        if calibration and model.tp.size == 1:
            # GPTQ where the CPU's int8 GEMM holds weights to 7 bits: on SmolLM2 it took W8A8 from +2.95% to
            # +1.35% perplexity there; at 8 bits it read +1.34-1.97% against nearest's +1.48%, no gain.
            final = calibrate(model, calibration, linears, lambda m, seen: m.attach_w8a8(choice, seen),
                              grams=choice.weight_bound < FULL_RANGE, weights=QuantLinear.dequantize)
        else:
            for m in linears:
                m.attach_w8a8(choice)
        if lm_head != "none" and (lm_head != "bf16" or model.dtype != torch.bfloat16):
            smooth, copies = (head_layout(final, model.lm_head.weight.data) if lm_head == "int8" and final is not None
                              else (None, None))
            model.lm_head = QuantLMHead(model.lm_head, choice, lm_head, copies, smooth)
    model.kernel_choice = choice
    return choice


def quantize_model(model: nn.Module, scheme: str, group_size: int = 32, *, weights_loaded: bool) -> nn.Module:
    """Swap every ParallelLinear of `model` for a QuantLinear (in place; returns the model).

    weights_loaded=True quantizes the float weights already in the model (int8/int4); False prepares
    empty quantized linears for `model.load_weights` (the only way for gguf, which needs the file's blocks).
    """
    if scheme not in QUANT_SCHEMES[1:]:
        raise ValueError(f"model.quant={scheme!r} is not one of {QUANT_SCHEMES}")
    if scheme == "int4" and group_size not in QUANT_GROUP_SIZES:
        raise ValueError(f"model.quant_group_size={group_size} is not one of {QUANT_GROUP_SIZES}")
    if scheme == "gguf" and weights_loaded:
        raise ValueError("quant=gguf takes the checkpoint's blocks: swap before loading (weights_loaded=False)")
    targets = [(n, m) for n, m in model.named_modules() if type(m) is ParallelLinear]
    for name, linear in targets:
        try:
            quant = Fp8Linear(linear) if scheme == "fp8" else QuantLinear(linear, scheme, group_size)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        if weights_loaded:
            quant.quantize_from(linear.weight.data)
            if linear.bias is not None:
                quant.bias.data.copy_(linear.bias.data)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quant)
    return model


def check_loaded(model: nn.Module) -> None:
    """Raise naming the first quantized linear that did not receive all of its rows."""
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear | Fp8Linear) and m.rows_loaded != m.out_features:
            raise ValueError(f"{name}: checkpoint provided {m.rows_loaded} of {m.out_features} weight rows")


def pack_model_for_cpu(model: nn.Module, w4a8: bool = False) -> int:
    """Convert every quantized linear that torch's CPU kernels support (with `w4a8`, an int4 weight for the
    native W4A8 GEMM, where that runs here, and torch's layout only where `pack_torch_int4_where_read` asks
    for it); returns how many were converted."""
    w4a8 = w4a8 and cpu_w4a8.unavailable_reason() is None
    return sum(m.pack_for_cpu(w4a8) for m in model.modules() if isinstance(m, QuantLinear))


def pack_torch_int4_where_read(model: nn.Module) -> None:
    """Make torch's int4 layout of the linears `pack_for_cpu` gave only the W4A8 one, where the model's
    kernel choice has weight-only calls that read it (`KernelChoice.reads_torch_int4`)."""
    if model.kernel_choice is not None and model.kernel_choice.reads_torch_int4():
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.pack_torch_int4()


def drop_weight_only_layouts(model: nn.Module) -> int:
    """Make a weight-only model with W8A8 attached run W8A8 at every row count, as quant=w8a8 does, and free
    its weight-only layouts, which no call reads after that; returns the bytes released."""
    choice = model.kernel_choice
    if choice is None or choice.w8a8_rows is None:
        raise ValueError("drop_weight_only_layouts needs W8A8 attached (load with w8a8_rows set)")
    choice.weight_only, choice.w8a8_rows = "", 1
    freed = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for name in ("qweight", "scales", "mins", "packed_weight", "packed_scales", "w4a8_packed"):
                buffer = getattr(m, name)
                if buffer is not None and buffer is not m.w8a8_weight and buffer is not m.w8a8_scales:
                    freed += buffer.numel() * buffer.element_size()
                setattr(m, name, None)
    return freed


def packed_int8_bytes(module: nn.Module) -> int:
    """Bytes of the oneDNN-packed int8 weights in `module` (`kernels.packed_int8`), which its state_dict holds
    only as handles."""
    total = 0
    for m in module.modules():
        handle = getattr(m, "w8a8_packed", None) if isinstance(m, QuantLinear) else getattr(m, "fast_packed", None)
        if handle is not None:
            total += packed_bytes(handle)
    return total


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of the model's linear layers (quantized or float), biases excluded."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear | Fp8Linear):
            total += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False)) + packed_int8_bytes(m)
        elif isinstance(m, ParallelLinear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def _is_linear_weight(hf_name: str) -> bool:
    return ".layers." in hf_name and hf_name.endswith("_proj.weight")


def gguf_quantized_tensors(ckpt) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, tensor) pairs of a GGUFCheckpoint: linear weights as QuantizedTensor (their blocks),
    everything else (embeddings, norms) dequantized to float32 by the `gguf` package."""
    from gguf.quants import dequantize as gguf_dequantize

    for name, raw in ckpt.raw_hf_tensors():
        if _is_linear_weight(name):
            yield name, from_gguf_blocks(raw.blocks, raw.qtype, raw.shape, name)
        else:
            yield name, torch.from_numpy(np.array(gguf_dequantize(raw.blocks, raw.qtype)).reshape(raw.shape))


def load_quantized(
    model: nn.Module, ckpt, scheme: str, group_size: int = 32, w8a8_rows: int | None = None, lm_head: str = "int8",
    calibration: list[int] | None = None, prefer_speed: bool = False,
) -> None:
    """Swap the linears for `scheme` and load `ckpt` (a GGUFCheckpoint or HFCheckpoint) into them, then
    enable W8A8 calls (`attach_w8a8`: always for w8a8, from `w8a8_rows` rows for the weight-only schemes).

    On CPU the weights are then converted for torch's weight-only kernels (bfloat16 activations, the fast
    path there) when the model is bfloat16, or where those kernels run vectorized here
    (`weight_only_kernels_fast`) and the run chose speed over exactness: W8A8 calls are on, or
    `prefer_speed` (model.quant=auto); otherwise float32 keeps the exact layout and dequantizes per call.
    """
    quantize_model(model, scheme, group_size, weights_loaded=False)
    if scheme == "gguf":
        if not hasattr(ckpt, "raw_hf_tensors"):
            raise ValueError(f"{ckpt.path}: quant=gguf needs a GGUF checkpoint (use int8 or int4 here)")
        tensors: Iterable = gguf_quantized_tensors(ckpt)
    else:  # GGUF files: any block type, dequantized by the gguf package, then quantized here
        tensors = ckpt.tensors(torch.float32)
    model.load_weights(tensors)
    check_loaded(model)
    choice = attach_w8a8(model, scheme, w8a8_rows, lm_head, calibration)
    if prefer_speed and isinstance(model.lm_head, QuantLMHead):
        # auto: the head's compact copy at every call. Below the switch the linears stay weight-only, but a
        # float32 head is the largest single read of a small step (a 1B model's 49k x 2048 head: 400 MB
        # against 550 MB for all its int4 linears); its int8 copy reads a quarter of that.
        choice.head_rows = 1
    fast = model.dtype == CPU_ACTIVATION_DTYPE or ((w8a8_rows is not None or prefer_speed) and weight_only_kernels_fast())
    if scheme != "w8a8" and fast and model.norm.weight.device.type == "cpu":
        # the W4A8 copy serves auto's weight-only steps once the switch timing (which needs W8A8) picks it
        pack_model_for_cpu(model, w4a8=prefer_speed and w8a8_rows is not None)
        pack_torch_int4_where_read(model)  # none under a choice timed later (W8A8 from 1 row until then)
