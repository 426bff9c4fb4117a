"""Quantization benchmark on SmolLM2: bytes, memory, perplexity, greedy agreement and decode speed per format.

    python bench/quant.py                      # every format, each in its own process; prints a table
    python bench/quant.py --formats none:float32 gguf:bfloat16 --tokens 1024
    python bench/quant.py --json out.json
    python bench/quant.py --kernels            # per-M timing of the CPU matmul choices at SmolLM2's shapes
    python bench/quant.py --sensitivity        # agreement under known weight perturbations (calibration)

A format is `quant[/group][@rows][+head]:dtype`, e.g. `int4/64:float32`, `gguf@16:float32` (W8A8 for steps of
>= 16 rows: model.quant_w8a8_rows=16), `w8a8+bf16:float32` (LM head kernel: int8, bf16 or
none), `auto:float32` (resolved from this machine's probe, as model.quant=auto). Weight-only float32 formats
without @rows compute with dequantized weights (the exact path); bfloat16 ones use torch's CPU weight-only
kernels where one exists.

Held-out text: docstrings of Python standard-library modules (built offline, deterministic for a given
Python version). Agreement prompts: the first 24 tokens of docstrings of other modules. The float32
reference's greedy continuations (32 prompts x 32 tokens) are computed once; each format reports
- free-running agreement: share of the 32 x 32 positions whose greedy token equals the reference's;
- teacher-forced agreement: share of positions whose argmax equals the reference token when fed the
  reference continuation (no cascade after a first divergence);
- logit error: max |logit - reference logit| over the first 128 held-out tokens.
Decode speed: tokens/s of decode steps (LM head and argmax included) at batch 1, 16, 64 and 128 after a
24-token prompt, with a plain batched attention (not the engine) so only the model's weights differ.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipeline.model.loader import load_model  # noqa: E402
from pipeline.model.quant import linear_weight_bytes  # noqa: E402
from pipeline.model.w8a8_crossover import apply_measured_crossover, rows_to_load  # noqa: E402

TEXT_MODULES = ["argparse", "textwrap", "pathlib", "string", "statistics", "calendar", "difflib", "shutil",
                "json", "dataclasses", "fractions", "configparser", "csv", "heapq", "bisect", "queue"]
PROMPT_MODULES = ["inspect", "typing", "functools", "logging", "tarfile", "zipfile", "urllib.parse",
                  "http.client", "email.message", "collections", "enum", "ipaddress", "tempfile", "random",
                  "contextlib", "abc", "copy", "gettext", "locale", "pprint", "sched", "selectors", "shlex",
                  "socket", "ssl", "subprocess", "threading", "timeit", "traceback", "uuid", "warnings",
                  "weakref", "zipapp", "glob", "fnmatch"]
PROMPT_TOKENS, NEW_TOKENS, NUM_PROMPTS = 24, 32, 32
LOGIT_TOKENS = 128  # held-out tokens whose logits are compared with the reference's
DEFAULT_FORMATS = ["none:float32", "int8@16:float32", "int4/32@16:float32", "gguf@16:float32", "w8a8:float32",
                   "w8a8+int8:float32", "w8a8+bf16:float32", "auto:float32", "none:bfloat16", "gguf:bfloat16"]
SPEED_BATCHES = (1, 16, 64, 128)
AUTO_MAX_BATCH = 64  # the batch size auto's choice is made for


def docstrings(modules: list[str]) -> list[str]:
    """Module, class and function docstrings of `modules`, in a fixed order."""
    docs = []
    for name in modules:
        mod = importlib.import_module(name)
        docs.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            public = not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
            if public and getattr(obj, "__module__", None) == name and inspect.getdoc(obj):
                docs.append(inspect.getdoc(obj))
    return [d for d in docs if d.strip()]


class UniformBatchCache:
    """KV cache for B sequences that all advance by the same number of tokens per step (the bench's
    batched prompts and decode), with causal attention in float32."""

    def __init__(self, num_layers: int, batch: int, scale: float):
        self.batch, self.scale = batch, scale
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        t = q.shape[0] // b
        split = lambda x: x.reshape(b, t, x.shape[1], x.shape[2]).transpose(1, 2).float()  # noqa: E731
        q4, k4, v4 = split(q), split(k), split(v)
        start = 0 if self.k[layer] is None else self.k[layer].shape[2]
        self.k[layer] = k4 if self.k[layer] is None else torch.cat([self.k[layer], k4], dim=2)
        self.v[layer] = v4 if self.v[layer] is None else torch.cat([self.v[layer], v4], dim=2)
        mask = torch.arange(start + t, device=q.device)[None, :] <= (start + torch.arange(t, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(q4, self.k[layer], self.v[layer], attn_mask=mask,
                                             scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2]).to(q.dtype)


def forward_batch(model, tokens: torch.Tensor, cache: UniformBatchCache, start: int) -> torch.Tensor:
    """Logits [B, t, vocab] for tokens [B, t] at positions start..start+t-1."""
    b, t = tokens.shape
    positions = (start + torch.arange(t, device=tokens.device)).repeat(b)
    hidden = model(tokens.reshape(-1), positions, cache)
    return model.compute_logits(hidden).reshape(b, t, -1)


def greedy(model, prompts: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    """Greedy continuation [B, steps] and the seconds spent in the decode steps (after the prompt)."""
    cache = UniformBatchCache(model.config.num_layers, prompts.shape[0], model.scale)
    nxt = forward_batch(model, prompts, cache, 0)[:, -1].argmax(-1)
    out = [nxt]
    t0 = time.perf_counter()
    for i in range(steps - 1):
        nxt = forward_batch(model, nxt[:, None], cache, prompts.shape[1] + i)[:, -1].argmax(-1)
        out.append(nxt)
    return torch.stack(out, 1), time.perf_counter() - t0


def agreement(model, prompts: torch.Tensor, ref: torch.Tensor, gen: torch.Tensor) -> tuple[float, float]:
    """(free-running, teacher-forced) shares of positions where the model's greedy token equals `ref`'s;
    `gen` is the model's own greedy continuation of `prompts`."""
    cache = UniformBatchCache(model.config.num_layers, prompts.shape[0], model.scale)
    logits = forward_batch(model, torch.cat([prompts, ref[:, :-1]], 1), cache, 0)
    forced = (logits[:, prompts.shape[1] - 1 :].argmax(-1) == ref).float().mean().item()
    return (gen == ref).float().mean().item(), forced


