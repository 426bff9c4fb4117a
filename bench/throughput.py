"""Engine vs transformers' batched `generate`: generated tokens/s on the same weights and dtype, one run.

Shapes of a dataset-generation job: ~40-token prompts, 128 new tokens, greedy, EOS ignored. Prints both
throughputs and their ratio, the engine's mean batch, steps and time split, and the step roofline from a
bandwidth and matmul-peak probe measured here in the same run:

    OMP_WAIT_POLICY=PASSIVE python bench/throughput.py --prompts 128 --batch 64 --new-tokens 128

`--dtype auto` takes bfloat16 only when the probe finds bf16 matmuls faster than fp32 on this CPU (CPUs
without AVX-512 bf16 run bf16 matmuls in slow fallback code, which would make every figure meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model.llama import LlamaModel
from pipeline.model.loader import default_model_path, load_model
from pipeline.perf.probe import measure_bandwidth, measure_matmul_peak
from pipeline.perf.roofline import forward_bytes, forward_flops

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


def run_engine(loaded, prompts: list[list[int]], args) -> dict:
    config = EngineConfig(
        kv_cache_memory=args.kv_cache_memory, max_batch_size=args.batch, max_batched_tokens=args.max_batched_tokens,
    )
    engine = Engine(loaded, config)
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    list(engine.generate(Request(f"warm{i}", p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts[:4])))
    engine.stats = type(engine.stats)()
    t0 = time.perf_counter()
    outputs = {r.id: r.token_ids for r in engine.generate(Request(i, p, sp) for i, p in enumerate(prompts))}
    seconds = time.perf_counter() - t0
    tokens = sum(len(v) for v in outputs.values())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "stats": engine.stats,
            "outputs": outputs}


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


def step_roofline(cfg, stats, dtype_name: str, bandwidth: float, peak: float) -> dict:
    """Least time the measured hardware needs for the engine's work: per step the weights once, every KV
    row attended, 2 FLOPs per weight per token (LM head only for the rows sampled) plus attention."""
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    flops = forward_flops(cfg, stats.computed_tokens, stats.attention_pairs)
    flops -= lm_head * (stats.computed_tokens - stats.decode_tokens)
    moved = forward_bytes(cfg, dtype_name, stats.steps, stats.computed_tokens, stats.attention_pairs, dtype_name)
    seconds = max(moved / bandwidth, flops / peak)
    return {"flops": flops, "bytes": moved, "seconds": seconds, "bound": "compute" if flops / peak > moved / bandwidth
            else "memory", "per_step_ms": 1e3 * seconds / stats.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="engine.max_batch_size")
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--hf-batches", default="64", help="comma-separated transformers batch sizes to try")
    ap.add_argument("--hf-attn", default="sdpa", help="comma-separated attn_implementation values to try")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    bandwidth = measure_bandwidth()
    peaks = {"float32": measure_matmul_peak(torch.float32), "bfloat16": measure_matmul_peak(torch.bfloat16)}
    dtype_name = args.dtype if args.dtype != "auto" else max(peaks, key=peaks.get)
    print(f"load {os.getloadavg()[0]:.1f}  threads {torch.get_num_threads()}  bandwidth {bandwidth / 1e9:.1f} GB/s  "
          f"peak fp32 {peaks['float32'] / 1e9:.0f} / bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s  -> {dtype_name}")

    loaded = load_model(args.model or default_model_path(), getattr(torch, dtype_name))
    prompts = make_prompts(loaded.tokenizer, args.prompts, args.prompt_len, seed=0)
    eng = run_engine(loaded, prompts, args)
    s = eng["stats"]
    roof = step_roofline(loaded.config, s, dtype_name, bandwidth, peaks[dtype_name])
    print(f"engine: {eng['tokens']} tokens in {eng['seconds']:.1f} s = {eng['tokens_per_s']:.1f} tok/s; "
          f"steps {s.steps}, mean batch {s.mean_running_batch:.1f}, steady-phase mean batch "
          f"{s.steady_mean_running_batch:.1f} of {args.batch}")
    other = s.total_time - s.model_time - s.sampling_time - s.schedule_time
    print(f"  time: model {s.model_time:.1f} s (attention {s.attention_time:.1f}), sampling {s.sampling_time:.2f}, "
          f"scheduling {s.schedule_time:.2f}, other {other:.2f}")
    step_ms = 1e3 * s.total_time / s.steps
    print(f"  step roofline {roof['per_step_ms']:.1f} ms ({roof['bound']}-bound) vs measured {step_ms:.1f} ms "
          f"= {100 * roof['per_step_ms'] / step_ms:.0f}% of roofline")

    best = None
    for attn in args.hf_attn.split(","):
        hf = hf_model(loaded.model, attn)
        for batch in (int(b) for b in args.hf_batches.split(",")):
            ref = run_transformers(hf, prompts, batch, args.new_tokens)
            agree = sum(ref["outputs"][i] == eng["outputs"][i] for i in range(len(prompts))) / len(prompts)
            print(f"transformers ({attn}, batch {batch}): {ref['tokens_per_s']:.1f} tok/s; "
                  f"identical outputs {100 * agree:.0f}%")
            if best is None or ref["tokens_per_s"] > best[2]:
                best = (attn, batch, ref["tokens_per_s"])
        del hf
    ratio = eng["tokens_per_s"] / best[2]
    print(f"ratio engine / best transformers ({best[0]}, batch {best[1]}): {ratio:.2f}x")
    if args.json:
        figures = {
            "dtype": dtype_name, "load": os.getloadavg()[0], "bandwidth": bandwidth, "peaks": peaks,
            "engine_tokens_per_s": eng["tokens_per_s"], "transformers_tokens_per_s": best[2], "ratio": ratio,
            "stats": s.as_dict(), "roofline": roof, "step_ms": step_ms,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
