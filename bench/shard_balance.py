"""How evenly `runtime.num_shards` splits the work, and how much shared-prefix reuse the split costs.

For an input it builds the job's WorkPlan (windows of `window_rows` rows in listing order, each put in
prefix order and cut into units of `rows_per_part`), gives every shard its `shard_units`, and prints:

- rows per shard (min / max / mean) and units per shard;
- prefix reuse: the distinct prefix-tree tokens (the least prefill any order can do, `unique_prefix_tokens`)
  of the whole input, against the sum over shards; the excess is prefill a shard must redo because rows
  sharing a prefix landed in another shard. A round-robin split (row i -> shard i % N) is shown beside it
  as the baseline a naive splitter would give.

Inputs: the sample shards (tokenized with the real model's tokenizer and chat template, `messages` column)
and a synthetic listing of prompts: a Zipf-distributed choice of 64 shared prefixes (system prompt plus
few-shot examples, 200-1,000 tokens) followed by a random question (8-60 tokens).

    python bench/shard_balance.py                       # sample + 100k synthetic rows, 8 shards
    python bench/shard_balance.py --rows 1000000 --shards 64 --rows-per-part 2000 --window-rows 100000
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import time
from collections.abc import Sequence

from pipeline.plan.prefix import prefix_order, unique_prefix_tokens
from pipeline.plan.units import InputFile, WorkPlan


def _window_orders(plan: WorkPlan, tokens: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    orders = {}
    for w in range(plan.num_windows):
        lo = w * plan.window_rows
        orders[w] = [lo + j for j in prefix_order([tokens[i] for i in range(lo, lo + plan.window_size(w))])]
    return orders


def split_by_plan(plan: WorkPlan, tokens: Sequence[Sequence[int]], num_shards: int) -> list[list[int]]:
    """Row indices (in listing order) of each shard: the plan's windows in prefix order, cut into units."""
    orders = _window_orders(plan, tokens)
    rows: list[list[int]] = [[] for _ in range(num_shards)]
    for shard in range(num_shards):
        for unit in plan.shard_units(num_shards, shard):
            rows[shard].extend(orders[unit.window][unit.start:unit.stop])
    return rows


def report(name: str, plan: WorkPlan, tokens: Sequence[Sequence[int]], num_shards: int) -> dict:
    t0 = time.perf_counter()
    shards = split_by_plan(plan, tokens, num_shards)
    flat = sorted(i for s in shards for i in s)
    if flat != list(range(len(tokens))):
        raise AssertionError(f"{name}: shards do not cover every row exactly once")
    sizes = [len(s) for s in shards]
    units = [len(plan.shard_units(num_shards, s)) for s in range(num_shards)]
    whole = unique_prefix_tokens(tokens)
    planned = sum(unique_prefix_tokens([tokens[i] for i in s]) for s in shards)
    robin = sum(unique_prefix_tokens(tokens[s::num_shards]) for s in range(num_shards))
    return {
        "input": name,
        "rows": len(tokens),
        "shards": num_shards,
        "window_rows": plan.window_rows,
        "rows_per_part": plan.rows_per_part,
        "units": plan.num_units,
        "rows_per_shard_min": min(sizes),
        "rows_per_shard_max": max(sizes),
        "rows_per_shard_mean": len(tokens) / num_shards,
        "units_per_shard_min": min(units),
        "units_per_shard_max": max(units),
        "prompt_tokens": sum(len(t) for t in tokens),
        "unique_prefix_tokens_unsharded": whole,
        "unique_prefix_tokens_sharded": planned,
        "prefix_excess_pct": 100.0 * (planned - whole) / whole,
        "unique_prefix_tokens_round_robin": robin,
        "round_robin_excess_pct": 100.0 * (robin - whole) / whole,
        "seconds": time.perf_counter() - t0,
    }


def sample_tokens(pattern: str) -> tuple[list[InputFile], list[list[int]]]:
    """The sample's `messages` rendered with the chat template and tokenized, in listing order."""
    import os

    import pyarrow.parquet as pq

    from pipeline.model.loader import default_model_path
    from pipeline.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path())
    files, texts = [], []
    for path in sorted(glob.glob(pattern)):
        table = pq.read_table(path, columns=["messages"])
        files.append(InputFile(path, os.path.getsize(path), table.num_rows))
        for messages in table.column("messages").to_pylist():
            messages = json.loads(messages) if isinstance(messages, str) else messages
            texts.append(tokenizer.apply_chat_template(messages))
    if not files:
        raise SystemExit(f"no input files match {pattern!r}")
    return files, tokenizer.encode_batch(texts)


def synthetic_tokens(rows: int, files: int, seed: int = 0) -> tuple[list[InputFile], list[list[int]]]:
    """Prompts sharing one of 64 prefixes (Zipf-like popularity), each with its own question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 49152) for _ in range(rng.randrange(200, 1001))] for _ in range(64)]
    weights = [1.0 / (k + 1) for k in range(len(systems))]
    chosen = rng.choices(range(len(systems)), weights, k=rows)
    tokens = [systems[g] + [rng.randrange(3, 49152) for _ in range(rng.randrange(8, 61))] for g in chosen]
    listing = [InputFile(f"synthetic-{i:03d}.parquet", 0, rows * (i + 1) // files - rows * i // files)
               for i in range(files)]
    return listing, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000, help="synthetic rows")
    parser.add_argument("--files", type=int, default=10, help="synthetic input files")
    parser.add_argument("--window-rows", type=int, default=None,
                        help="rows put in prefix order together; default: rows_per_part, as pipeline/job.py does")
    parser.add_argument("--rows-per-part", type=int, default=1_000)
    parser.add_argument("--sample", default="data/sample/*.parquet")
    parser.add_argument("--sample-rows-per-part", type=int, default=10,
                        help="the sample has only 200 rows: smaller units so that 8 shards all get work")
    parser.add_argument("--json", action="store_true", help="one JSON object per input instead of a table")
    args = parser.parse_args()

    results = []
    files, tokens = sample_tokens(args.sample)
    window = args.window_rows or args.sample_rows_per_part
    results.append(report("sample", WorkPlan(tuple(files), window, args.sample_rows_per_part), tokens, args.shards))
    files, tokens = synthetic_tokens(args.rows, args.files)
    window = args.window_rows or args.rows_per_part
    results.append(report(f"synthetic {args.rows}", WorkPlan(tuple(files), window, args.rows_per_part),
                          tokens, args.shards))
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        print(f"{r['input']}: {r['rows']} rows, {r['shards']} shards, window_rows={r['window_rows']}, "
              f"rows_per_part={r['rows_per_part']} -> {r['units']} units")
        print(f"  rows per shard: min {r['rows_per_shard_min']}, max {r['rows_per_shard_max']}, "
              f"mean {r['rows_per_shard_mean']:.1f}; units per shard {r['units_per_shard_min']}-"
              f"{r['units_per_shard_max']}")
        print(f"  distinct prefix tokens: unsharded {r['unique_prefix_tokens_unsharded']}, "
              f"plan's shards {r['unique_prefix_tokens_sharded']} (+{r['prefix_excess_pct']:.2f}%), "
              f"round-robin {r['unique_prefix_tokens_round_robin']} (+{r['round_robin_excess_pct']:.2f}%) "
              f"of {r['prompt_tokens']} prompt tokens")


if __name__ == "__main__":
    main()
