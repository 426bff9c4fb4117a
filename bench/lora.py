"""Many fine-tunes in one job: rows spread over LoRA adapters against the same rows on the base model alone.

Workload: `--rows` chat prompts (short questions), greedy, `--max-tokens` new tokens each
(`sampling.ignore_eos=true`, so both runs generate the same number of tokens), SmolLM2-135M (or `--model`) in
the default mode (`model.quant=auto`; pass `model.quant=none` etc. to compare another). The rows are spread
round-robin over `--adapters` random rank-`--rank` adapters on every projection (PEFT checkpoints written
here), `model.lora.max_loaded` = the adapter count. Both runs are the real job (`pipeline.job.run`: Parquet
in, parts out) in one process, after an untimed warm-up job (the process's first job pays one-off costs), in
`--pairs` pairs, the order alternating (base first, then adapters first, ...) so that neither side always
meets the machine's drift first; the bench prints generated tokens per second of each run, each pair's ratio
and their median.

    python bench/lora.py                          # 256 rows, 8 adapters of rank 16, 64 new tokens
    python bench/lora.py --rows 32 --max-tokens 16
    python bench/lora.py model.quant=none         # any job key for both runs
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from pipeline.job import run
from pipeline.model.lora.peft_file import module_shapes
from pipeline.perf.roofline_cli import compose_job, read_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, shape, rank: int, seed: int) -> Path:
    """A random PEFT LoRA checkpoint on every projection of a model of `shape` (std chosen so the deltas
    are small next to the weights, as a trained adapter's are)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module, (features_in, features_out) in module_shapes(shape).items():
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, features_in, generator=gen) * features_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(features_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", help="model.path (default: the SmolLM2 GGUF)")
    ap.add_argument("--pairs", type=int, default=2, help="base and adapter runs, the order alternating")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("overrides", nargs="*", help="more job keys for both runs, e.g. engine.max_batch_size=64")
    args = ap.parse_args()
    shape, _ = read_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    names = [f"ft{i}" for i in range(args.adapters)]
    folders = {name: write_adapter(work / name, shape, args.rank, i) for i, name in enumerate(names)}
    rng = random.Random(0)
    prompts = [f"Question {i}: what is {rng.randrange(1000)} plus {rng.randrange(1000)}, and why?"
               for i in range(args.rows)]
    table = pa.table({"id": list(range(args.rows)), "prompt": prompts,
                      "adapter": [names[i % len(names)] for i in range(args.rows)]})
    pq.write_table(table, work / "in.parquet")
    pq.write_table(table.slice(0, 16), work / "warm-up.parquet")
    common = [f"input.path={work / 'in.parquet'}", f"sampling.max_tokens={args.max_tokens}",
              "sampling.ignore_eos=true", "progress.mode=off",
              *([f"model.path={args.model}"] if args.model else []), *args.overrides]
    adapters = "{" + ", ".join(f"{n}: {f}" for n, f in folders.items()) + "}"
    runs = [("base model", []),
            (f"{args.adapters} adapters", ["input.lora_column=adapter", f"model.lora.adapters={adapters}",
                                           f"model.lora.max_loaded={args.adapters}"])]
    print(f"{args.rows} rows, {args.max_tokens} new tokens each; {args.adapters} adapters of rank {args.rank} on "
          f"every projection; load average {os.getloadavg()[0]:.1f}", flush=True)
    run(compose_job([*common, f"input.path={work / 'warm-up.parquet'}", f"output.path={work / 'warm-up'}",
                     "sampling.max_tokens=4", *runs[1][1]]), stdout=io.StringIO())
    results, ratios = [], []
    for pair in range(args.pairs):
        by_run = {}
        for name, keys in runs if pair % 2 == 0 else runs[::-1]:
            out = work / f"{name.replace(' ', '-')}-{pair}"
            m = run(compose_job([*common, f"output.path={out}", *keys]), stdout=io.StringIO())
            r = {"run": name, "pair": pair, "generated_tokens_per_s": m["generated_tokens_per_s"],
                 "generate_s": m["generate_time_s"], "mean_batch": m["mean_batch"], "quant": m["model"]["quant"],
                 "native_layer_steps": m["model"]["native_layer_steps"],
                 "steps": sum(m["model"]["kernel_steps"].values()), "kernel_steps": m["model"]["kernel_steps"],
                 "quant_auto": m["model"]["quant_auto"], "compile_s": m["engine"]["compile_s"],
                 "load_average": os.getloadavg()[0]}
            results.append(r)
            by_run[name] = r["generated_tokens_per_s"]
            print(f"{name:>12}: {r['generated_tokens_per_s']:.1f} generated tok/s ({r['generate_s']:.1f} s, "
                  f"mean batch {r['mean_batch']:.1f}, quant {r['quant']}, {r['native_layer_steps']} of {r['steps']} "
                  f"steps in the native layers, compile {r['compile_s']:.1f} s, load {r['load_average']:.1f})",
                  flush=True)
        ratios.append(by_run[runs[1][0]] / by_run[runs[0][0]])
    print(f"adapters / base, each pair: {', '.join(f'{x:.3f}' for x in ratios)}; median "
          f"{statistics.median(ratios):.2f}x (goal >= 0.8x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "ratios": ratios,
                                               "ratio": statistics.median(ratios)}, indent=2))


if __name__ == "__main__":
    main()
