"""The W8A8 GEMMs this CPU has, side by side on the model's own int8 weights, at the row counts steps run.

For each row count, one pass over every int8 weight of the model (the decoder's linears, then the LM head),
as a step runs them, the weights streaming from memory: `torch._int_mm` on the plain weights, oneDNN's GEMM
on weights packed once, and the native VNNI GEMM (`kernels.vnni_gemm`), in alternating rounds so that
a change in the machine's speed lands on all of them. The model picks one of them at load by a shorter
timing at 128 rows (`pipeline.model.w8a8_gemm`); this shows the whole range.

    python bench/int8_gemm.py
    python bench/int8_gemm.py --rows 1 64 256 --part lm_head
"""

from __future__ import annotations

import argparse
import os

import torch

from kernels.packed_int8 import pack_int8_weight, pack_native_int8_weight
from kernels.vnni_gemm import unavailable_reason
from pipeline.model import loader
from pipeline.model.w8a8_gemm import NATIVE, PACKED, PLAIN, gemm_pass, int8_parts
from pipeline.perf.probe import cpu_flags, probe
from pipeline.stopwatch import alternating_best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    ap.add_argument("--part", choices=["all", "layers", "lm_head"], default="all")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds; each figure is their median")
    ap.add_argument("--reps", type=int, default=2, help="passes per round; the fastest counts")
    args = ap.parse_args()

    hw = probe()
    print(f"cpu flags: {cpu_flags()}; threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}; probe: "
          f"int8 {hw.flops['int8'] / 1e9:.0f} GOP/s ({', '.join(f'{k} {v / 1e9:.0f}' for k, v in hw.int8_gemms.items())})")
    loader.choose_int8_gemm = lambda model, known=None: {}  # keep every weight plain: this bench packs its own copies
    model = loader.load_model(args.model, quant="w8a8", quant_lm_head="int8").model
    parts = int8_parts(model)
    modules = [m for name, ms in parts.items() if args.part in ("all", name) for m in ms]
    weights = [(m, *m.int8_layout[:2]) for m in modules]
    layouts = {PLAIN: [(w, s, None) for _, w, s in weights]}
    try:
        layouts[PACKED] = [(w, s, pack_int8_weight(m, w)) for m, w, s in weights]
    except RuntimeError as e:
        print(f"no {PACKED} GEMM: {e}")
    if unavailable_reason() is None:
        layouts[NATIVE] = [(w, s, pack_native_int8_weight(m, w)) for m, w, s in weights]
    else:
        print(f"no {NATIVE} GEMM: {unavailable_reason()}")
    print(f"{len(modules)} weights ({sum(w.numel() for _, w, _ in weights) / 1e6:.1f} M), part {args.part}, "
          f"median of {args.rounds} alternating rounds of each GEMM's best of {args.reps} passes")
    print("rows  " + "  ".join(f"{name:>24}" for name in layouts) + "  fastest")
    with torch.inference_mode():
        for rows in args.rows:
            ops = sum(2.0 * rows * w.numel() for _, w, _ in weights)
            passes = [gemm_pass(modules, rows, layout) for layout in layouts.values()]
            seconds = dict(zip(layouts, alternating_best(passes, args.rounds, args.reps)))
            best = min(seconds, key=seconds.get)
            others = [t for name, t in seconds.items() if name != best]
            cells = "  ".join(f"{t * 1e3:9.2f} ms {ops / t / 1e9:5.0f} GOP/s" for t in seconds.values())
            print(f"{rows:4d}  {cells}  {best}" + (f", {min(others) / seconds[best]:.2f}x the next" if others else ""))


if __name__ == "__main__":
    main()
