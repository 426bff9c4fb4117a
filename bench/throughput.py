"""Engine (every quantization mode) vs transformers' best `generate`: generated tokens/s, alternating in one run.

Two workloads of a dataset-generation job, greedy, EOS ignored:
- distinct: 256 distinct ~40-token chat prompts x 128 new tokens;
- shared: 8 system prompts x 32 questions x 64 new tokens (a shared prefix per system prompt).
transformers' best configuration (batch size, attention) is picked by a sweep first; then for `--rounds`
rounds every engine mode and transformers run one after the other, so load changes hit all alike; odd
rounds run the engine modes in reverse order, since the one run second is often faster. Prints
the CPU flags and load average, each mode's tok/s, and the ratios to transformers' best:

    python bench/throughput.py --workload distinct --modes none,int8,int4,gguf,w8a8,auto
    python bench/throughput.py --workload shared --new-tokens 64 --modes none,w8a8,auto
    python bench/throughput.py --modes auto,auto+logits --batch 128  # the fused greedy head, side by side
    python bench/throughput.py --workload shared --new-tokens 64 --modes auto@128,auto@256  # fixed batch sizes

The model runs in float32 (the job's default), as the job does: `auto` is resolved from this machine's
probe exactly as `model.quant=auto` is. `--dtype auto` takes bfloat16 only when the probe finds bf16
matmuls faster than fp32 (CPUs without AVX-512 bf16 run bf16 matmuls in slow fallback code).

Both sides run under the heap policy the engine's CPU runner sets (`keep_step_buffers`), from the start:
it spares transformers' `generate` its page faults too (a 128-row batch took ~0.5-1 million of them
without it), and since it is process-wide it would otherwise reach transformers only after the first engine
run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator

import torch

from pipeline.config import resolve_kv_dtype
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.host_memory import keep_step_buffers
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.llama import LlamaModel
from pipeline.model.loader import default_model_path, load_model
from pipeline.model.quant_choice import choose_quant
from pipeline.model.roofline import HardwareProfile, forward_bytes, forward_flops
from pipeline.model.w8a8_crossover import apply_measured_crossover, rows_to_load
from pipeline.perf.probe import cpu_flags, probe

_TOPICS = ["rivers", "volcanoes", "bread", "chess", "satellites", "bees", "glass", "tea", "bridges", "owls",
           "clocks", "maps", "salt", "kites"]
_TASKS = [
    "Write a short product description for a {} museum gift shop item, mentioning its history.",
    "Explain to a ten-year-old how {} work and why people have cared about them for centuries.",
    "Give three surprising facts about {} and one open question scientists still argue about.",
    "Draft a polite email asking a colleague for feedback on a report about {} and its costs.",
]


def make_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of length-8..length+8 tokens: distinct instructions (little shared prefix)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        task = _TASKS[i % len(_TASKS)].format(_TOPICS[(i // len(_TASKS)) % len(_TOPICS)])
        text = f"Request {i}: {task} Keep it under {50 + i % 7 * 10} words and use a friendly, clear tone."
        ids = tokenizer.encode(text)
        want = length + int(torch.randint(-8, 9, (1,), generator=g))
        prompts.append((ids * (want // len(ids) + 1))[:want])
    return prompts


_SYSTEMS = [
    "You are a patient science teacher. Answer in plain words, with one everyday example, in at most three "
    "sentences. Never use jargon without explaining it.",
    "You are a terse senior engineer reviewing designs. Reply with the single biggest risk and one mitigation.",
    "You write catalogue copy for a small bookshop: warm, concrete, no superlatives, under sixty words.",
    "You are a travel guide for families. Suggest one activity, its cost range and what to bring.",
    "You are a careful historian. State what is known, what is disputed, and cite no invented sources.",
    "You are a friendly chef. Give a recipe idea with five ingredients and the one step people get wrong.",
    "You are a fitness coach for beginners. Give one exercise, how many repetitions and a safety tip.",
    "You are a museum docent. Describe one object related to the question and why it matters.",
]


def make_shared_prompts(tokenizer, systems: int, questions: int) -> list[list[int]]:
    """`systems` system prompts x `questions` distinct user questions, chat-templated (shared prefixes)."""
    prompts = []
    for s in range(systems):
        for q in range(questions):
            topic = _TOPICS[q % len(_TOPICS)]
            messages = [{"role": "system", "content": _SYSTEMS[s % len(_SYSTEMS)]},
                        {"role": "user", "content": f"Question {q}: what should I know about {topic}?"}]
            prompts.append(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    return prompts


def make_distinct_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` distinct short chat prompts (~40 tokens with the template)."""
    prompts = []
    for i in range(count):
        task = _TASKS[i % len(_TASKS)].format(_TOPICS[(i // len(_TASKS)) % len(_TOPICS)])
        messages = [{"role": "user", "content": f"Request {i}: {task}"}]
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    return prompts


def load_mode(path, dtype: torch.dtype, mode: str, auto_choice, w8a8_rows: int | None, max_batch: int):
    """The model as the job loads it for `mode` = `quant[/kv dtype]`: model.quant=quant (auto: the probe's
    choice, its crossing timed for batches up to `max_batch`) and model.kv_cache_dtype=kv dtype (default
    auto, resolved as the job does)."""
    quant, _, kv = mode.partition("/")
    scheme = auto_choice.scheme if quant == "auto" else quant
    kv_dtype = getattr(torch, resolve_kv_dtype(kv or "auto", quant, str(dtype).removeprefix("torch."), "cpu"))
    if quant == "none":
        return load_model(path, dtype, kv_dtype=kv_dtype)
    if quant != "auto":
        return load_model(path, dtype, quant=scheme, w8a8_rows=w8a8_rows, quant_lm_head=auto_choice.lm_head,
                          kv_dtype=kv_dtype)
    # as the job: a weight-only choice loads both layouts and times where W8A8 starts to win
    measure = scheme != "w8a8"
    loaded = load_model(path, dtype, quant=scheme, w8a8_rows=rows_to_load(auto_choice, measure),
                        quant_lm_head=auto_choice.lm_head, kv_dtype=kv_dtype, prefer_speed=True)
    if measure:
        measured, crossover = apply_measured_crossover(auto_choice, loaded.model, max_batch)
        print(f"auto on this CPU: W8A8 from {measured.w8a8_rows} rows; {crossover.describe()}")
    return loaded


def split_mode(mode: str) -> tuple[str, str, int | None]:
    """`quant[/kv dtype][+logits][@batch]` -> (model mode `quant[/kv dtype]`, "+logits" or "", batch or None)."""
    rest, _, batch = mode.partition("@")
    model_mode, plus, suffix = rest.partition("+")
    if suffix not in ("", "logits"):
        raise SystemExit(f"--modes: {mode!r}: the only + suffix is +logits")
    if batch and not batch.isdigit():
        raise SystemExit(f"--modes: {mode!r}: @ takes an engine.max_batch_size, e.g. auto@256")
    return model_mode, plus + suffix, int(batch) if batch else None


def run_engine(loaded, prompts: list[list[int]], args, batch: int | str) -> dict:
    config = EngineConfig(
        kv_cache_memory=args.kv_cache_memory, max_batch_size=batch, max_batched_tokens=args.max_batched_tokens,
    )
    engine = Engine(loaded, config)
    choice = engine.tune_batch_size(args.new_tokens, len(prompts))  # --batch auto: measured, as in a job
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    list(engine.generate(Request(f"warm{i}", p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts[:4])))
    # a lone sequence too: compiled graphs specialize a one-row step, which a job's last steps may take
    list(engine.generate([Request("warm-one", prompts[0], SamplingParams(max_tokens=2))]))
    engine.stats = type(engine.stats)()
    if loaded.model.kernel_choice is not None:  # count the measured steps only
        loaded.model.kernel_choice.clear()
    t0 = time.perf_counter()
    outputs = {r.id: r.token_ids for r in engine.generate(Request(i, p, sp) for i, p in enumerate(prompts))}
    seconds = time.perf_counter() - t0
    tokens = sum(len(v) for v in outputs.values())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "stats": engine.stats,
            "outputs": outputs, "batch": engine.max_batch_size, "tuning_s": choice.seconds if choice else 0.0}


@contextlib.contextmanager
def greedy_through_logits() -> Iterator[None]:
    """Plain-greedy steps take the logits and the sampler, as before the runner's `execute_greedy` (A/B)."""
    fused = SamplingParams.plain_greedy
    SamplingParams.plain_greedy = property(lambda self: False)
    try:
        yield
    finally:
        SamplingParams.plain_greedy = fused


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Our fused q/k/v and gate/up weights split back into Hugging Face Llama names."""
    cfg = model.config
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.lm_head.weight[: cfg.vocab_size]}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.self_attn.qkv_proj.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        out |= {
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
            p + "input_layernorm.weight": layer.input_layernorm.weight,
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        }
        if cfg.attention_bias:
            qb, kb, vb = layer.self_attn.qkv_proj.bias.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            out |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb}
    return {k: v.detach().clone() for k, v in out.items()}


def hf_model(model: LlamaModel, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, rope_scaling=cfg.rope_scaling,
        attn_implementation=attn,
    )
    hf = LlamaForCausalLM(hf_cfg).to(model.dtype).eval()
    hf.load_state_dict(hf_state_dict(model), strict=False)
    return hf


def run_transformers(hf, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    """Left-padded batches through `generate`; EOS never stops a row (as ignore_eos in the engine)."""
    outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo : lo + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0, top_p=None, top_k=None, temperature=None,
            )
        for r in range(len(chunk)):
            outputs[lo + r] = out[r, width:].tolist()
    seconds = time.perf_counter() - t0
    tokens = sum(len(v) for v in outputs.values())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "outputs": outputs}


def step_roofline(cfg, stats, weights: str, kv_dtype: str, bandwidth: float, peak: float) -> dict:
    """Least time the measured hardware needs for the engine's work: per step the weights once, every KV
    row attended, 2 FLOPs per weight per token (LM head only for the rows sampled) plus attention."""
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    flops = forward_flops(cfg, stats.computed_tokens, stats.attention_pairs)
    flops -= lm_head * (stats.computed_tokens - stats.decode_tokens)
    moved = forward_bytes(cfg, weights, stats.steps, stats.computed_tokens, stats.attention_pairs, kv_dtype)
    seconds = max(moved / bandwidth, flops / peak)
    return {"flops": flops, "bytes": moved, "seconds": seconds, "bound": "compute" if flops / peak > moved / bandwidth
            else "memory", "per_step_ms": 1e3 * seconds / stats.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--workload", default="distinct", choices=["distinct", "shared", "synthetic"])
    ap.add_argument("--prompts", type=int, default=256, help="distinct / synthetic: number of prompts")
    ap.add_argument("--systems", type=int, default=8, help="shared: system prompts")
    ap.add_argument("--questions", type=int, default=32, help="shared: questions per system prompt")
    ap.add_argument("--prompt-len", type=int, default=40, help="synthetic: prompt length")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="none,auto",
                    help="comma-separated model.quant values for the engine, each optionally /float32 or /bfloat16 "
                         "for model.kv_cache_dtype (default: auto, as the job resolves it), +logits for greedy "
                         "steps through the logits and the sampler (the path before the fused greedy head) and "
                         "@N for engine.max_batch_size=N instead of --batch")
    ap.add_argument("--w8a8-rows", type=int, default=None,
                    help="model.quant_w8a8_rows for int8/int4/gguf (default: none, as the job's)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of every mode and transformers")
    ap.add_argument("--batch", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="engine.max_batch_size (auto: measured before each engine run, not timed; the job's default)")
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                    help="engine model dtype (the job's default: float32)")
    ap.add_argument("--hf-batches", default="64,128", help="comma-separated transformers batch sizes to sweep")
    ap.add_argument("--hf-attn", default="sdpa", help="comma-separated attn_implementation values to sweep")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_step_buffers()  # the same allocator policy for every run (see the module docstring)

    hw = probe()
    peaks = {"float32": hw.flops["fp32"], "bfloat16": hw.flops["bf16"]}
    best_dtype = max(peaks, key=peaks.get)  # transformers runs in the probe's faster float dtype
    dtype_name = args.dtype if args.dtype != "auto" else best_dtype
    print(f"cpu flags: {cpu_flags()}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"load {os.getloadavg()}  threads {torch.get_num_threads()}  bandwidth {hw.bandwidth / 1e9:.1f} GB/s  "
          f"fp32 {peaks['float32'] / 1e9:.0f} / bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s "
          f"(bf16 {'native' if hw.bf16_native else 'emulated'}), int8 {hw.flops['int8'] / 1e9:.0f} GOP/s")
    path = args.model or default_model_path()
    base = load_model(path, getattr(torch, dtype_name))
    profile = HardwareProfile("cpu", hw.bandwidth, {k: v for k, v in hw.flops.items()}, hw.memory)
    weight_only = "gguf" if str(path).endswith(".gguf") else "int4"
    modes = args.modes.split(",")
    parsed = {m: split_mode(m) for m in modes}
    fixed = [batch for _, _, batch in parsed.values() if batch]
    max_batch = max(EngineConfig(max_batch_size=b).batch_limit for b in [args.batch, *fixed])
    auto = choose_quant(base.config, profile, weight_only, hw.weight_only_kernels, max_batch)
    print(f"auto -> {auto.scheme}, W8A8 from {auto.w8a8_rows} rows, LM head {auto.lm_head}: {auto.reason}")
    tok = base.tokenizer
    if args.workload == "distinct":
        prompts = make_distinct_prompts(tok, args.prompts)
    elif args.workload == "shared":
        prompts = make_shared_prompts(tok, args.systems, args.questions)
    else:
        prompts = make_prompts(tok, args.prompts, args.prompt_len, seed=0)
    print(f"workload {args.workload}: {len(prompts)} prompts, mean {sum(map(len, prompts)) / len(prompts):.0f} "
          f"tokens, {args.new_tokens} new tokens each")

    loaded_modes: dict[str, object] = {}  # one model per model mode: auto@128 and auto@256 share it
    for model_mode, _, _ in parsed.values():
        if model_mode not in loaded_modes:
            loaded_modes[model_mode] = load_mode(path, getattr(torch, dtype_name), model_mode, auto, args.w8a8_rows,
                                                 max_batch)
    models = {m: loaded_modes[parsed[m][0]] for m in modes}
    hf_source = base if dtype_name == best_dtype else load_model(path, getattr(torch, best_dtype))
    hf_best = None  # (attn, batch, model)
    for attn in args.hf_attn.split(","):
        hf = hf_model(hf_source.model, attn)
        for batch in (int(b) for b in args.hf_batches.split(",")):
            ref = run_transformers(hf, prompts, batch, args.new_tokens)
            print(f"sweep: transformers {best_dtype} ({attn}, batch {batch}): {ref['tokens_per_s']:.1f} tok/s")
            if hf_best is None or ref["tokens_per_s"] > hf_best[3]:
                hf_best = (attn, batch, hf, ref["tokens_per_s"], ref["outputs"])
    attn, hf_batch, hf, _, _ = hf_best

    rates: dict[str, list[float]] = {m: [] for m in [*modes, "transformers"]}
    first_outputs = None  # the first mode's tokens (float32 "none" when listed first): agreement reference
    figures: dict[str, dict] = {}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            loaded = models[mode]
            _, suffix, batch = parsed[mode]
            with greedy_through_logits() if suffix == "+logits" else contextlib.nullcontext():
                eng = run_engine(loaded, prompts, args, batch or args.batch)
            s = eng["stats"]
            rates[mode].append(eng["tokens_per_s"])
            first_outputs = first_outputs or eng["outputs"]
            agree = sum(first_outputs[i] == eng["outputs"][i] for i in range(len(prompts))) / len(prompts)
            roof_dtype = "int8" if loaded.model.kernel_choice is not None and loaded.model.kernel_choice.w8a8_rows else dtype_name
            peak = hw.flops["int8"] if roof_dtype == "int8" else peaks[dtype_name]
            kv_name = str(loaded.model.kv_dtype).removeprefix("torch.")
            roof = step_roofline(loaded.config, s, roof_dtype, kv_name, hw.bandwidth, peak)
            step_ms = 1e3 * s.total_time / s.steps
            kernels = dict(loaded.model.kernel_choice.steps) if loaded.model.kernel_choice is not None else {}
            if kernels:  # of the W8A8 steps, those whose layers ran in one native call
                kernels["native layers"] = loaded.model.kernel_choice.native_layer_steps
            print(f"round {r} engine {mode:5s}: {eng['tokens_per_s']:7.1f} tok/s  max_batch_size {eng['batch']} "
                  f"(measuring {eng['tuning_s']:.1f} s)  mean batch {s.mean_running_batch:.1f}"
                  f"  step {step_ms:.1f} ms = {100 * roof['per_step_ms'] / step_ms:.0f}% of the {roof_dtype} roofline"
                  f"  kernels {kernels}  same tokens as {modes[0]} {100 * agree:.0f}%", flush=True)
            figures[mode] = {"stats": s.as_dict(), "roofline": roof, "step_ms": step_ms, "kernels": kernels,
                             "max_batch_size": eng["batch"]}
        ref = run_transformers(hf, prompts, hf_batch, args.new_tokens)
        rates["transformers"].append(ref["tokens_per_s"])
        print(f"round {r} transformers {best_dtype} ({attn}, batch {hf_batch}): {ref['tokens_per_s']:.1f} tok/s  "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    hf_rate = max(rates["transformers"])
    print(f"best of {args.rounds} round(s); load {os.getloadavg()}")
    for mode in modes:
        mean = sum(rates[mode]) / len(rates[mode])
        print(f"  engine {mode:5s} {max(rates[mode]):7.1f} tok/s = {max(rates[mode]) / hf_rate:.2f}x transformers "
              f"({hf_rate:.1f} tok/s); mean of the rounds {mean:.1f} tok/s")
    if args.json:
        out = {"load": os.getloadavg(), "cpu_flags": cpu_flags(), "bandwidth": hw.bandwidth, "peaks": hw.flops,
               "auto": auto.as_dict(), "rates": rates, "engine": figures,
               "transformers": {"dtype": best_dtype, "attn": attn, "batch": hf_batch}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
