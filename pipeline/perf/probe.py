"""Measure "this CPU" for the roofline in a few seconds: memory bandwidth, fp32 / bf16 matmul peaks, the
int8 GEMM peak (the fastest of `torch._int_mm`, oneDNN's packed GEMM and ours, what W8A8 linears run) and whether
bfloat16 is native.

Bandwidth is a STREAM-style triad (a = b + s*c over arrays far larger than the caches, 3 arrays moved per
pass), the fastest of a quarter second of passes; a peak, the fastest of a quarter second of square matmuls.
Both use torch's current thread count, as the engine does. Numbers are noisy on a shared machine: the best
reports what the hardware can do when it is not disturbed, which is what a ceiling means. A fixed few calls
(an int8 matmul takes ~3 ms) can all land in one slow spell of a virtual machine; a quarter second of them
rarely does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from kernels.dispatch import w8a8_weight_bound
from kernels.packed_int8 import (
    pack_int8_weight,
    pack_native_int8_weight,
    packed_int8_products,
    release_packed,
    uint8_activations,
)
from kernels.wq_cpu import native_bf16, weight_only_kernels_fast
from pipeline.config import CONF_DIR
from pipeline.errors import JobError
from pipeline.model.roofline import HardwareProfile
from pipeline.stopwatch import best_seconds

HARDWARE_DIR = CONF_DIR / "hardware"
MEASURED_PEAKS = ("fp32", "bf16", "int8")
MIN_SECONDS = 0.25  # each figure is the best call of at least this long a stretch of calls


@dataclass(frozen=True)
class ProbeResult:
    bandwidth: float  # bytes/s
    flops: dict[str, float]  # "fp32" / "bf16" / "int8" -> FLOP/s (int8: integer multiply-adds x 2)
    memory: float  # bytes of physical RAM
    threads: int
    bf16_native: bool = False  # AVX512-BF16 / AMX: bf16 matmuls are not emulated
    weight_only_kernels: bool = False  # torch's bf16-activation weight-only kernels run vectorized (AVX-512)
    int8_gemms: dict[str, float] = field(default_factory=dict)  # `measure_int8_gemms`; flops["int8"] is the best


def cpu_flags() -> str:
    """The CPU's vector / matrix extensions that decide which kernels are fast (printed beside figures)."""
    try:
        words = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "?"
    keep = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")
    return " ".join(sorted({w for w in words if w in keep}))


