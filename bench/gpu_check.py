"""GPU check of the Triton weight-only GEMMs: correctness against the torch reference, then timing at the
decode shapes of an 8B Llama (random weights), as achieved GB/s against the GPU's memory bandwidth.

    python bench/gpu_check.py [--bandwidth-gbs 4800] [--json out.json]

Bytes counted per call: the quantized weight (q + scales (+ mins)) plus activations in and out; at
decode sizes the weight dominates, so GB/s near the GPU's bandwidth means the kernel is at the roofline.
cuBLAS bf16 dense (F.linear) at the same shape is timed next to it for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.wq_reference import dequantize, quantize_int4, quantize_int8  # noqa: E402
from kernels.wq_triton import wq_matmul_triton  # noqa: E402

# Llama-3-8B: hidden 4096, MLP 14336, 32 query / 8 KV heads of 128 -> the four linears of a layer.
LLAMA8B_SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
                  "down_proj": (4096, 14336)}
DECODE_M = (1, 16, 64, 256)
# (M, N, K): odd M, N off the tile, K off the tile (groups dividing it), M over the largest tile.
CHECK_SHAPES = ((1, 4096, 4096), (7, 1000, 4160), (64, 2048, 1536), (257, 512, 2048))


def quantized(n: int, k: int, bits: int, group: int | None, device: str):
    w = torch.randn(n, k, device=device) * 0.02
    if bits == 4:
        q, s, m = quantize_int4(w, group)
        return q, s, m
    q, s = quantize_int8(w, group)
    return q, s, None


def check_correctness(device: str) -> list[dict]:
    rows = []
    for bits, group in ((4, 32), (4, 128), (8, None), (8, 32)):
        for m, n, k in CHECK_SHAPES:
            if group and k % group:
                continue
            q, s, mins = quantized(n, k, bits, group, device)
            w = dequantize(q, s, mins, bits)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = torch.randn(m, k, device=device).to(dtype)
                y = wq_matmul_triton(x, q, s, mins, bits).float()
                ref = x.float() @ w.T
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}[dtype]
                rows.append({"bits": bits, "group": group or k, "m": m, "n": n, "k": k, "dtype": str(dtype),
                             "rel_err": err, "ok": err <= tol})
    return rows


def timed(fn, iters: int = 50) -> float:
    """Median seconds per call, from CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def time_decode_shapes(device: str, bandwidth: float) -> list[dict]:
    rows = []
    for name, (n, k) in LLAMA8B_SHAPES.items():
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for bits, group in ((4, 32), (4, 128), (8, None)):
            q, s, mins = quantized(n, k, bits, group, device)
            wbytes = sum(t.numel() * t.element_size() for t in (q, s, mins) if t is not None)
            for m in DECODE_M:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                sec = timed(lambda: wq_matmul_triton(x, q, s, mins, bits))  # noqa: B023
                moved = wbytes + x.numel() * 2 + m * n * 2
                dense_sec = timed(lambda: F.linear(x, dense))  # noqa: B023
                rows.append({"layer": name, "n": n, "k": k, "bits": bits, "group": group or k, "m": m,
                             "us": sec * 1e6, "gb_s": moved / sec / 1e9, "pct_bw": 100 * moved / sec / 1e9 / bandwidth,
                             "tflops": 2 * m * n * k / sec / 1e12, "dense_bf16_us": dense_sec * 1e6})
                r = rows[-1]
                print(f"{name:13s} int{bits} g{r['group']:<5} M={m:<4} {r['us']:8.1f} us  {r['gb_s']:7.0f} GB/s "
                      f"({r['pct_bw']:4.1f}% of {bandwidth:.0f})  {r['tflops']:6.1f} TFLOP/s  "
                      f"dense bf16 {r['dense_bf16_us']:8.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="GPU memory bandwidth (H200: 4800)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; nothing was run")
    device = "cuda"
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    correctness = check_correctness(device)
    bad = [r for r in correctness if not r["ok"]]
    print(f"# correctness: {len(correctness) - len(bad)}/{len(correctness)} cases within tolerance "
          f"({time.perf_counter() - t0:.0f} s, includes compilation)", flush=True)
    for r in bad:
        print("  FAIL", r)
    timing = time_decode_shapes(device, args.bandwidth_gbs)
    if args.json:
        args.json.write_text(json.dumps({"correctness": correctness, "timing": timing}, indent=1))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