def perplexity(model, ids: list[int], chunk: int = 512) -> float:
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, chunk):
        piece = torch.tensor(ids[s : s + chunk + 1], device=model.norm.weight.device)
        cache = UniformBatchCache(model.config.num_layers, 1, model.scale)
        logits = forward_batch(model, piece[None, :-1], cache, 0)[0]
        nll += F.cross_entropy(logits, piece[1:], reduction="sum").item()
        count += len(piece) - 1
    return float(torch.exp(torch.tensor(nll / count)))


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def parse_format(fmt: str) -> dict:
    """`quant[/group][@rows][+head]:dtype` -> load_model keyword arguments (auto: resolved by the probe)."""
    quant, _, dtype = fmt.partition(":")
    quant, _, head = quant.partition("+")
    quant, _, rows = quant.partition("@")
    scheme, _, group = quant.partition("/")
    options = {"dtype": getattr(torch, dtype or "float32"), "quant": scheme, "quant_group_size": int(group or 32),
               "w8a8_rows": int(rows) if rows else None}
    if head:
        options["quant_lm_head"] = head
    if scheme == "auto":
        options.update(auto_options())
    elif not head:
        options["quant_lm_head"] = "int8"  # the job's quant_lm_head=auto
    return options


def auto_options() -> dict:
    """How model.quant=auto loads on this machine (probe, then the roofline choice); `run_format` then times
    a weight-only choice's crossing on the model, as the job does (`auto_choice` keeps the choice for it)."""
    from pipeline.model.loader import default_model_path, open_model_file
    from pipeline.model.quant_choice import choose_quant
    from pipeline.model.roofline import HardwareProfile
    from pipeline.perf.probe import probe

    hw = probe()
    profile = HardwareProfile("cpu", hw.bandwidth, hw.flops, hw.memory)
    choice = choose_quant(open_model_file(default_model_path()).config, profile, "gguf", hw.weight_only_kernels,
                          AUTO_MAX_BATCH)
    print(f"# auto: {choice.reason}", file=sys.stderr)
    measure = choice.scheme != "w8a8"
    return {"quant": choice.scheme, "w8a8_rows": rows_to_load(choice, measure),
            "quant_lm_head": choice.lm_head, "prefer_speed": True, "auto_choice": choice if measure else None}


