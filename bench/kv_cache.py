"""KV cache dtypes on SmolLM2: what a float32, bfloat16 or int8 cache does to the model's outputs.

Teacher-forced perplexity through the engine (`prompt_logprobs`: every prompt position's log-probability
of the next token, with the prompt's keys and values read back from the cache), on held-out text (bench/quant.py's
standard-library docstrings, in `--pieces` prompts of `--tokens` tokens), and how far each prompt's
greedy continuation matches the float32 cache's. Speed: `bench/cpu_attention.py` (the attention alone)
and `bench/throughput.py --modes auto,auto/bfloat16` (whole jobs).

    python bench/kv_cache.py --quant w8a8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant import TEXT_MODULES, docstrings  # noqa: E402

from pipeline.engine.config import EngineConfig  # noqa: E402
from pipeline.engine.engine import Engine  # noqa: E402
from pipeline.engine.request import Request, SamplingParams  # noqa: E402
from pipeline.model.loader import default_model_path, load_model  # noqa: E402
from pipeline.perf.probe import cpu_flags  # noqa: E402

KV_DTYPES = ("float32", "bfloat16", "int8")


def run(kv: str, args) -> tuple[float, dict[int, list[int]]]:
    """(perplexity over the pieces, each piece's greedy continuation) with a `kv` cache."""
    rows = args.rows if args.quant != "none" else None
    loaded = load_model(args.model or default_model_path(), torch.float32, quant=args.quant, w8a8_rows=rows,
                        kv_dtype=getattr(torch, kv))
    ids = loaded.tokenizer.encode("\n\n".join(docstrings(TEXT_MODULES)))
    pieces = [ids[i : i + args.tokens] for i in range(0, args.pieces * args.tokens, args.tokens)]
    engine = Engine(loaded, EngineConfig(kv_cache_memory="1GiB", max_batch_size=len(pieces)))
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, prompt_logprobs=1)
    out = {r.id: r for r in engine.generate(Request(i, p, sp) for i, p in enumerate(pieces))}
    nll, count = 0.0, 0
    for i, piece in enumerate(pieces):
        for pos, logprobs in enumerate(out[i].prompt_logprobs):
            if logprobs is not None:  # the first position has no prediction
                nll -= logprobs[piece[pos]]
                count += 1
    return math.exp(nll / count), {i: r.token_ids for i, r in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--quant", default="w8a8", help="model.quant of every run (none: the exact float32 model)")
    ap.add_argument("--rows", type=int, default=16, help="model.quant_w8a8_rows for weight-only schemes")
    ap.add_argument("--pieces", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    print(f"cpu flags: {cpu_flags()}; load {os.getloadavg()[0]:.1f}; quant {args.quant}; "
          f"{args.pieces} x {args.tokens} held-out tokens, {args.new_tokens} greedy tokens each")
    results = {kv: run(kv, args) for kv in KV_DTYPES}
    ref_ppl, ref_tokens = results["float32"]
    for kv, (ppl, tokens) in results.items():
        first_diff = [next((j for j, (a, b) in enumerate(zip(ref_tokens[i], t)) if a != b), len(t))
                      for i, t in tokens.items()]
        print(f"{kv:9s} perplexity {ppl:8.3f} ({100 * (ppl / ref_ppl - 1):+.2f}%)  greedy tokens before the first "
              f"difference from float32: {first_diff}", flush=True)


if __name__ == "__main__":
    main()
