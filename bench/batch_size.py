"""Decode throughput by running batch size, measured on this machine, and the batch it suggests.

    OMP_WAIT_POLICY=PASSIVE python bench/batch_size.py --quant auto --batches 16,32,64,128,256
    OMP_WAIT_POLICY=PASSIVE python bench/batch_size.py --quant w8a8 --batches 64 --compile off,on  # side by side

For each batch size B: B distinct ~`--prompt-len`-token prompts are prefilled, then `--steps` decode steps
with all B sequences running are timed (attending over about prompt + `--context-extra` positions, the
middle of a completion). Prints ms per step and generated tok/s, and suggests `engine.max_batch_size`: the
smallest B within `--within` of the best tok/s whose KV cache (B x (prompt + --max-tokens) positions) fits
`--kv-cache-memory`. Why measured: past the ridge point a CPU step is compute bound and the roofline says a
bigger batch gains nothing, but per-step costs that do not grow with B (Python, dispatch, guards) and
attention (which does) move the best batch, by machine and quantization.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kernels.wq_cpu import native_bf16
from pipeline.config import resolve_kv_dtype
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.engine.runner import kv_bytes_per_block
from pipeline.model.loader import default_model_path, load_model
from pipeline.perf.probe import cpu_flags, probe
from pipeline.perf.quant_choice import choose_quant
from pipeline.perf.roofline import HardwareProfile


def step_seconds(loaded, batch: int, prompt_len: int, context_extra: int, steps: int, kv: str,
                 compile: str) -> float:
    """Seconds per decode step with `batch` sequences running at about prompt_len + context_extra positions."""
    engine = Engine(loaded, EngineConfig(kv_cache_memory=kv, max_batch_size=batch, max_batched_tokens=4096,
                                         compile=compile))
    sp = SamplingParams(max_tokens=context_extra + steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(Request(i, [100 + (7 * i + j) % 20000 for j in range(prompt_len)], sp))
    while engine.scheduler.waiting or min(s.num_output_tokens for s in engine.scheduler.running) < context_extra:
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--quant", default="auto", help="model.quant (auto: resolved from this machine's probe)")
    ap.add_argument("--batches", default="16,32,64,128,256")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--context-extra", type=int, default=64, help="tokens generated before the timed steps")
    ap.add_argument("--max-tokens", type=int, default=128, help="the job's max_tokens (for the KV check)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--within", type=float, default=0.05, help="suggest the smallest batch this close to the best")
    ap.add_argument("--compile", default="auto", help="engine.compile values to measure side by side, e.g. off,on")
    args = ap.parse_args()
    path = args.model or default_model_path()
    batches = [int(b) for b in args.batches.split(",")]
    quant, rows, head = args.quant, 16, "bf16" if native_bf16() else "int8"
    if quant == "auto":
        hw = probe()
        profile = HardwareProfile("cpu", hw.bandwidth, dict(hw.flops), hw.memory)
        base = load_model(path)
        choice = choose_quant(base.config, profile, "gguf" if str(path).endswith(".gguf") else "int4",
                              hw.bf16_native, max(batches))
        quant, rows, head = choice.scheme, choice.w8a8_rows, choice.lm_head
    settings = args.compile.split(",")
    # one model per setting: compiling changes a model for good
    kv_dtype = getattr(torch, resolve_kv_dtype("auto", quant, "float32", "cpu"))  # as the job's model.kv_cache_dtype=auto
    models = {c: load_model(path, quant=quant, w8a8_rows=rows, quant_lm_head=head, kv_dtype=kv_dtype) for c in settings}
    loaded = models[settings[0]]
    print(f"cpu flags: {cpu_flags()}; load {os.getloadavg()[0]:.1f}; threads {torch.get_num_threads()}; "
          f"model.quant={quant} (W8A8 {'at every step' if quant == 'w8a8' else f'from {rows} rows'}, "
          f"LM head {head}, KV cache {str(kv_dtype).removeprefix('torch.')}); "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    config = EngineConfig(kv_cache_memory=args.kv_cache_memory)
    capacity = config.kv_cache_bytes // kv_bytes_per_block(loaded.model, config.block_size) * config.block_size
    rates = {}
    for batch in batches:
        for setting in settings:
            seconds = step_seconds(models[setting], batch, args.prompt_len, args.context_extra, args.steps,
                                   args.kv_cache_memory, setting)
            rates[batch] = max(rates.get(batch, 0.0), batch / seconds)
            print(f"batch {batch:4d}, engine.compile={setting}: {1e3 * seconds:7.1f} ms/step  "
                  f"{batch / seconds:7.1f} tok/s", flush=True)
    fits = {b for b in batches if b * (args.prompt_len + args.max_tokens) <= capacity}
    best = max(rates[b] for b in fits) if fits else None
    if best is None:
        print("no measured batch fits the KV budget")
        return
    pick = min(b for b in fits if rates[b] >= (1 - args.within) * best)
    print(f"suggested engine.max_batch_size={pick}: {rates[pick]:.1f} tok/s, within {100 * args.within:.0f}% "
          f"of the best {best:.1f} among batches whose KV cache fits {args.kv_cache_memory}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
