"""`python -m pipeline.roofline [conf=job.yaml] [job keys ...] hardware=h100 [hardware.KEY=V] [roofline.KEY=V]`

Prints the roofline arithmetic for the configured job before it runs: weight and KV bytes, the ridge
point, decode ceilings at batch 1 and at the engine's batch, the largest batch that fits, prefill with and
without prefix reuse (from a sample of `input.path`), a time estimate and the cost per million tokens.

The job keys are the job's own Hydra config (conf/config.yaml); `hardware=NAME` picks conf/hardware/NAME.yaml
(`cpu` measures this machine); `roofline.*` are the options of `RooflineOptions` below.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from omegaconf import OmegaConf

from pipeline.config import resolve_dtype, resolve_kv_dtype
from pipeline.errors import JobError
from pipeline.model.config import ModelConfig, read_json
from pipeline.model.roofline import (
    HardwareProfile,
    Roofline,
    cost_per_million_tokens,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    max_batch,
    precision,
    prefill_seconds,
    weight_bytes,
    weight_read_bytes,
)
from pipeline.perf.probe import load_hardware
from pipeline.plan.prefix import unique_prefix_tokens


@dataclass
class RooflineOptions:
    """`roofline.*` keys: what the job config does not say. null = derive from the job config."""

    weights: str | None = None  # weight precision (fp32, bf16, int8, int4-g32, q4_1, ...); null = model.dtype
    kv_dtype: str | None = None  # null = model.dtype
    compute_dtype: str | None = None  # activations / matmul dtype; null = model.dtype
    batch: int | None = None  # null = engine.max_batch_size
    context: int | None = None  # positions a decode step attends; null = sample's mean prompt + max_tokens/2
    tp: int = 1
    sample_rows: int = 1000  # rows of input.path tokenized for the prefix-sharing estimate (0 = none)
    api_price: float | None = None  # an API's price per million tokens, printed beside our cost
    json: bool = False  # print the figures as JSON instead of a table


# ---------------------------------------------------------------------------------------- config parsing
def split_args(argv: list[str]) -> tuple[list[str], str, list[str], list[str]]:
    """(job arguments, hardware name, hardware.* overrides, roofline.* overrides)."""
    job, hw_over, opt_over, name = [], [], [], "cpu"
    for arg in argv:
        if arg.startswith("hardware="):
            name = arg.split("=", 1)[1]
        elif arg.startswith("hardware."):
            hw_over.append(arg.removeprefix("hardware."))
        elif arg.startswith("roofline."):
            opt_over.append(arg.removeprefix("roofline."))
        else:
            job.append(arg)
    return job, name, hw_over, opt_over


def load_options(overrides: list[str]) -> RooflineOptions:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RooflineOptions), OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_object(merged)
    except Exception as e:
        raise JobError(f"invalid roofline option {overrides}: {e}") from None


def compose_job(argv: list[str]):
    """The job's validated config, composed by Hydra exactly as `python -m pipeline` composes it."""
    from hydra import compose, initialize_config_dir

    from pipeline.config import CONF_DIR, hydra_argv, load_job_config

    overrides = hydra_argv(argv)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        try:
            composed = compose(config_name="config", overrides=overrides)
        except Exception as e:  # Hydra's own errors name the bad key or value
            raise JobError(f"invalid config: {e}") from None
        return load_job_config(composed)


# ------------------------------------------------------------------------------------------- the model
def read_model(path: str | None, cache_dir: str | None = None) -> tuple[ModelConfig, Callable[[], object]]:
    """ModelConfig from GGUF metadata or config.json alone (no weights read), and a tokenizer loader. A
    remote model is copied into the local cache first (the job will load it from there)."""
    from pipeline.model.loader import local_model_path

    p = local_model_path(path, cache_dir)
    if p.is_dir():
        from pipeline.model.hf_file import config_from_hf
        from pipeline.model.tokenizer import Tokenizer

        config_file = p / "config.json"
        if not config_file.is_file():
            raise JobError(f"model.path={p}: no config.json")
        return config_from_hf(read_json(config_file), config_file), lambda: Tokenizer.from_hf_dir(p)
    if not p.is_file():
        raise JobError(f"model.path={p} not found (expected a .gguf file or a Hugging Face directory)")
    from pipeline.model.gguf_file import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(p)
    return checkpoint.config, checkpoint.load_tokenizer


