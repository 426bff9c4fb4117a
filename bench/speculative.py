"""Speculative decoding against plain decoding, side by side: none, ngram (prompt lookup), draft.

    python bench/speculative.py                           # SmolLM2 float32; draft = SmolLM2 quantized int4
    python bench/speculative.py --rows 8 --max-tokens 16 --batch1 2    # a quick smoke run

Two workloads of `--rows` chat prompts each: copy-heavy ("rewrite this paragraph fixing the spelling", the
answer mostly copies the prompt) and chat (the bundled sample prompts). For each workload and method:

- batch 1: the first `--batch1` prompts one at a time; generated tokens per second (prefill included) and
  the share of guesses accepted;
- a job: all rows at `--batch` running sequences; total wall time, the tail phase (after 90% of the rows
  finished: the last 10% of rows) and the saturated phase (steps with `--batch` sequences running, ms/step);
- acceptance rate and accepted guesses per check; and whether the greedy tokens equal method none's.

First it prints the cost of a step that checks k guesses per sequence relative to a plain decode step, at
several batch sizes (`--cost-batches`): where that ratio stays near 1 a step is bound by reading the
weights and speculation is cheap; `speculative.max_batch` belongs below where it climbs.

Greedy, EOS honoured. Records the load average, since the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

import pyarrow.parquet as pq
import torch

from pipeline.engine.config import EngineConfig, SpeculativeConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.loader import default_model_path, load_model

SENTENCES = [
    "The committee met on Tuesday to discuss the budget for the coming year.",
    "Several members argued that the library needs longer opening hours.",
    "Others pointed out that the roof of the town hall has been leaking since spring.",
    "In the end they agreed to hire an independent surveyor before making any decision.",
    "The surveyor will report back to the committee at its next meeting in October.",
    "Residents are invited to send their comments by email or by letter.",
    "A summary of the discussion will be published on the council website.",
    "The chair thanked everyone for attending and closed the meeting at nine.",
]


def misspell(text: str, rng: random.Random, rate: float = 0.15) -> str:
    """Swap two inner letters in about `rate` of the longer words."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 4 and rng.random() < rate:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def copy_heavy_prompts(rows: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        paragraph = " ".join(rng.sample(SENTENCES, 4))
        out.append(f"Rewrite this paragraph fixing the spelling. Reply with the paragraph only.\n\n"
                   f"{misspell(paragraph, rng)}")
    return out