def measure_bandwidth(mib: int = 256, reps: int = 5, min_seconds: float = MIN_SECONDS) -> float:
    """Triad bandwidth in bytes/s over three float32 arrays of `mib` MiB each (reads b, c; writes a)."""
    n = mib * 2**20 // 4
    a, b, c = torch.empty(n), torch.ones(n), torch.full((n,), 2.0)
    seconds = best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), reps, min_seconds)
    if not torch.all(a[:: n // 7] == 7.0):  # the triad really ran
        raise RuntimeError("bandwidth probe computed a wrong triad")
    return 3 * n * 4 / seconds


def measure_matmul_peak(dtype: torch.dtype, n: int = 1024, reps: int = 5, min_seconds: float = MIN_SECONDS) -> float:
    """Dense FLOP/s of an n x n x n `F.linear` in `dtype` (2 n^3 FLOPs): the call the model's layers make.

    On CPUs without native bf16 (AVX2-only), `torch.mm` in bf16 falls back to a path ~20x slower than
    `F.linear`'s, so measuring the engine's own call matters.
    """
    x = torch.randn(n, n).to(dtype)
    w = torch.randn(n, n).to(dtype)
    seconds = best_seconds(lambda: F.linear(x, w), reps, min_seconds)
    return 2 * n**3 / seconds


def measure_int8_gemms(n: int = 1024, reps: int = 5, min_seconds: float = MIN_SECONDS) -> dict[str, float]:
    """Integer OP/s of an n x n x n int8 GEMM (int32 sums) each way W8A8 linears run on CPU: "_int_mm"
    (`torch._int_mm`), "packed" (oneDNN's GEMM on a weight packed once, `kernels.packed_int8`) and "native"
    (the VNNI GEMM of `kernels.vnni_gemm`), the last two absent where they cannot run, the weights within
    the bound W8A8 quantizes them to on this CPU. The model keeps the fastest at load; without VNNI
    `torch._int_mm` ran ~50x slower than the packed GEMM (4 against ~220 GOP/s on a Zen 3)."""
    bound = w8a8_weight_bound(torch.device("cpu"))
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    b = torch.randint(-bound, bound + 1, (n, n), dtype=torch.int8)
    ops = 2 * n**3
    figures = {"_int_mm": ops / best_seconds(lambda: torch._int_mm(a, b.t()), reps, min_seconds)}
    scales, u = torch.ones(n), uint8_activations(a)  # as steps pass them (`kernels.packed_int8`)
    for name, pack in (("packed", pack_int8_weight), ("native", pack_native_int8_weight)):
        try:
            handle = pack(b, b)
        except RuntimeError:
            continue
        try:
            figures[name] = ops / best_seconds(lambda h=handle: packed_int8_products(u, scales, h), reps, min_seconds)
        finally:
            release_packed(handle)
    return figures


def physical_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def probe(bandwidth_mib: int = 256, matmul_n: int = 1024, reps: int = 5) -> ProbeResult:
    """Run all measurements (about 2-3 s on a 2-core machine; ~6 s where `torch._int_mm` is a reference
    kernel)."""
    int8_gemms = measure_int8_gemms(matmul_n, reps)
    return ProbeResult(
        bandwidth=measure_bandwidth(bandwidth_mib, reps),
        flops={
            "fp32": measure_matmul_peak(torch.float32, matmul_n, reps),
            "bf16": measure_matmul_peak(torch.bfloat16, matmul_n, reps),
            "int8": max(int8_gemms.values()),
        },
        int8_gemms=int8_gemms,
        memory=physical_memory(),
        threads=torch.get_num_threads(),
        bf16_native=native_bf16(),
        weight_only_kernels=weight_only_kernels_fast(),
    )


def fill_hardware_config(cfg: dict, measure: Callable[[], ProbeResult] = probe) -> dict:
    """Return a `hardware` config dict with its null figures filled from a probe (only when some are null)."""
    peaks = dict(cfg.get("peak_tflops") or {"fp32": None, "bf16": None})
    unknown = [k for k, v in peaks.items() if v is None and k not in MEASURED_PEAKS]
    if unknown:
        raise ValueError(
            f"hardware {cfg.get('name')!r}: the probe measures {', '.join(MEASURED_PEAKS)} only; set peak_tflops.{unknown[0]}"
        )
    if None not in (cfg.get("bandwidth_tbs"), cfg.get("memory_gb"), *peaks.values()):
        return dict(cfg)
    result = measure()
    out = dict(cfg)
    if out.get("bandwidth_tbs") is None:
        out["bandwidth_tbs"] = result.bandwidth / 1e12
    if out.get("memory_gb") is None:
        out["memory_gb"] = result.memory / 1e9
    out["peak_tflops"] = {k: result.flops[k] / 1e12 if v is None else v for k, v in peaks.items()}
    return out


def hardware_profile(cfg: Mapping[str, Any], measure: Callable[[], ProbeResult] = probe) -> HardwareProfile:
    """A `hardware` config (a conf/hardware/*.yaml mapping) as a profile; with `probe: true` its null
    figures are measured here first (`measure`: a few seconds, or an earlier start's figures)."""
    raw = dict(cfg)
    if raw.pop("probe", False):
        raw = fill_hardware_config(raw, measure)
    return HardwareProfile.from_config(raw)


def load_hardware(name: str, overrides: Sequence[str] = ()) -> HardwareProfile:
    """conf/hardware/NAME.yaml with `key=value` overrides (e.g. `price_per_hour=2.5`)."""
    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
        raise JobError(f"unknown hardware={name!r}; available: {', '.join(known)} (conf/hardware/)")
    try:
        cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
        return hardware_profile(OmegaConf.to_container(cfg, resolve=True))
    except Exception as e:  # OmegaConf's and our own messages name the key
        raise JobError(f"{path} with overrides {list(overrides)}: {e}") from None


def main() -> None:
    """`python -m pipeline.probe`: print this machine's figures."""
    r = probe()
    gemms = ", ".join(f"{name} {ops / 1e9:.0f}" for name, ops in r.int8_gemms.items())
    print(f"threads {r.threads}: triad {r.bandwidth / 1e9:.1f} GB/s, fp32 F.linear {r.flops['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 F.linear {r.flops['bf16'] / 1e9:.1f} GFLOP/s ({'native' if r.bf16_native else 'emulated'}), "
          f"int8 {r.flops['int8'] / 1e9:.0f} GOP/s ({gemms}; weights within +-{w8a8_weight_bound(torch.device('cpu'))}), "
          f"RAM {r.memory / 2**30:.1f} GiB; cpu flags: {cpu_flags()}")


if __name__ == "__main__":
    main()