def sample_prompts(job, tokenizer, max_model_len: int, rows: int) -> tuple[list[list[int]], int]:
    """Token ids of the first `rows` runnable rows of the input (as the job builds them), and the row count."""
    from pipeline.source.formats import open_source, prompt_builder

    source = open_source(job)
    builder = prompt_builder(job, tokenizer, max_model_len)
    columns = [c for c in (job.input.prompt_column, job.input.messages_column, *job.input.sampling_columns) if c]
    seqs: list[list[int]] = []
    for file, start, batch in source.batches(columns, min(rows, job.input.batch_rows)):
        for row in source.rows(file, start, batch):
            prepared = builder.prepare(row)
            if prepared.token_ids is not None:
                seqs.append(prepared.token_ids)
            if len(seqs) >= rows:
                return seqs, source.total_rows
    return seqs, source.total_rows


# ------------------------------------------------------------------------------------- what a step runs in
Regime = tuple[str, str]  # (weight precision, compute dtype) of a step


def quant_regime(job, cfg: ModelConfig, hw: HardwareProfile, on_cpu: bool, model_path: str,
                 model_dtype: str, tp: int) -> tuple[Callable[[int], Regime], str]:
    """The weights and arithmetic a step of `rows` rows runs in under the job's model.quant, resolved as the job
    resolves it (auto: on one CPU rank by `choose_quant` from this profile, else the float weights), and a note
    saying what was resolved. Weight-only linears run torch's bf16-activation kernels where they are fast
    here, else dequantize per call in float32; from `w8a8_rows` rows they switch to int8 weights and
    arithmetic."""
    from kernels.wq_cpu import weight_only_kernels_fast
    from pipeline.model.quant_choice import WEIGHT_ONLY_PRECISION, choose_quant, dequantized_per_call

    dtype = precision(model_dtype).name
    scheme, rows, why = job.model.quant, job.model.quant_w8a8_rows, f"model.quant={job.model.quant}"
    if scheme == "auto":
        if not on_cpu or tp > 1:
            scheme, rows, why = "none", None, "model.quant=auto -> none (a GPU or tensor parallelism: the float weights)"
        else:
            weight_only = "gguf" if model_path.endswith(".gguf") else "int4"
            choice = choose_quant(cfg, hw, weight_only, weight_only_kernels_fast(), job.engine.batch_limit)
            scheme, rows, why = choice.scheme, choice.w8a8_rows, f"model.quant=auto -> {choice.reason}"
    if scheme in ("none", "fp8", "w8a8"):
        fixed = {"none": (dtype, dtype), "fp8": ("fp8", "fp8"), "w8a8": ("int8", "int8")}[scheme]
        return (lambda _rows: fixed), why
    weights = precision(WEIGHT_ONLY_PRECISION[scheme] if scheme != "int4" else f"int4-g{job.model.quant_group_size}")
    compute = "bf16" if on_cpu and "bf16" in hw.flops and weight_only_kernels_fast() else dtype
    if on_cpu and compute == "fp32":
        weights = dequantized_per_call(weights)

    def regime(batch: int) -> Regime:
        return ("int8", "int8") if rows is not None and batch >= rows else (weights.name, compute)

    return regime, why