def chat_prompts(rows: int) -> list[str]:
    texts: list[str] = []
    for path in sorted(os.listdir("data/sample")):
        if path.endswith(".parquet"):
            texts += pq.read_table(os.path.join("data/sample", path), columns=["prompt"])["prompt"].to_pylist()
    return (texts * (rows // max(1, len(texts)) + 1))[:rows]


@dataclass
class JobTimes:
    wall_s: float
    tail_s: float  # after 90% of the rows finished
    saturated_ms_per_step: float  # mean step time while `batch` sequences ran (nan: never)
    tokens: dict
    generated: int
    acceptance: float
    mean_accepted: float


def run_job(engine: Engine, prompts: list[list[int]], sp: SamplingParams, batch: int) -> JobTimes:
    """Step the engine by hand to time phases: all rows queued at once, `batch` of them running."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(i, p, sp))
    done: dict[int, list[int]] = {}
    saturated: list[float] = []
    tail_start = None
    t0 = time.perf_counter()
    while engine.scheduler.has_work():
        full = len(engine.scheduler.running) >= batch
        t = time.perf_counter()
        for result in engine.step():
            done[result.id] = result.token_ids
        if full:
            saturated.append(time.perf_counter() - t)
        if tail_start is None and len(done) >= 0.9 * len(prompts):
            tail_start = time.perf_counter()
    end = time.perf_counter()
    s = engine.stats
    return JobTimes(end - t0, end - (tail_start or end), 1e3 * sum(saturated) / len(saturated) if saturated
                    else float("nan"), done, sum(map(len, done.values())), s.spec_acceptance_rate,
                    s.spec_mean_accepted)


class FixedGuesses:
    """A proposer that guesses k copies of token 1 (for timing: the guesses' content does not matter)."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, seqs, ks):
        return [[1] * min(self.k, k) for k in ks]

    def release(self, seq):
        pass


def check_cost(loaded, batch: int, k: int, context: int = 128, steps: int = 6) -> tuple[float, float]:
    """Seconds per step for `batch` decoding sequences: plain, and checking k guesses each."""
    spec = SpeculativeConfig(method="ngram", k=k, max_batch=batch, min_gain=0)  # gate always open
    engine = Engine(loaded, EngineConfig(kv_cache_memory="256MiB", max_batch_size=batch), speculative=spec)
    sp = SamplingParams(max_tokens=4 * steps * (k + 2), ignore_eos=True)
    for i in range(batch):
        engine.add_request(Request(i, [100 + (i + j) % 5000 for j in range(context)], sp))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for proposer in (FixedGuesses(0), FixedGuesses(k)):
        engine.proposer = proposer
        engine.step()  # warm-up at this shape
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times.append((time.perf_counter() - t) / steps)
    return times[0], times[1]


def batch1(make_engine, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, float]:
    """Generated tokens per second over the prompts run one at a time, and the share of guesses accepted."""
    tokens, seconds, proposed, accepted = 0, 0.0, 0, 0
    for i, p in enumerate(prompts):
        engine = make_engine()
        t = time.perf_counter()
        tokens += sum(len(r.token_ids) for r in engine.generate([Request(i, p, sp)]))
        seconds += time.perf_counter() - t
        proposed, accepted = proposed + engine.stats.spec_proposed, accepted + engine.stats.spec_accepted
    return tokens / seconds, accepted / proposed if proposed else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2)")
    parser.add_argument("--draft", default=None, help="draft model path (default: the model itself)")
    parser.add_argument("--draft-quant", default="int4", help="the draft's model.quant (none, int8, int4, gguf)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="engine.max_batch_size of the job")
    parser.add_argument("--batch1", type=int, default=8, help="prompts run one at a time")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--quant", default="none", help="the model's model.quant (none, int8, int4, gguf, w8a8)")
    parser.add_argument("--max-batch", type=int, default=256, help="speculative.max_batch")
    parser.add_argument("--min-gain", type=float, default=1.1, help="speculative.min_gain")
    parser.add_argument("--adaptive-k", action="store_true", help="speculative.adaptive_k")
    parser.add_argument("--methods", nargs="+", default=["none", "ngram", "draft"])
    parser.add_argument("--cost-batches", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    loaded = load_model(args.model, quant=args.quant, w8a8_rows=None if args.quant == "w8a8" else 16,
                        quant_lm_head="int8")
    draft = None
    if "draft" in args.methods:
        draft = load_model(args.draft or args.model or default_model_path(), quant=args.draft_quant).model
    tok = loaded.tokenizer
    for batch in args.cost_batches:
        plain, checking = check_cost(loaded, batch, args.k)
        print(f"batch {batch:3d}: decode step {plain * 1e3:7.1f} ms, checking {args.k} guesses each "
              f"{checking * 1e3:7.1f} ms ({checking / plain:.2f}x)", flush=True)
    sp = SamplingParams(max_tokens=args.max_tokens)
    config = EngineConfig(kv_cache_memory="2GiB", max_batch_size=args.batch)
    alone = EngineConfig(kv_cache_memory="256MiB", max_batch_size=1)
    print(f"model {loaded.name}; draft {'same checkpoint' if args.draft is None else args.draft} "
          f"quant={args.draft_quant}; k={args.k}, adaptive_k={args.adaptive_k}, "
          f"speculative.max_batch={args.max_batch}, min_gain={args.min_gain}; model.quant={args.quant}; "
          f"{args.rows} rows at batch {args.batch}; max_tokens={args.max_tokens}")
    header = (f"{'workload':<11} {'method':<6} {'b1 tok/s':>9} {'x':>5} {'accept':>7} {'job s':>7} {'x':>5} {'tail s':>7} "
              f"{'x':>5} {'sat ms/step':>11} {'accept':>7} {'acc/chk':>7} {'same':>7}")
    if not args.rows:
        return
    print(header)
    for workload, texts in (("copy-heavy", copy_heavy_prompts(args.rows)), ("chat", chat_prompts(args.rows))):
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
        base: dict = {}
        for method in args.methods:
            spec = SpeculativeConfig(method=method, k=args.k, max_batch=args.max_batch, adaptive_k=args.adaptive_k,
                                     min_gain=args.min_gain)

            def make_engine(config=alone, spec=spec):
                return Engine(loaded, config, speculative=spec, draft_model=draft)

            b1, b1_accept = batch1(make_engine, prompts[: args.batch1], sp)
            job = run_job(make_engine(config), prompts, sp, args.batch)
            if method == "none":
                base = {"b1": b1, "job": job}
            ref = base.get("job")
            same = sum(job.tokens[i] == ref.tokens[i] for i in job.tokens) if ref else 0
            print(f"{workload:<11} {method:<6} {b1:9.1f} {b1 / base.get('b1', b1):5.2f} {b1_accept:7.1%} {job.wall_s:7.1f} "
                  f"{ref.wall_s / job.wall_s if ref else 1:5.2f} {job.tail_s:7.1f} "
                  f"{ref.tail_s / job.tail_s if ref and job.tail_s else 1:5.2f} {job.saturated_ms_per_step:11.1f} "
                  f"{job.acceptance:7.1%} {job.mean_accepted:7.2f} {same:>3}/{len(job.tokens):<3}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