def run_format(fmt: str, data: dict) -> dict:
    """All measurements of one format (run in a fresh process so resident memory is its own)."""
    torch.set_num_threads(data["threads"])
    options = parse_format(fmt)
    auto_choice = options.pop("auto_choice", None)
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    loaded = load_model(**options)
    model = loaded.model
    if auto_choice is not None:
        choice, crossover = apply_measured_crossover(auto_choice, model, AUTO_MAX_BATCH)
        options["w8a8_rows"] = choice.w8a8_rows
        print(f"# auto on this CPU: W8A8 from {choice.w8a8_rows} rows; {crossover.describe()}", file=sys.stderr)
    row = {"format": fmt, "options": {k: str(v) for k, v in options.items()}, "load_s": round(time.perf_counter() - t0, 1), "weight_bytes": loaded.weight_bytes,
           "linear_bytes": linear_weight_bytes(model), "rss_delta_bytes": rss_bytes() - rss0}
    prompts = torch.tensor(data["prompts"])
    ref = torch.tensor(data["reference"]) if data.get("reference") else None
    gen, _ = greedy(model, prompts, NEW_TOKENS)
    row["continuation"] = gen.tolist()
    if ref is not None:
        row["agree_free"], row["agree_forced"] = agreement(model, prompts, ref, gen)
    first = torch.tensor(data["text_ids"][:LOGIT_TOKENS])
    logits = forward_batch(model, first[None], UniformBatchCache(model.config.num_layers, 1, model.scale), 0)[0]
    ref_file = Path(data["ref_logits"])
    if ref_file.exists():
        ref_logits = torch.load(ref_file)
        row["logit_err_max"] = (logits - ref_logits).abs().max().item()
        row["logit_top1_agree"] = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    else:  # the first format is the reference
        torch.save(logits, ref_file)
    row["perplexity"] = perplexity(model, data["text_ids"])
    for batch in SPEED_BATCHES:
        p = prompts.repeat(-(-batch // len(prompts)), 1)[:batch]
        _, seconds = greedy(model, p, data["decode_steps"] + 1)
        row[f"decode_tok_s_b{batch}"] = batch * data["decode_steps"] / seconds
    hidden = torch.randn(1, model.config.hidden_size, dtype=model.dtype)
    with torch.inference_mode():
        row["lm_head_ms_b1"] = median_ms(lambda: model.compute_logits(hidden))
    row["step_ms_b1"] = 1e3 / row["decode_tok_s_b1"]
    return row


SMOLLM2_LINEARS = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
                   "down_proj": (576, 1536)}
KERNEL_M = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def median_ms(fn, repeat: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeat // 2] * 1e3


def kernel_table() -> None:
    """ms for one decoder layer's four linears (SmolLM2 shapes), per batch size M and CPU method."""
    from kernels.wq_cpu import cpu_matmul, pack_for_cpu
    from kernels.wq_reference import dequantize, quantize_int4, quantize_int8

    layers = []
    for n, k in SMOLLM2_LINEARS.values():
        w = torch.randn(n, k) * 0.02
        q4, s4, m4 = quantize_int4(w, 32)
        q8, s8 = quantize_int8(w)
        layers.append((w, w.bfloat16(), pack_for_cpu(q4, s4, m4, 4), pack_for_cpu(q8, s8, None, 8), (q4, s4, m4)))
    methods = {
        "dense fp32": lambda x, L: F.linear(x, L[0]),
        "dense bf16": lambda x, L: F.linear(x.bfloat16(), L[1]),
        "int4 kernel bf16": lambda x, L: cpu_matmul(x.bfloat16(), L[2]),
        "int8 kernel bf16": lambda x, L: cpu_matmul(x.bfloat16(), L[3]),
        "dequant int4 + fp32": lambda x, L: F.linear(x, dequantize(*L[4], 4)),
    }
    print(f"# ms per layer (4 linears), threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print("M     " + "  ".join(f"{name:>19}" for name in methods))
    for m in KERNEL_M:
        xs = [torch.randn(m, k) for _, k in SMOLLM2_LINEARS.values()]
        cells = [median_ms(lambda f=f, xs=xs: [f(x, L) for x, L in zip(xs, layers)]) for f in methods.values()]
        print(f"{m:<5} " + "  ".join(f"{c:19.3f}" for c in cells), flush=True)


def weight_sensitivity(prompts: torch.Tensor) -> None:
    """Agreement of the float32 model with itself after known perturbations of its linear weights.

    Why: it calibrates the agreement columns. Every variant computes in float32, so only the weights differ:
    int8 grids per output channel and per 32 inputs (round-to-nearest, as `quant=int8` and GGUF Q8_0 store
    them), bf16 rounding, and Gaussian noise of a given size relative to each weight tensor's std.
    """
    from kernels.wq_reference import dequantize, quantize_int8
    from pipeline.model.layers import ParallelLinear

    model = load_model(dtype=torch.float32, quant="none").model
    linears = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    originals = [m.weight.detach().clone() for m in linears]
    noise = torch.Generator().manual_seed(0)
    variants = {
        "int8 per output channel": lambda w: dequantize(*quantize_int8(w), None, 8),
        "int8 per 32 inputs": lambda w: dequantize(*quantize_int8(w, 32), None, 8),
        "bf16 rounding": lambda w: w.bfloat16().float(),
        **{f"gaussian noise {rel:.1%} of std": lambda w, rel=rel: w + torch.randn(w.shape, generator=noise) * w.std() * rel
           for rel in (0.001, 0.002, 0.003, 0.005)},
    }
    with torch.inference_mode():
        ref, _ = greedy(model, prompts, NEW_TOKENS)
        print(f"# {len(prompts)} prompts x {NEW_TOKENS} greedy tokens vs none:float32, float32 compute throughout")
        print(f"{'linear weights':<28} {'rel. weight error':>17} {'agree free':>10} {'forced':>7}")
        for name, perturb in variants.items():
            for m, w in zip(linears, originals):
                m.weight.copy_(perturb(w))
            err = sum((m.weight - w).square().sum() for m, w in zip(linears, originals))
            rel_err = (err / sum(w.square().sum() for w in originals)).sqrt().item()
            free, forced = agreement(model, prompts, ref, greedy(model, prompts, NEW_TOKENS)[0])
            print(f"{name:<28} {rel_err:17.4%} {free:10.3f} {forced:7.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS)
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens for perplexity")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--kernels", action="store_true", help="only the per-M CPU kernel table")
    ap.add_argument("--sensitivity", action="store_true",
                    help="only the agreement of float32 with itself under known weight perturbations")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one format, data file in --data
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_format(args.one, json.loads(args.data.read_text()))))
        return
    if args.kernels:
        kernel_table()
        return

    from pipeline.model.loader import default_model_path
    from pipeline.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    text_ids = tok.encode("\n\n".join(docstrings(TEXT_MODULES)))[: args.tokens]
    prompt_docs = [ids for ids in (tok.encode(d) for d in docstrings(PROMPT_MODULES)) if len(ids) >= PROMPT_TOKENS]
    step = max(1, len(prompt_docs) // NUM_PROMPTS)
    prompts = [ids[:PROMPT_TOKENS] for ids in prompt_docs[::step][:NUM_PROMPTS]]
    if args.sensitivity:
        weight_sensitivity(torch.tensor(prompts))
        return
    data = {"text_ids": text_ids, "prompts": prompts, "decode_steps": args.decode_steps, "threads": args.threads}
    print(f"# held-out tokens {len(text_ids)}, prompts {len(prompts)} x {PROMPT_TOKENS}, threads {args.threads}, "
          f"load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / "data.json"
        data["ref_logits"] = str(Path(tmp) / "reference_logits.pt")
        for fmt in args.formats:
            data_file.write_text(json.dumps(data))
            proc = subprocess.run([sys.executable, __file__, "--one", fmt, "--data", str(data_file)],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(f"{fmt:<18} FAILED: {proc.stderr.strip().splitlines()[-1]}", flush=True)
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            if "reference" not in data:  # the first format is the reference
                data["reference"] = row["continuation"]
            rows.append(row)
            print_row(row, rows[0])
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "continuation"} for r in rows], indent=1))


