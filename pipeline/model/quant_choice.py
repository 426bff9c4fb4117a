"""`model.quant=auto`: pick the quantization by regime from the machine's measured peaks.

Small decode batches are bandwidth-bound: the fewest weight bytes win (a weight-only scheme). Large ones are
compute-bound on a CPU: the fastest arithmetic wins (W8A8's int8 GEMM). The roofline of both, at each batch
size, gives the smallest batch from which W8A8 is faster; the weight-only linears switch there per call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeline.model.config import ModelConfig
from pipeline.model.roofline import HardwareProfile, Precision, decode_ceiling, precision

# Weight-only scheme -> the precision its weights are read in (gguf: SmolLM2's Q4_1 blocks).
WEIGHT_ONLY_PRECISION = {"gguf": "q4_1", "int4": "int4-g32", "int8": "int8"}


@dataclass(frozen=True)
class QuantChoice:
    """What auto chose: the scheme to load, from which batch size calls run W8A8, the LM head, and why."""

    scheme: str
    w8a8_rows: int | None
    lm_head: str
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def dequantized_per_call(p: Precision) -> Precision:
    """A weight-only precision computed in float32 by dequantizing every call: each weight is also written
    and read back as 4 bytes."""
    return Precision(f"{p.name}->fp32", p.bits + 64, p.group_size, p.group_bytes)


def choose_quant(
    model: ModelConfig, hw: HardwareProfile, weight_only: str, weight_only_kernels: bool, max_batch: int
) -> QuantChoice:
    """Compare the weight-only scheme (torch's bf16-activation kernels where `weight_only_kernels` says they
    run vectorized, at `hw`'s bf16 peak; else dequantized to float32 per call) with W8A8 (int8 weights,
    `hw`'s int8 peak) on the decode roofline for batches 1..`max_batch`."""
    lm_head = "int8"  # split outlier channels: as close to float32 as bf16, and faster (quant.head_layout)
    wo = precision(WEIGHT_ONLY_PRECISION[weight_only])
    wo_compute = "bf16" if weight_only_kernels and "bf16" in hw.flops else "fp32"
    if wo_compute == "fp32":
        wo = dequantized_per_call(wo)
    if "int8" not in hw.flops:
        return QuantChoice(weight_only, None, lm_head, f"hardware {hw.name!r} has no int8 peak: weight-only {wo.name}")

    def ceilings(batch: int):
        return (decode_ceiling(model, hw, wo, batch, compute_dtype=wo_compute).tokens_per_s,
                decode_ceiling(model, hw, "int8", batch, compute_dtype="int8").tokens_per_s)

    rows = next((b for b in range(1, max_batch + 1) if ceilings(b)[1] >= ceilings(b)[0]), None)
    one, top = ceilings(1), ceilings(max_batch)
    figures = (f"decode ceilings at batch 1: {wo.name} on {wo_compute} {one[0]:.0f} tok/s vs int8 {one[1]:.0f}; "
               f"at batch {max_batch}: {top[0]:.0f} vs {top[1]:.0f} (bandwidth {hw.bandwidth / 1e9:.0f} GB/s, "
               f"{wo_compute} peak {hw.peak(wo_compute) / 1e9:.0f} GFLOP/s, int8 peak {hw.peak('int8') / 1e9:.0f} GOP/s)")
    if rows == 1:
        return QuantChoice("w8a8", 1, lm_head, f"W8A8 at every batch: {figures}")
    if rows is None:
        return QuantChoice(weight_only, None, lm_head, f"weight-only {weight_only} at every batch: {figures}")
    return QuantChoice(weight_only, rows, lm_head,
                       f"weight-only {weight_only} below {rows} rows, W8A8 from {rows}: {figures}")
