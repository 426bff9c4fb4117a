"""Decode throughput by running batch size, measured on this machine, and the batch it suggests.

    python bench/batch_size.py --quant auto --batches 16,32,64,128,256
    python bench/batch_size.py --quant w8a8 --batches 64 --compile off,on  # side by side
    python bench/batch_size.py --batches 64,128 --lm-head int8,bf16 --rounds 3  # side by side, alternating

The same measurement `engine.max_batch_size=auto` makes at the start of a job
(`pipeline.engine.batch_tuning.decode_rate`): for each batch size B, B distinct `--prompt-len`-token prompts
are prefilled, then `--steps` decode steps with all B sequences running are timed one by one, the fastest
counting. Prints ms per step and generated tok/s, and the pick: the smallest B within `--within` of the
best tok/s whose KV cache (B x (prompt + --max-tokens) positions) fits `--kv-cache-memory`.

Steps below the W8A8 switch (weight-only: bound by reading the weights) also print how close they came to the
bandwidth ceiling: the weight bytes a step reads (`pipeline.model.roofline.weight_read_bytes`: the layers at
the weight-only precision, the int8 LM head) over a triad measured right after the timing, in this process.
On a VM whose bandwidth moves from minute to minute (33-58 GB/s seen on one host), a triad from another
run would make that fraction noise.
"""

from __future__ import annotations

import argparse
import os

import torch

from pipeline.config import resolve_kv_dtype
from pipeline.engine.batch_tuning import WITHIN, decode_rate, pick
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.runner import kv_bytes_per_block
from pipeline.model.loader import default_model_path, load_model
from pipeline.model.quant_choice import WEIGHT_ONLY_PRECISION, choose_quant
from pipeline.model.roofline import HardwareProfile, weight_read_bytes
from pipeline.model.w8a8_crossover import apply_measured_crossover, rows_to_load
from pipeline.perf.probe import cpu_flags, measure_bandwidth, probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--quant", default="auto", help="model.quant (auto: resolved from this machine's probe)")
    ap.add_argument("--batches", default="16,32,64,128,256")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128, help="the job's max_tokens (for the KV check)")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per batch size")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--within", type=float, default=WITHIN, help="suggest the smallest batch this close to the best")
    ap.add_argument("--compile", default="auto", help="engine.compile values to measure side by side, e.g. off,on")
    ap.add_argument("--lm-head", default=None, help="model.quant_lm_head values side by side (default: the choice's)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of every setting (the best counts)")
    args = ap.parse_args()
    path = args.model or default_model_path()
    batches = [int(b) for b in args.batches.split(",")]
    quant, rows, head, choice = args.quant, 16, "int8", None
    if quant == "auto":
        hw = probe()
        profile = HardwareProfile("cpu", hw.bandwidth, dict(hw.flops), hw.memory)
        base = load_model(path)
        choice = choose_quant(base.config, profile, "gguf" if str(path).endswith(".gguf") else "int4",
                              hw.weight_only_kernels, max(batches))
        quant, rows, head = choice.scheme, rows_to_load(choice, quant != "w8a8"), choice.lm_head
    settings = [(c, h) for c in args.compile.split(",") for h in (args.lm_head or head).split(",")]
    # one model per setting: compiling changes a model for good
    # as a job with model.quant=args.quant resolves model.kv_cache_dtype=auto and loads the model
    kv_dtype = getattr(torch, resolve_kv_dtype("auto", args.quant, "float32", "cpu"))
    speed = args.quant == "auto"
    models = {s: load_model(path, quant=quant, w8a8_rows=rows, quant_lm_head=s[1], kv_dtype=kv_dtype, prefer_speed=speed)
              for s in settings}
    loaded = models[settings[0]]
    if choice is not None and quant != "w8a8":  # as a job on a probed CPU: the W8A8 and W4A8 switches timed
        for model in models.values():
            measured, crossover = apply_measured_crossover(choice, model.model, max(batches))
        rows = measured.w8a8_rows
        print(f"measured: {crossover.describe()}")
    print(f"cpu flags: {cpu_flags()}; load {os.getloadavg()[0]:.1f}; threads {torch.get_num_threads()}; "
          f"model.quant={quant} (W8A8 {'at every step' if quant == 'w8a8' else f'from {rows} rows'}, "
          f"KV cache {str(kv_dtype).removeprefix('torch.')}); "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    config = EngineConfig(kv_cache_memory=args.kv_cache_memory)
    capacity = config.kv_cache_bytes // kv_bytes_per_block(loaded.model, config.block_size) * config.block_size
    rates = {}
    # the weight-only steps' reads: layers at the scheme's precision, the head in int8 (auto's compact head)
    weights = WEIGHT_ONLY_PRECISION.get(quant)
    step_bytes = weight_read_bytes(loaded.config, weights, "int8") if weights else None
    for batch in batches:
        for round_ in range(args.rounds):
            for compile_, lm_head in settings:
                engine = Engine(models[compile_, lm_head], EngineConfig(
                    kv_cache_memory=args.kv_cache_memory, max_batch_size=batch, max_batched_tokens=4096,
                    compile=compile_))
                rate = decode_rate(engine, batch, args.prompt_len, args.steps)
                rates[batch] = max(rates.get(batch, 0.0), rate)
                line = (f"batch {batch:4d}, round {round_}, engine.compile={compile_}, LM head {lm_head}: "
                        f"{1e3 * batch / rate:7.1f} ms/step  {rate:7.1f} tok/s")
                if step_bytes and (rows is None or batch < rows):
                    triad = measure_bandwidth()
                    ceiling = batch * triad / step_bytes
                    line += (f"; {100 * rate / ceiling:.0f}% of the bandwidth ceiling {ceiling:.1f} tok/s "
                             f"({step_bytes / 1e6:.0f} MB a step / triad {triad / 1e9:.1f} GB/s, measured now)")
                print(line, flush=True)
    fits = {b for b in batches if b * (args.prompt_len + args.max_tokens) <= capacity}
    if not fits:
        print("no measured batch fits the KV budget")
        return
    best = max(rates[b] for b in fits)
    suggested = pick({b: rates[b] for b in fits}, args.within)
    print(f"suggested engine.max_batch_size={suggested}: {rates[suggested]:.1f} tok/s, within {100 * args.within:.0f}% "
          f"of the best {best:.1f} among batches whose KV cache fits {args.kv_cache_memory}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
