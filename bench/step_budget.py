"""Where one decode step's time goes on this CPU, measured on a step captured from a real job.

A greedy job's decode step is timed whole, and beside it, in alternating rounds:
- its int8 GEMMs alone: the model's own W8A8 weights (body and LM head), each on the GEMM the model chose
  for it (`torch._int_mm` or oneDNN's packed GEMM), at the step's rows, the weights streaming from memory
  as in the step; and the same with every layer on the first layer's weights (in cache: what the weights'
  trips from memory cost the GEMMs);
- its attention as the step runs it (every layer's pools, so the keys and values come from DRAM);
- the same attention with every layer reading layer 0's pools (in cache: the kernel's arithmetic alone);
- the bytes the step's attention reads, at the probe's streaming bandwidth (the memory floor for them).
What is left of the step after GEMMs and attention is the fused elementwise loops, the graph calls and the
host work. Where the attention as run takes as long as its memory reads allow, a kernel change that cuts
only its arithmetic (the in-cache figure) does not show in jobs.

    python bench/step_budget.py --workload distinct --batch 128
    python bench/step_budget.py --workload shared --batch 128
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch
from throughput import load_mode, make_distinct_prompts, make_shared_prompts

from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.engine.runner import StepBatch, kv_bytes_per_block
from pipeline.model.loader import default_model_path, load_model
from pipeline.model.quant_choice import choose_quant
from pipeline.model.roofline import HardwareProfile
from pipeline.model.w8a8_gemm import gemm_pass, int8_parts
from pipeline.perf.probe import cpu_flags, probe
from pipeline.stopwatch import best_seconds


def captured_step(engine: Engine, prompts: list[list[int]], steps: int, adapters: list[str] = ()) -> StepBatch:
    """The batch of the engine's `steps`-th step over `prompts` (all admitted, none finishing); with
    `adapters`, the prompts run them round-robin (the engine's `lora` names them)."""
    for i, p in enumerate(prompts):
        adapter = adapters[i % len(adapters)] if adapters else None
        engine.add_request(Request(i, p, SamplingParams(max_tokens=steps + 64, ignore_eos=True), adapter=adapter))
    seen: list[StepBatch] = []
    execute = engine.runner.execute_greedy  # every row is plain greedy
    engine.runner.execute_greedy = lambda batch: seen.append(batch) or execute(batch)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        del engine.runner.execute_greedy
    return seen[-1]


def int8_gemms(model: torch.nn.Module, rows: int, one_layer: bool = False) -> tuple[Callable[[], None], float]:
    """The step's W8A8 products on the model's own int8 weights, each on the GEMM the model chose for it
    (`pipeline.model.w8a8_gemm`), and their operations (2 per multiply-add). one_layer: every layer's
    products on the first layer's weights (a few MB, read from cache after the first layer), the head's as
    they are: against the step's own weights, what streaming them from memory costs the GEMMs."""
    parts = int8_parts(model)
    if not parts:
        raise SystemExit("the model has no W8A8 weights: run with --quant auto (quantized) on a CPU with int8 peaks")
    layers = parts.get("layers", [])
    if one_layer and layers:
        layers = layers[: len(layers) // model.config.num_layers] * model.config.num_layers
    modules = layers + parts.get("lm_head", [])
    layouts = [m.int8_layout for m in modules]
    ops = sum(2.0 * rows * m.in_features * scales.shape[0] for m, (_, scales, _) in zip(modules, layouts))
    return gemm_pass(modules, rows, layouts), ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--workload", default="distinct", choices=["distinct", "shared"])
    ap.add_argument("--batch", type=int, default=128, help="sequences decoding together")
    ap.add_argument("--quant", default="auto", help="model.quant[/kv dtype], as bench/throughput.py's modes")
    ap.add_argument("--steps", type=int, default=60, help="engine steps before the captured one (contexts grow)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds; each figure is their median")
    ap.add_argument("--reps", type=int, default=3, help="calls per round; the fastest counts")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    args = ap.parse_args()

    hw = probe()
    path = args.model or default_model_path()
    base = load_model(path, torch.float32)
    profile = HardwareProfile("cpu", hw.bandwidth, dict(hw.flops), hw.memory)
    auto = choose_quant(base.config, profile, "gguf", hw.weight_only_kernels, args.batch)
    loaded = load_mode(path, torch.float32, args.quant, auto, 16, args.batch)
    prompts = (make_distinct_prompts(base.tokenizer, args.batch) if args.workload == "distinct"
               else make_shared_prompts(base.tokenizer, max(1, args.batch // 32), min(32, args.batch)))
    engine = Engine(loaded, EngineConfig(kv_cache_memory=args.kv_cache_memory, max_batch_size=args.batch))
    batch = captured_step(engine, prompts, args.steps)
    runner, attn, model = engine.runner, engine.runner.attn, loaded.model
    if batch.num_decodes != batch.num_tokens:
        raise SystemExit(f"the captured step still prefills ({batch.num_tokens} tokens for {batch.num_decodes} "
                         "decodes): raise --steps")

    cfg = model.config
    queries = torch.randn(batch.num_decodes, cfg.num_heads // model.tp.size, cfg.head_dim)
    layers = range(cfg.num_layers)
    blocks = int((batch.context_lens + attn.block_size - 1).div(attn.block_size, rounding_mode="floor").sum())
    kv_bytes = blocks * kv_bytes_per_block(model, attn.block_size)
    gemms, gemm_ops = int8_gemms(model, batch.num_decodes)
    gemms_in_cache, _ = int8_gemms(model, batch.num_decodes, one_layer=True)
    attention_seconds: list[float] = []

    def whole_step() -> None:
        before = attn.attention_seconds
        runner.execute_greedy(batch)
        attention_seconds.append(attn.attention_seconds - before)

    def attention(pools_of: Callable[[int], int]) -> Callable[[], None]:
        """Every layer's decode attention over the pools of layer pools_of(layer)."""
        def run() -> None:
            for layer in layers:
                i = pools_of(layer)
                attn._decode(queries, attn.k[i], attn.v[i], i)
        return run

    measured: dict[str, Callable[[], None]] = {
        "step": whole_step,
        "gemms": gemms,
        "gemms in cache": gemms_in_cache,
        "as run": attention(lambda layer: layer),
        "in cache": attention(lambda layer: 0),
    }
    rounds: dict[str, list[float]] = {name: [] for name in measured}
    for fn in measured.values():
        fn()
    for r in range(args.rounds):  # alternating order: this machine's speed drifts within minutes
        for name in (list(measured) if r % 2 == 0 else list(measured)[::-1]):
            rounds[name].append(best_seconds(measured[name], args.reps, warmup=False))
    ms = {name: statistics.median(v) * 1e3 for name, v in rounds.items()}
    in_step = statistics.median(attention_seconds) * 1e3

    print(f"cpu flags: {cpu_flags()}; threads {torch.get_num_threads()}; "
          f"load {os.getloadavg()[0]:.1f}; probe: int8 {hw.flops.get('int8', 0) / 1e9:.0f} GOP/s, "
          f"stream {hw.bandwidth / 1e9:.1f} GB/s")
    print(f"{args.workload}: {batch.num_decodes} decodes, contexts {int(batch.context_lens.min())}-"
          f"{int(batch.context_lens.max())} (mean {batch.context_lens.float().mean():.0f}), "
          f"KV cache {model.kv_dtype}, {args.rounds} rounds (median of each round's best of {args.reps})")
    rows = [
        ("whole step", ms["step"], f"{batch.num_decodes / ms['step'] * 1e3:.0f} tok/s"),
        ("int8 GEMMs alone", ms["gemms"], f"{gemm_ops / 1e9:.1f} GOP at {gemm_ops / ms['gemms'] / 1e6:.0f} GOP/s"),
        ("  one layer's weights, in cache", ms["gemms in cache"],
         f"{gemm_ops / ms['gemms in cache'] / 1e6:.0f} GOP/s: the weights' trips from memory cost "
         f"{ms['gemms'] - ms['gemms in cache']:.1f} ms"),
        ("attention inside the step", in_step, ""),
        ("attention, as run", ms["as run"], f"{kv_bytes / 1e6:.0f} MB of KV at {kv_bytes / ms['as run'] / 1e6:.1f} GB/s"),
        ("attention, pools in cache", ms["in cache"], "the arithmetic"),
        ("those bytes at the probe's rate", kv_bytes / hw.bandwidth * 1e3, "the memory floor"),
        ("rest: step - GEMMs - attention", ms["step"] - ms["gemms"] - in_step, "elementwise, graph calls, host"),
    ]
    for label, value, note in rows:
        print(f"  {label:32s} {value:7.1f} ms  {note}")

if __name__ == "__main__":
    main()
