"""Throughput cost of constrained decoding: the same engine run with and without a JSON schema per row.

    python bench/constrained.py                         # SmolLM2 (GGUF), 64 rows at batch 64, 48 tokens
    python bench/constrained.py --rows 8 --max-tokens 8 # a smoke run

Every row generates exactly `--max-tokens` tokens in both runs, so they do the same model work: greedy,
EOS ignored, and the schema asks for more array items than fit (`minItems`), so no row completes it early
(constrained rows end `incomplete`). The difference is the masks: computed during the forward pass,
applied in the sampler. Prints generated tokens/s of each, the slowdown, the engine's sampling time and
the load average. Each run follows a warm-up of its own kind.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.loader import load_model

# Short records, more of them than any row can write: every row runs to max_tokens.
SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}, "required": ["name", "age"],
    "additionalProperties": False}}


def run(lm, prompts: list[list[int]], sampling: SamplingParams, batch: int) -> tuple[float, int, float]:
    """(seconds, generated tokens, engine sampling seconds) of one run over all prompts."""
    engine = Engine(lm, EngineConfig(max_batch_size=batch, kv_cache_memory="1GiB", prefix_caching=False))
    start = time.perf_counter()
    tokens = sum(r.completion_tokens for r in engine.generate(Request(i, p, sampling) for i, p in enumerate(prompts)))
    return time.perf_counter() - start, tokens, engine.stats.sampling_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2 GGUF)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    lm = load_model(args.model)
    prompts = [lm.tokenizer.encode(f"List {i % 7 + 2} people as JSON records with a name and an age.")
               for i in range(args.rows)]
    base = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, json_schema=json.dumps(SCHEMA))
    run(lm, prompts[:2], base, args.batch)  # warm-ups: first allocations; tokenizer tables, grammar compile
    plain_s, plain_tokens, plain_sampling = run(lm, prompts, base, args.batch)
    run(lm, prompts[:2], constrained, args.batch)
    json_s, json_tokens, json_sampling = run(lm, prompts, constrained, args.batch)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rows} rows, batch {args.batch}, "
          f"{args.max_tokens} tokens each")
    print(f"unconstrained: {plain_tokens / plain_s:8.1f} tokens/s (sampling {plain_sampling:.2f} s of {plain_s:.2f} s)")
    print(f"json_schema:   {json_tokens / json_s:8.1f} tokens/s (sampling {json_sampling:.2f} s of {json_s:.2f} s)")
    print(f"slowdown: {100 * (json_s / json_tokens) / (plain_s / plain_tokens) - 100:+.1f}%")


if __name__ == "__main__":
    main()