def print_row(row: dict, ref: dict) -> None:
    if row is ref:
        print("format             linear MB  weights MB  RSS+ MB  ppl      ppl/ref  agree free  forced  "
              "logit err  tok/s b1  x ref  tok/s b16  tok/s b64  tok/s b128  lm_head share b1")
    mb = 1 / 2**20
    print(f"{row['format']:<18} {row['linear_bytes'] * mb:9.1f}  {row['weight_bytes'] * mb:10.1f}  "
          f"{row['rss_delta_bytes'] * mb:7.0f}  {row['perplexity']:7.3f}  {row['perplexity'] / ref['perplexity']:7.4f}  "
          f"{row.get('agree_free', 1.0):10.3f}  {row.get('agree_forced', 1.0):6.3f}  "
          f"{row.get('logit_err_max', 0.0):9.4f}  "
          + (f"{row['decode_tok_s_b1']:8.2f}  {row['decode_tok_s_b1'] / ref['decode_tok_s_b1']:5.2f}  "
             f"{row['decode_tok_s_b16']:9.1f}  {row['decode_tok_s_b64']:9.1f}  {row['decode_tok_s_b128']:10.1f}  "
             f"{row['lm_head_ms_b1'] / row['step_ms_b1']:17.2f}"
             if "decode_tok_s_b1" in row else "       -      -          -"),
          flush=True)


if __name__ == "__main__":
    main()
