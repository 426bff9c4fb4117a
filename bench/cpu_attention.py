"""CPU attention: the native kernel (float32, bfloat16 and int8 pools) against torch's path, side by side.

Two measurements at SmolLM2's attention shape (9 query heads, 3 KV heads, head size 64, blocks of 16):
- decode: one query row per sequence over its ~`--context` keys, summed over `--layers` layers whose pools
  are scattered blocks of one large pool each (the layout a long job leaves), so keys come from DRAM;
- prefill: one sequence's chunk of n queries over n + (earlier keys), where the native kernel runs a row per
  query and torch's path one causal pass.

    OMP_WAIT_POLICY=PASSIVE python bench/cpu_attention.py --batches 64,128 --context 130
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pipeline.engine.runner import PagedAttention, StepBatch
from pipeline.perf.probe import cpu_flags

HQ, HKV, DIM, BLOCK = 9, 3, 64, 16


def attention(kv_dtype: torch.dtype, native: bool, layers: int, num_blocks: int) -> PagedAttention:
    attn = PagedAttention(layers, num_blocks, BLOCK, HKV, DIM, kv_dtype, torch.device("cpu"), DIM**-0.5,
                          native_group=HQ // HKV if native else None)
    if native and attn.native is None:
        raise SystemExit("the native kernel is unavailable here (see the log)")
    for pool in (*attn.k, *attn.v):
        if pool.dtype == torch.int8:
            pool.copy_(torch.randint(-127, 128, pool.shape, dtype=torch.int8))
        else:
            pool.normal_()
    for scales in attn.scales.values():  # int8 pools: a vector's max |x| / 127, for unit-variance vectors
        for pool in scales:
            pool.fill_(3 / 127)
    return attn


def step(tables: torch.Tensor, lens: torch.Tensor, new: torch.Tensor) -> StepBatch:
    """Sequence b computes its last new[b] positions of lens[b] this step."""
    starts = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)])
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lens.tolist(), new.tolist())])
    rows = torch.repeat_interleave(torch.arange(len(lens)), new)
    slots = tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    return StepBatch(input_ids=torch.zeros(len(positions), dtype=torch.long), positions=positions,
                     slot_mapping=slots, query_start=starts, context_lens=lens, block_tables=tables,
                     num_decodes=int((new == 1).sum()), logits_rows=torch.zeros(0, dtype=torch.long))


def seconds(attn: PagedAttention, batch: StepBatch, reps: int) -> float:
    """Mean time of a step's attention over all layers (prepare once, then every layer), after a warm-up."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch.num_tokens, HQ, DIM, generator=g)
    k, v = torch.randn(batch.num_tokens, HKV, DIM, generator=g), torch.randn(batch.num_tokens, HKV, DIM, generator=g)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        attn.prepare(batch)
        for layer in range(len(attn.k)):
            attn.attend(layer, q, k, v)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--context", type=int, default=130, help="decode: mean keys per sequence (+-20)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--chunks", default="16,64,128,512", help="prefill: queries per chunk")
    ap.add_argument("--earlier", default="0,2048", help="prefill: keys before the chunk")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(f"cpu flags: {cpu_flags()}; load {os.getloadavg()[0]:.1f}; threads {torch.get_num_threads()}; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    cases = [("torch", torch.float32, False), ("native", torch.float32, True), ("native", torch.bfloat16, True),
             ("native", torch.int8, True)]
    g = torch.Generator().manual_seed(1)
    for batch in (int(b) for b in args.batches.split(",")):
        width = args.context // BLOCK + 3
        lens = args.context + torch.randint(-20, 21, (batch,), generator=g)
        num_blocks = batch * width + 16
        tables = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width)  # scattered
        times = {}
        for name, dtype, native in cases:
            attn = attention(dtype, native, args.layers, num_blocks)
            times[name, dtype] = seconds(attn, step(tables, lens, torch.ones(batch, dtype=torch.long)), args.reps)
        base = times["torch", torch.float32]
        print(f"decode batch {batch}, ~{args.context} keys, {args.layers} layers: " + "  ".join(
            f"{name} {str(dtype).removeprefix('torch.')} {1e3 * t:.1f} ms ({base / t:.2f}x)"
            for (name, dtype), t in times.items()), flush=True)
    for earlier in (int(e) for e in args.earlier.split(",")):
        for chunk in (int(c) for c in args.chunks.split(",")):
            total = earlier + chunk
            tables = torch.arange(-(-total // BLOCK))[None]
            batch = step(tables, torch.tensor([total]), torch.tensor([chunk]))
            times = {(name, dtype): seconds(attention(dtype, native, 1, tables.shape[1]), batch, args.reps)
                     for name, dtype, native in cases[:2]}
            base = times["torch", torch.float32]
            print(f"prefill chunk {chunk} after {earlier} keys, one layer: torch {1e3 * base:.2f} ms  "
                  f"native {1e3 * times['native', torch.float32]:.2f} ms ({base / times['native', torch.float32]:.2f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