# ------------------------------------------------------------------------------------------ the figures
def plan_figures(
    cfg: ModelConfig, hw: HardwareProfile, opts: RooflineOptions, *, model_dtype: str, batch: int,
    max_tokens: int, kv_budget: int, chunk_tokens: int, prompts: list[list[int]] | None = None,
    total_rows: int | None = None, regime: Callable[[int], Regime] | None = None, kv_dtype: str | None = None,
) -> dict:
    """Every number the table shows, as plain data. `regime` gives the weights and arithmetic a step of a given
    batch runs in (`quant_regime`: model.quant as the job resolves it); `roofline.weights` and
    `roofline.compute_dtype` override it, and without either the model's dtype is used throughout. The KV cache
    is in `roofline.kv_dtype`, else `kv_dtype` (the job's), else the model's dtype."""
    dtype = precision(model_dtype).name
    batch = opts.batch if opts.batch is not None else batch

    def roof_at(rows: int) -> Roofline:
        weights, compute = regime(rows) if regime is not None else (None, None)
        return Roofline.of(cfg, hw, dtype, opts.weights or weights, opts.kv_dtype or kv_dtype,
                           opts.compute_dtype or compute, opts.tp)

    roof = roof_at(batch)
    mean_prompt = sum(map(len, prompts)) / len(prompts) if prompts else None
    # a decode step attends on average over the prompt and half the output; memory must hold all of it
    prompt = mean_prompt or 512
    context = opts.context if opts.context is not None else int(prompt + max_tokens / 2)
    full = max(1, opts.context if opts.context is not None else int(prompt + max_tokens))
    one, many = roof_at(1).ceiling(1, context), roof.ceiling(batch, context)
    kv_token = kv_bytes_per_token(cfg, roof.kv_dtype)
    out = {
        "model": {"parameters": cfg.num_parameters(), "layers": cfg.num_layers, "heads": cfg.num_heads,
                  "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim},
        "hardware": {"name": hw.name, "bandwidth_bytes_s": roof.bandwidth, "peak_flops": roof.peak,
                     "compute_dtype": roof.compute_dtype, "memory_bytes": hw.memory * opts.tp, "tp": opts.tp},
        "weights": {"precision": roof.weights.name, "bits_per_weight": roof.weights.bits_per_weight,
                    "stored_bytes": weight_bytes(cfg, roof.weights),
                    "read_per_step_bytes": weight_read_bytes(cfg, roof.weights)},
        "ridge_flop_per_byte": roof.ridge,
        "kv": {"dtype": roof.kv_dtype, "bytes_per_token": kv_token, "context": context, "sequence_len": full,
               "bytes_per_sequence": kv_bytes_per_sequence(cfg, full, roof.kv_dtype)},
        "max_batch": {"device_memory": max_batch(cfg, roof.weights, full, hw.memory * opts.tp, roof.kv_dtype),
                      "engine_kv_budget": int(kv_budget // (kv_token * full))},
    }
    if out["max_batch"]["device_memory"] == 0:  # no ceiling of an impossible configuration: say what would fit
        out["does_not_fit"] = {"memory_bytes": hw.memory * opts.tp, "weight_bytes": weight_bytes(cfg, roof.weights),
                               "suggestions": fitting_alternatives(cfg, hw, opts, roof, full)}
        return out
    out |= {
        "decode": [
            {"batch": c.batch, "tokens_per_s": c.tokens_per_s, "bound": c.bound, "intensity": c.intensity,
             "bandwidth_bound": c.bandwidth_bound, "compute_bound": c.compute_bound,
             "weights": r.weights.name, "compute_dtype": r.compute_dtype}
            for c, r in ((one, roof_at(1)), (many, roof))
        ],
    }
    if prompts:
        plain, shared = sum(map(len, prompts)), unique_prefix_tokens(prompts)
        prefill = {
            "sample_rows": len(prompts), "mean_prompt_tokens": mean_prompt,
            "tokens_without_reuse": plain, "tokens_with_reuse": shared, "saved_fraction": 1 - shared / plain,
        }
        rows = total_rows or len(prompts)
        scale = rows / len(prompts)
        prompt_len = max(1, round(mean_prompt))
        prefill_s = prefill_seconds(cfg, hw, roof.weights, round(shared * scale), prompt_len, chunk_tokens,
                                    roof.compute_dtype, roof.kv_dtype, opts.tp)
        decode_s = rows * max_tokens / many.tokens_per_s
        out["prefill"] = prefill
        out["estimate"] = {"rows": rows, "prefill_s": prefill_s, "decode_s": decode_s,
                           "max_output_tokens": rows * max_tokens}
    if hw.price_per_hour is not None:
        out["cost"] = {"price_per_hour": hw.price_per_hour, "devices": opts.tp,
                       "per_million_tokens": cost_per_million_tokens(many.tokens_per_s, hw.price_per_hour, opts.tp),
                       "api_per_million_tokens": opts.api_price}
    return out


def fitting_alternatives(cfg: ModelConfig, hw: HardwareProfile, opts: RooflineOptions, roof: Roofline,
                         sequence_len: int) -> list[str]:
    """The smallest tensor-parallel size, and the first lower weight precision, with which one sequence fits."""
    out = []
    splits = [tp for tp in range(opts.tp + 1, cfg.num_kv_heads + 1)
              if cfg.num_kv_heads % tp == 0 and cfg.num_heads % tp == 0]  # as ModelConfig.check_tensor_parallel
    for tp in splits:
        if max_batch(cfg, roof.weights, sequence_len, hw.memory * tp, roof.kv_dtype) > 0:
            out.append(f"engine.tensor_parallel={tp} (roofline.tp={tp}): {tp} devices")
            break
    for name in ("int8", "int4-g32"):
        smaller = precision(name)
        if smaller.bits_per_weight < roof.weights.bits_per_weight and \
                max_batch(cfg, smaller, sequence_len, hw.memory * opts.tp, roof.kv_dtype) > 0:
            out.append(f"model.quant={name.split('-')[0]} (roofline.weights={name}): "
                       f"{_si(weight_bytes(cfg, smaller), 'B')} of weights")
            break
    return out


def _si(x: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def format_table(name: str, f: dict) -> str:
    """The figures as a two-column table for the terminal."""
    m, hw, w, kv = f["model"], f["hardware"], f["weights"], f["kv"]
    rows = [
        ("model", f"{name}: {m['parameters'] / 1e6:,.1f} M parameters, {m['layers']} layers, "
                  f"{m['heads']}/{m['kv_heads']} heads x {m['head_dim']}"),
        ("hardware", f"{hw['name']} x{hw['tp']}: {_si(hw['bandwidth_bytes_s'], 'B/s')}, "
                     f"{_si(hw['peak_flops'], 'FLOP/s')} {hw['compute_dtype']}, {_si(hw['memory_bytes'], 'B')}"),
        ("ridge point", f"{f['ridge_flop_per_byte']:.3g} FLOP/byte"),
        ("weights", f"{w['precision']} ({w['bits_per_weight']:.3g} bits): {_si(w['stored_bytes'], 'B')} stored, "
                    f"{_si(w['read_per_step_bytes'], 'B')} read per step"),
        ("KV cache", f"{kv['dtype']}: {kv['bytes_per_token']:,} B/token, {_si(kv['bytes_per_sequence'], 'B')} "
                     f"per sequence of {kv['sequence_len']} positions; decode attends over {kv['context']}"),
    ]
    if "does_not_fit" in f:
        d = f["does_not_fit"]
        rows.append(("DOES NOT FIT", f"{_si(d['weight_bytes'], 'B')} of weights plus one sequence's KV cache "
                                     f"({_si(kv['bytes_per_sequence'], 'B')}) exceed the {_si(d['memory_bytes'], 'B')} "
                                     "of device memory; no ceilings computed"))
        rows += [("would fit with", s) for s in d["suggestions"]] or [("would fit with", "nothing tried fits")]
    else:
        rows.append(("max batch", f"{f['max_batch']['device_memory']:,} sequences fit in device memory, "
                                  f"{f['max_batch']['engine_kv_budget']:,} in engine.kv_cache_memory"))
    rows += [("note", n) for n in f.get("notes", [])]
    for d in f.get("decode", []):
        rows.append((f"decode batch {d['batch']}",
                     f"{d['tokens_per_s']:,.1f} tok/s ceiling, {d['bound']}-bound (memory {d['bandwidth_bound']:,.1f}, "
                     f"compute {d['compute_bound']:,.1f}); {d['intensity']:.3g} FLOP/byte; {d['weights']} weights, "
                     f"{d['compute_dtype']} arithmetic"))
    if "prefill" in f:
        p, e = f["prefill"], f["estimate"]
        rows.append(("prefill (sample)",
                     f"{p['sample_rows']} rows, mean prompt {p['mean_prompt_tokens']:.1f} tokens: "
                     f"{p['tokens_without_reuse']:,} tokens without reuse, {p['tokens_with_reuse']:,} with "
                     f"prefix reuse ({100 * p['saved_fraction']:.1f}% saved)"))
        rows.append(("job estimate",
                     f"{e['rows']:,} rows: prefill >= {e['prefill_s']:,.1f} s, decode of up to "
                     f"{e['max_output_tokens']:,} tokens >= {e['decode_s']:,.1f} s"))
    if "cost" in f:
        c = f["cost"]
        api = "" if c["api_per_million_tokens"] is None else f" (API: {c['api_per_million_tokens']:.3g})"
        rows.append(("cost", f"{c['per_million_tokens']:.3g} per million generated tokens at "
                             f"{c['price_per_hour']:.3g}/device-hour x {c['devices']}{api}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str]) -> int:
    from pipeline.model.loader import local_model_path

    job_args, hw_name, hw_over, opt_over = split_args(argv)
    try:
        opts = load_options(opt_over)
        job = compose_job(job_args)
        cfg, tokenizer = read_model(job.model.path, job.model.cache_dir)
        cfg.check_tensor_parallel(opts.tp)
        hw = load_hardware(hw_name, hw_over)
        max_len = min(job.engine.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        prompts, total, notes = None, None, []
        if opts.sample_rows > 0:
            try:
                tok = tokenizer()
            except (OSError, ValueError) as e:  # config.json alone is enough for the arithmetic
                notes.append(f"input sample skipped (no prefill estimate): no tokenizer: {e}")
            else:
                prompts, total = sample_prompts(job, tok, max_len, opts.sample_rows)
        model_dtype = resolve_dtype(job.model.dtype, "cpu" if hw_name == "cpu" else "cuda")
        regime, resolved = quant_regime(job, cfg, hw, hw_name == "cpu", str(local_model_path(job.model.path,
                                        job.model.cache_dir)), model_dtype, opts.tp)
        notes.append(resolved)
        figures = plan_figures(
            cfg, hw, opts, model_dtype=model_dtype, batch=job.engine.batch_limit,
            max_tokens=job.sampling.max_tokens, kv_budget=job.engine.kv_cache_bytes,
            chunk_tokens=job.engine.max_batched_tokens, prompts=prompts, total_rows=total, regime=regime,
            kv_dtype=resolve_kv_dtype(job.model.kv_cache_dtype, job.model.quant, model_dtype,
                                      "cpu" if hw_name == "cpu" else "cuda"),
        )
    except (JobError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    figures["notes"] = notes
    figures["options"] = asdict(opts)
    from pipeline.model.loader import checkpoint_name

    name = job.model.name or checkpoint_name(local_model_path(job.model.path, job.model.cache_dir))
    print(json.dumps(figures, indent=2) if opts.json else format_table(name, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
