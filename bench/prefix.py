"""Prefix reuse through the whole job: prefix sorting + prefix caching on vs both off, in one run.

Workload (issue 5): `--systems` system prompts of ~`--system-tokens` tokens x `--questions` short questions
each, shuffled, `--max-tokens` new tokens, greedy float32 on SmolLM2-135M (or `--model`). Each configuration
runs the real job (`pipeline.job.run`: Parquet in, parts out) on the same input; the bench prints the
computed prompt tokens against two bounds and the generate-time ratio, and checks that the outputs are
identical token for token.

- lower bound: distinct prefix-tree nodes of the prompts (the least prefill any order can do);
- block bound: what a perfect cache of whole blocks of `engine.block_size` tokens computes (each row
  recomputes the part of its shared prefix after the last full block). The engine also copies the
  matching head of a partly shared block, so it can go below this; above it means admission recomputed
  a prefix another row was computing (or preemption recomputed it).

    python bench/prefix.py                 # 8 x 32 rows, 300-token system prompts, 64 new tokens
    python bench/prefix.py --small         # 4 x 12 rows, 32 new tokens (a few minutes on 2 busy cores)
    python bench/prefix.py --block-sizes 16,4,1   # "on" once per block size
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.job import run
from pipeline.perf.roofline_cli import compose_job, read_model
from pipeline.plan.prefix import common_prefix_len, prefix_order, unique_prefix_tokens

WORDS = ("answer", "question", "careful", "always", "never", "policy", "customer", "refund", "shipping", "order",
         "polite", "brief", "detail", "explain", "summary", "account", "warranty", "return", "invoice", "support")
PRESETS = {"full": (8, 32, 300, 64), "small": (4, 12, 300, 32)}


def system_prompt(tokenizer, k: int, target: int) -> str:
    """A deterministic system prompt of about `target` tokens."""
    rng = random.Random(k)
    text = f"You are assistant number {k}. Follow these rules."
    while len(tokenizer.encode(text)) < target:
        text += f" Rule {rng.randrange(100)}: " + " ".join(rng.choice(WORDS) for _ in range(8)) + "."
    return text


def workload(tokenizer, systems: int, questions: int, system_tokens: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    rows = [[{"role": "system", "content": system_prompt(tokenizer, s, system_tokens)},
             {"role": "user", "content": f"What is {rng.randrange(1000)} plus {rng.randrange(1000)}?"}]
            for s in range(systems) for _ in range(questions)]
    rng.shuffle(rows)
    return rows


def block_bound(seqs: list[list[int]], block_size: int) -> int:
    """Prompt tokens a perfect block-granular prefix cache computes: each row reuses the whole blocks it
    shares with an earlier row (in sorted order the longest shared prefix is with the predecessor), and
    at least its last token is computed."""
    order = [seqs[i] for i in prefix_order(seqs)]
    total = 0
    for prev, seq in zip([[]] + order, order):
        reuse = min(common_prefix_len(prev, seq), len(seq) - 1) // block_size * block_size
        total += len(seq) - reuse
    return total


def outputs(path: Path) -> dict:
    rows = [r for p in sorted(path.glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    return {r["id"]: r["token_ids"] for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="4 system prompts x 12 questions, 32 new tokens")
    ap.add_argument("--systems", type=int)
    ap.add_argument("--questions", type=int)
    ap.add_argument("--system-tokens", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--block-sizes", default="16", help="engine.block_size of the 'on' runs, comma-separated")
    ap.add_argument("--model", help="model.path (default: the SmolLM2 GGUF)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("overrides", nargs="*", help="more job keys for every run, e.g. engine.max_batch_size=32")
    args = ap.parse_args()
    preset = PRESETS["small" if args.small else "full"]
    systems, questions, system_tokens, max_tokens = (
        v if v is not None else d
        for v, d in zip((args.systems, args.questions, args.system_tokens, args.max_tokens), preset))
    _, tokenizer_loader = read_model(args.model)
    tokenizer = tokenizer_loader()
    rows = workload(tokenizer, systems, questions, system_tokens)
    seqs = [tokenizer.encode(tokenizer.apply_chat_template(m)) for m in rows]
    work = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    pq.write_table(pa.table({"id": list(range(len(rows))), "messages": [json.dumps(m) for m in rows]}),
                   work / "in.parquet")
    common = [f"input.path={work / 'in.parquet'}", "input.messages_column=messages", "output.token_ids=true",
              f"sampling.max_tokens={max_tokens}", "sampling.ignore_eos=true", "progress.mode=off",
              *([f"model.path={args.model}"] if args.model else []), *args.overrides]
    runs = [("off", ["engine.prefix_caching=false", "plan.prefix_sort=false"], 16)]
    runs += [(f"on, block {bs}", ["engine.prefix_caching=true", "plan.prefix_sort=true", f"engine.block_size={bs}"],
              bs) for bs in map(int, args.block_sizes.split(","))]
    print(f"{len(rows)} rows ({systems} system prompts of ~{system_tokens} tokens x {questions} questions, "
          f"shuffled), {max_tokens} new tokens; prompt tokens {sum(map(len, seqs)):,}, lower bound "
          f"{unique_prefix_tokens(seqs):,}; load average {os.getloadavg()[0]:.1f}", flush=True)
    results, reference = [], None
    for name, keys, bs in runs:
        out = work / name.replace(", ", "-").replace(" ", "")
        t0 = time.perf_counter()
        m = run(compose_job([*common, f"output.path={out}", *keys]), stdout=io.StringIO())
        got = outputs(out)
        reference = reference or got
        results.append({
            "run": name, "computed_prompt_tokens": m["computed_prompt_tokens"],
            "cached_tokens": m["cached_tokens"], "lower_bound": m["prefill_lower_bound_tokens"],
            "block_bound": block_bound(seqs, bs) if "on" in name else sum(map(len, seqs)),
            "computed_over_lower_bound": m["computed_prompt_tokens"] / m["prefill_lower_bound_tokens"],
            "generate_s": m["generate_time_s"], "wall_s": time.perf_counter() - t0,
            "held": m["engine"]["held"], "preemptions": m["preemptions"], "evictions": m["evictions"],
            "same_outputs": got == reference, "load_average": os.getloadavg()[0],
        })
        r = results[-1]
        print(f"{name:>12}: computed {r['computed_prompt_tokens']:,} prompt tokens = "
              f"{r['computed_over_lower_bound']:.3f} x lower bound (block bound {r['block_bound']:,}), "
              f"generate {r['generate_s']:.1f} s, held {r['held']}, preemptions {r['preemptions']}, "
              f"outputs identical: {r['same_outputs']}, load {r['load_average']:.1f}", flush=True)
    for r in results[1:]:
        print(f"{r['run']}: {results[0]['generate_s'] / r['generate_s']:.2f}x shorter generate time than off")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
