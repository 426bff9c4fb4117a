"""Single-sequence prefill and decode speed of the model, and the weight bytes one decode step reads.

    python bench/decode.py                     # default model (SmolLM2 GGUF), float32 and bfloat16
    python bench/decode.py --batch 64          # also a decode step over 64 sequences at once
    python bench/decode.py --profile           # plus the top operators of one decode step

Prints one line per dtype with prefill tokens/s, decode tokens/s, weight bytes per token and the memory
bandwidth that implies; records the load average, since the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.model.loader import LoadedModel, load_model  # noqa: E402
from pipeline.stopwatch import best_seconds  # noqa: E402
from tests.reference import ContiguousKVCache, SequenceCaches  # noqa: E402  (the plain contiguous caches)


@torch.inference_mode()
def prefill_seconds(lm: LoadedModel, ids: torch.Tensor, repeats: int) -> float:
    model = lm.model

    def run():
        cache = ContiguousKVCache(model.config.num_layers, model.scale)
        model.compute_logits(model(ids, torch.arange(len(ids)), cache)[-1:])

    return best_seconds(run, repeats)


@torch.inference_mode()
def prefilled(lm: LoadedModel, context: int, batch: int) -> SequenceCaches:
    """Caches of `batch` sequences holding `context` tokens each, selected for a one-token decode step."""
    attn = SequenceCaches(lm.model, batch)
    for b in range(batch):
        attn.select([b], [context])
        lm.model(torch.arange(100 + b, 100 + b + context), torch.arange(context), attn)
    attn.select(range(batch), [1] * batch)
    return attn


@torch.inference_mode()
def decode_steps(lm: LoadedModel, attn: SequenceCaches, first_position: int, steps: int) -> float:
    """Seconds per decode step (forward of one token per sequence + logits + argmax)."""
    batch = len(attn.caches)
    tokens = torch.full((batch,), 5)
    t = time.perf_counter()
    for i in range(steps):
        positions = torch.full((batch,), first_position + i)
        tokens = lm.model.compute_logits(lm.model(tokens, positions, attn)).argmax(-1)
    return (time.perf_counter() - t) / steps


def decode_seconds_per_step(lm: LoadedModel, context: int, steps: int, batch: int) -> float:
    attn = prefilled(lm, context, batch)
    decode_steps(lm, attn, context, 2)  # warm-up: allocator, caches
    return decode_steps(lm, attn, context + 2, steps)


def profile_step(lm: LoadedModel, batch: int, context: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    attn = prefilled(lm, context, batch)
    decode_steps(lm, attn, context, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_steps(lm, attn, context + 1, 4)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2)"
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument(
        "--batch", type=int, default=0, help="also time one decode step over this many sequences"
    )
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average {os.getloadavg()[0]:.1f}"
    )
    for name in args.dtypes:
        lm = load_model(args.model, dtype=getattr(torch, name))
        ids = torch.arange(1000, 1000 + args.prompt_len)
        prefill = prefill_seconds(lm, ids, repeats=3)
        step = decode_seconds_per_step(lm, args.prompt_len, args.decode_steps, batch=1)
        per_token = lm.bytes_read_per_token
        print(
            f"{lm.name} {name}: prefill {args.prompt_len / prefill:8.1f} tok/s | decode {1 / step:6.1f} tok/s "
            f"({step * 1e3:.1f} ms/step) | weights read/token {per_token / 1e6:.1f} MB "
            f"-> {per_token / step / 1e9:.1f} GB/s | weights in memory {lm.weight_bytes / 1e6:.1f} MB"
        )
        if args.batch:
            step_b = decode_seconds_per_step(lm, args.prompt_len, max(4, args.decode_steps // 8), args.batch)
            print(f"    batch {args.batch}: {step_b * 1e3:.1f} ms/step = {args.batch / step_b:.1f} tok/s")
        if args.profile:
            for batch in (1, args.batch) if args.batch else (1,):
                print(f"--- profile of decode steps at batch {batch} ({name})")
                profile_step(lm, batch, args.prompt_len)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
