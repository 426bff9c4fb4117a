"""The GPU path checked and timed on one CUDA device, ending in one summary table (docs/gpu.md).

    python bench/gpu_check.py [--model PATH.gguf] [--bandwidth-gbs 4800] [--json out.json] [--quick]

Sections (each row of the table says what it measured):
1. kernels: every Triton kernel against its torch reference (max error; pass/fail by tolerance);
2. agreement: the engine's greedy tokens on the real model (bf16 and float32 on the GPU) against the CPU
   float32 engine, as the share of sequences identical and of tokens before the first difference;
3. quant: each model.quant on the GPU (the calibrated W8A8 path included): held-out perplexity and argmax
   agreement against bf16, and decode tokens/s at batch 256 with CUDA graphs;
4. decode: generated tokens/s at batch 1, 64 and 256, with and without CUDA graphs;
5. GEMM: W4A16, W8A16, W8A8 (Triton and torch._int_mm), FP8 and bf16 throughput at decode shapes against
   torch.matmul and the HBM roofline;
6. job: `python -m pipeline` on 1,024 prompts, its tokens/s and roofline share, against Hugging Face
   `transformers` `generate` at its best batch on the same GPU.
Without --model (or a missing file) sections 2, 3 and 6 are skipped and 4 runs random SmolLM2-shaped weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import quant as quant_bench  # noqa: E402  (bench/quant.py: the CPU table's held-out text and perplexity)
import torch  # noqa: E402

from kernels import paged_attention as pa  # noqa: E402
from kernels.dispatch import int_mm_w8a8  # noqa: E402
from kernels.fp8 import fp8_matmul, fp8_matmul_reference, quantize_fp8_weight  # noqa: E402
from kernels.paged_attention_reference import paged_decode_reference, paged_prefill_reference  # noqa: E402
from kernels.w8a8_reference import w8a8_matmul_reference  # noqa: E402
from kernels.w8a8_triton import w8a8_matmul_triton  # noqa: E402
from kernels.wq_reference import quantize_int4, quantize_int8, wq_matmul_reference  # noqa: E402
from kernels.wq_triton import wq_matmul_triton  # noqa: E402

TABLE: list[tuple[str, str, str, str]] = []  # (section, case, figure, verdict)
# Engines built in this process get a fixed KV budget (one may still be alive when the next is sized);
# the job (its own process) sizes its cache from free memory, kv_cache_memory=auto.
KV_IN_PROCESS = "8GiB"


def row(section: str, case: str, figure: str, verdict: str = "") -> None:
    TABLE.append((section, case, figure, verdict))
    print(f"{section:10s} {case:52s} {figure:40s} {verdict}", flush=True)


def timed(fn, iters: int = 30) -> float:
    """Median seconds per call from CUDA events, after one warm-up call (compilation, autotuning)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------------------------- 1. kernels
def check_kernels() -> None:
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    for block, hq, hkv, splits in ((16, 9, 3, 1), (16, 9, 3, 8), (32, 32, 8, 4), (16, 16, 16, 1)):
        nb, dim = 512, 64 if hq == 9 else 128
        k_pool = torch.randn(hkv, nb, block, dim, device=dev, generator=g).to(bf16)
        v_pool = torch.randn(hkv, nb, block, dim, device=dev, generator=g).to(bf16)
        lens = torch.tensor([1, 17, 300, 1000, 2048, 77, 512, 5], device=dev)
        width = -(-int(lens.max()) // block)
        tables = torch.stack([torch.randperm(nb, device=dev)[:width] for _ in lens]).to(torch.int32)
        q = torch.randn(len(lens), hq, dim, device=dev, generator=g).to(bf16)
        out = pa.paged_decode(q, k_pool, v_pool, tables, lens, dim**-0.5, num_splits=splits)
        ref = paged_decode_reference(q, k_pool, v_pool, tables, lens, dim**-0.5)
        _verdict("kernels", f"paged decode bf16 bs={block} Hq/Hkv={hq}/{hkv} splits={splits}", out, ref, 2**-7)
        starts = [0, 1, 2, 300, 340]  # rows: 2 decodes, a 298-token prefill, a 40-token chunk, 1 row
        plens = torch.tensor([17, 300, 1000, 2048, 77], device=dev)[: len(starts) - 1]
        ptables = tables[: len(plens)].contiguous()
        qp = torch.randn(starts[-1], hq, dim, device=dev, generator=g).to(bf16)
        qs = torch.tensor(starts, device=dev)
        bm = pa.prefill_block_m()
        tiles = torch.tensor(pa.prefill_tiles(starts, 2, bm), device=dev).T.contiguous()
        outp = pa.paged_prefill(qp, k_pool, v_pool, ptables, qs, plens, tiles, dim**-0.5, bm, torch.zeros_like(qp))
        refp = paged_prefill_reference(qp, k_pool, v_pool, ptables, qs, plens, 2, dim**-0.5)
        _verdict("kernels", f"paged prefill bf16 bs={block} Hq/Hkv={hq}/{hkv}", outp, refp, 2**-7)
    _check_prefix_merge()
    for bits, group in ((4, 32), (4, 128), (8, None)):
        for m, n, k in ((1, 4096, 4096), (7, 1000, 4096), (64, 2048, 1536), (257, 512, 2048)):
            w = torch.randn(n, k, device=dev, generator=g) * 0.02
            q, s, mins = quantize_int4(w, group) if bits == 4 else (*quantize_int8(w, group), None)
            x = torch.randn(m, k, device=dev, generator=g).to(bf16)
            y = wq_matmul_triton(x, q, s, mins, bits)
            _verdict("kernels", f"W{bits}A16 g{group or 'chan'} M={m} N={n} K={k}", y, wq_matmul_reference(x, q, s, mins, bits),
                     2**-7)
    for m, n, k in ((1, 4096, 4096), (7, 1000, 4096), (64, 3072, 576), (257, 49152, 641)):
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        qw, sw = quantize_int8(w)
        x = torch.randn(m, k, device=dev, generator=g).to(bf16)
        _verdict("kernels", f"W8A8 Triton int8 GEMM M={m} N={n} K={k}", w8a8_matmul_triton(x, qw, sw),
                 w8a8_matmul_reference(x, qw, sw), 2**-7)
    for m in (1, 64):
        w = torch.randn(4096, 4096, device=dev, generator=g) * 0.02
        wq, ws = quantize_fp8_weight(w)
        x = torch.randn(m, 4096, device=dev, generator=g).to(bf16)
        _verdict("kernels", f"FP8 W8A8 _scaled_mm M={m} 4096x4096", fp8_matmul(x, wq, ws), fp8_matmul_reference(x, wq, ws),
                 2**-7)


def _check_prefix_merge() -> None:
    dev, bf16, block, hq, hkv, dim = "cuda", torch.bfloat16, 16, 9, 3, 64
    g = torch.Generator(device=dev).manual_seed(1)
    k_pool = torch.randn(hkv, 256, block, dim, device=dev, generator=g).to(bf16)
    v_pool = torch.randn(hkv, 256, block, dim, device=dev, generator=g).to(bf16)
    lens = torch.tensor([700, 650, 900, 100], device=dev)
    tables = torch.stack([torch.randperm(256, device=dev)[:57] for _ in lens]).to(torch.int32)
    shared = 40
    tables[1:3, :shared] = tables[0, :shared]  # rows 0-2 share 40 blocks (640 keys)
    q = torch.randn(4, hq, dim, device=dev, generator=g).to(bf16)
    start = torch.tensor([shared, shared, shared, 0], device=dev)
    splits = 2
    o = torch.zeros(splits + 1, 4, hq, dim, device=dev)
    lse = torch.full((splits + 1, 4, hq), float("-inf"), device=dev)
    pa.paged_decode_partial(q, k_pool, v_pool, tables, lens, start, o[:splits], lse[:splits], dim**-0.5)
    per = pa.prefix_rows_per_tile(hq // hkv)
    tiles = torch.tensor(pa.prefix_tiles([3], per), device=dev).T.contiguous()
    pa.prefix_decode_partial(q, k_pool, v_pool, tables[:1, :shared].contiguous(), torch.tensor([shared], device=dev),
                             torch.tensor([0, 1, 2], device=dev), tiles, o[splits], lse[splits], dim**-0.5, per)
    out = pa.merge_partials(o, lse, torch.empty_like(q))
    _verdict("kernels", "shared-prefix decode + LSE merge bf16", out, paged_decode_reference(q, k_pool, v_pool, tables,
             lens, dim**-0.5), 2**-7)


def _verdict(section: str, case: str, got: torch.Tensor, ref: torch.Tensor, rel_tol: float) -> None:
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() or 1.0
    row(section, case, f"max err {err:.2e} ({err / scale:.1e} rel)", "ok" if err <= 2 * rel_tol * scale else "FAIL")


# ------------------------------------------------------------------------------------------- 2. agreement
def _prompts(tokenizer, count: int) -> list[list[int]]:
    import pyarrow.parquet as pq

    texts = [t for f in sorted((ROOT / "data/sample").glob("*.parquet")) for t in pq.read_table(f)["prompt"].to_pylist()]
    texts = (texts * (count // len(texts) + 1))[:count]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": f"{t} ({i})"}]))
            for i, t in enumerate(texts)]


def _greedy(loaded, prompts, device: str, max_tokens: int, **engine) -> list[list[int]]:
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.engine import Engine
    from pipeline.engine.request import Request, SamplingParams

    eng = Engine(loaded, EngineConfig(device=device, kv_cache_memory=KV_IN_PROCESS, **engine))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = {r.id: r.token_ids for r in eng.generate([Request(i, p, sp) for i, p in enumerate(prompts)])}
    return [out[i] for i in range(len(prompts))]


def check_agreement(model_path: str, count: int, max_tokens: int) -> None:
    from pipeline.model.loader import load_model

    torch.set_num_threads(os.cpu_count() or 1)
    cpu = load_model(model_path, torch.float32, device="cpu")
    prompts = _prompts(cpu.tokenizer, count)
    t0 = time.perf_counter()
    ref = _greedy(cpu, prompts, "cpu", max_tokens, max_batch_size=count)
    row("agreement", f"CPU float32 reference: {count} prompts x {max_tokens} tokens", f"{time.perf_counter() - t0:.0f} s")
    del cpu
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_model(model_path, dtype, device="cuda")
        got = _greedy(loaded, prompts, "cuda", max_tokens, max_batch_size=count)
        same = sum(a == b for a, b in zip(got, ref))
        prefix = sum(_common(a, b) for a, b in zip(got, ref))
        total = sum(len(b) for b in ref)
        # float32 on both sides should agree almost everywhere; bf16 diverges after near-ties (reported only).
        verdict = ("ok" if same >= 0.9 * count else "FAIL") if dtype == torch.float32 else ""
        row("agreement", f"GPU {str(dtype)[6:]} greedy vs CPU float32", f"{same}/{count} identical, "
            f"{100 * prefix / total:.1f}% tokens before 1st diff", verdict)
        del loaded
        torch.cuda.empty_cache()


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------------------- 3. quant
QUANT_MODES = ("none", "w8a8", "int8", "int4", "fp8")


def check_quant(model_path: str, tokens: int, batch: int, new_tokens: int) -> None:
    """Every quantized format on the GPU against bf16 on the same GPU: the CPU table's held-out text
    (bench/quant.py), and the engine's decode speed with CUDA graphs."""
    from pipeline.model.loader import load_model

    ref = None
    for quant in QUANT_MODES:
        try:
            t0 = time.perf_counter()
            loaded = load_model(model_path, torch.bfloat16, device="cuda", quant=quant)
            load_s = time.perf_counter() - t0
            model = loaded.model
            if ref is None:
                text = "\n\n".join(quant_bench.docstrings(quant_bench.TEXT_MODULES))
                ids = loaded.tokenizer.encode(text)[:tokens]
            with torch.inference_mode():
                ppl = quant_bench.perplexity(model, ids)
                first = torch.tensor(ids[:512], device="cuda")[None]
                cache = quant_bench.UniformBatchCache(model.config.num_layers, 1, model.scale)
                logits = quant_bench.forward_batch(model, first, cache, 0)[0].float()
            rate = _decode_rate(loaded, batch, new_tokens)
            if ref is None:
                ref = (ppl, logits)
            agree = (logits.argmax(-1) == ref[1].argmax(-1)).float().mean().item()
            err = (logits - ref[1]).abs().max().item()
            # W8A8's bound on the CPU is +2% perplexity against float32; the same bound against bf16 here.
            verdict = ("ok" if ppl <= 1.02 * ref[0] else "over +2% ppl") if quant == "w8a8" else ""
            row("quant", f"{quant} bf16: ppl, argmax vs bf16, max logit err ({len(ids)} tokens)",
                f"{ppl:.3f} ({100 * (ppl / ref[0] - 1):+.2f}%), {100 * agree:.1f}%, {err:.2f}", verdict)
            row("quant", f"{quant} bf16: load (+calibration), decode batch {batch} graphs",
                f"{load_s:.1f} s, {rate:,.0f} tok/s")
        except Exception as e:  # one broken format must not hide the others' figures
            traceback.print_exc()
            row("quant", f"{quant}: failed", f"{type(e).__name__}: {str(e)[:60]}", "FAIL")
        finally:
            loaded = model = None
            torch.cuda.empty_cache()


def _decode_rate(loaded, batch: int, new_tokens: int, graphs: bool = True) -> float:
    """Generated tokens/s of the engine on `batch` random 16-token prompts (prefill included), after a
    warm-up request (graph capture, compilation, autotuning)."""
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.engine import Engine
    from pipeline.engine.request import Request, SamplingParams

    eng = Engine(loaded, EngineConfig(device="cuda", kv_cache_memory=KV_IN_PROCESS, max_batch_size=batch,
                                      cuda_graphs=graphs, max_batched_tokens=max(512, 16 * batch),
                                      prefix_caching=False))
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [Request(i, torch.randint(1, 40000, (16,), generator=g).tolist(), sp) for i in range(batch)]
    list(eng.generate(reqs[:1]))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generated = sum(len(r.token_ids) for r in eng.generate(reqs))
    torch.cuda.synchronize()
    rate = generated / (time.perf_counter() - t0)
    del eng
    torch.cuda.empty_cache()
    return rate


# ---------------------------------------------------------------------------------------------- 4. decode
def _smollm2_shaped(model_path: str | None):
    """The real model in bf16, or random weights of its shape (decode speed does not depend on values)."""
    from pipeline.model.config import ModelConfig
    from pipeline.model.llama import LlamaModel
    from pipeline.model.loader import load_model

    if model_path:
        return load_model(model_path, torch.bfloat16, device="cuda")

    class _Tok:
        eos_token_ids = (0,)

        def decode(self, ids, skip_special_tokens=True):
            return ""

    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    with torch.device("cuda"):
        model = LlamaModel(cfg, dtype=torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return type("Loaded", (), {"model": model, "tokenizer": _Tok(), "config": cfg})()


def check_decode(model_path: str | None, batches: tuple[int, ...], new_tokens: int) -> dict:
    loaded = _smollm2_shaped(model_path)
    speeds = {}
    for batch in batches:
        for graphs in (False, True):
            rate = speeds[batch, graphs] = _decode_rate(loaded, batch, new_tokens, graphs)
            row("decode", f"batch {batch}, CUDA graphs {'on' if graphs else 'off'} (16-token prompts)",
                f"{rate:,.0f} tok/s ({1e3 * batch / rate:.2f} ms/step)")
        row("decode", f"batch {batch}: graphs / eager", f"{speeds[batch, True] / speeds[batch, False]:.2f}x",
            ("ok" if speeds[batch, True] >= 3 * speeds[batch, False] else "below 3x") if batch == 1 else "")
    return speeds


# ------------------------------------------------------------------------------------------------ 5. GEMM
def check_gemm(bandwidth_gbs: float, shapes: dict[str, tuple[int, int]], ms: tuple[int, ...]) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=bf16) * 0.02
        formats = {"bf16 torch.matmul": (lambda x, w=w: torch.matmul(x, w.T), n * k * 2)}
        for bits, group in ((4, 128), (4, 32), (8, None)):
            q, s, mins = quantize_int4(w, group) if bits == 4 else (*quantize_int8(w), None)
            size = sum(t.numel() * t.element_size() for t in (q, s, mins) if t is not None)
            formats[f"W{bits}A16 g{group or 'chan'}"] = (
                lambda x, q=q, s=s, mins=mins, bits=bits: wq_matmul_triton(x, q, s, mins, bits), size)
        qw, sw = quantize_int8(w)
        formats["W8A8 Triton"] = (lambda x, qw=qw, sw=sw: w8a8_matmul_triton(x, qw, sw), n * k + 4 * n)
        formats["W8A8 _int_mm"] = (lambda x, qw=qw, sw=sw: int_mm_w8a8(x, qw, sw), n * k + 4 * n)
        wq, ws = quantize_fp8_weight(w)
        formats["FP8 W8A8"] = (lambda x, wq=wq, ws=ws: fp8_matmul(x, wq, ws), n * k + 4 * n)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=bf16)
            dense = timed(lambda x=x, w=w: torch.matmul(x, w.T))
            for label, (fn, wbytes) in formats.items():
                if label == "W8A8 _int_mm" and m <= 16:
                    continue  # cuBLASLt's int8 GEMM takes more than 16 rows
                sec = dense if label.startswith("bf16") else timed(lambda fn=fn, x=x: fn(x))
                moved = wbytes + (m * k + m * n) * 2
                pct = 100 * moved / sec / 1e9 / bandwidth_gbs
                verdict = ""
                if label == "W4A16 g128" and m == 1 and (n, k) == (4096, 4096):
                    verdict = "ok" if pct >= 60 else "below 60% HBM"
                row("gemm", f"{name} {n}x{k} M={m} {label}",
                    f"{sec * 1e6:7.1f} us {pct:5.1f}% HBM {2 * m * n * k / sec / 1e12:6.1f} TF/s "
                    f"{dense / sec:4.2f}x matmul", verdict)


# ------------------------------------------------------------------------------------------------- 6. job
def check_job(model_path: str, rows: int, max_tokens: int) -> None:
    import pyarrow as pa_
    import pyarrow.parquet as pq

    from pipeline.model.loader import load_model
    from pipeline.model.roofline import Roofline
    from pipeline.perf.probe import load_hardware

    work = Path(tempfile.mkdtemp(prefix="gpu_check_job_"))
    texts = [t for f in sorted((ROOT / "data/sample").glob("*.parquet")) for t in pq.read_table(f)["prompt"].to_pylist()]
    prompts = [f"{texts[i % len(texts)]} (variant {i})" for i in range(rows)]
    pq.write_table(pa_.table({"id": list(range(rows)), "prompt": prompts}), work / "prompts.parquet")
    cmd = [sys.executable, "-m", "pipeline", f"input.path={work}/prompts.parquet", f"output.path={work}/out",
           f"model.path={model_path}", "engine.device=cuda", "hardware=h200", f"sampling.max_tokens={max_tokens}",
           "sampling.temperature=0", "progress.mode=off", "engine.max_batch_size=256", "engine.max_batched_tokens=4096"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)  # PYTHONPATH (the repository) is inherited
    wall = time.perf_counter() - t0
    metrics = json.loads((work / "out" / "_metrics.json").read_text())
    st = metrics["engine"]
    loaded = load_model(model_path, torch.bfloat16, device="cpu")
    roof = Roofline.of(loaded.config, load_hardware("h200"), "bfloat16")
    least = roof.seconds(*roof.work(st["steps"], st["computed_tokens"], st["attention_pairs"]))
    ours = metrics["generated_tokens_per_s"]
    row("job", f"python -m pipeline, {rows} prompts x <= {max_tokens} tokens",
        f"{ours:,.0f} tok/s, {metrics['generate_time_s']:.1f} s ({wall:.0f} s with start-up)")
    row("job", "roofline share (least time / generate time)", f"{100 * least / metrics['generate_time_s']:.1f}%")
    best = _transformers_generate(model_path, prompts, max_tokens, loaded.tokenizer)
    row("job", "transformers generate, best batch, same prompts", f"{best:,.0f} tok/s")
    row("job", "ours / transformers", f"{ours / best:.2f}x", "ok" if ours >= 2 * best else "below 2x")


def _transformers_generate(model_path: str, prompts: list[str], max_tokens: int, tokenizer) -> float:
    """Generated tokens/s of `transformers` greedy `generate` (bf16, SDPA) at its best of a few batches."""
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).cuda().eval()
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    best = 0.0
    for batch in (64, 256, 512):
        t0, generated = time.perf_counter(), 0
        for lo in range(0, len(ids), batch):
            chunk = ids[lo : lo + batch]
            width = max(map(len, chunk))
            x = torch.tensor([[0] * (width - len(c)) + c for c in chunk], device="cuda")
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk], device="cuda")
            with torch.inference_mode():
                out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                     pad_token_id=0)
            generated += (out[:, width:] != 0).sum().item()
        torch.cuda.synchronize()
        rate = generated / (time.perf_counter() - t0)
        row("job", f"transformers generate batch {batch}", f"{rate:,.0f} tok/s")
        best = max(best, rate)
    return best


LLAMA8B = {"o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="SmolLM2-135M-Instruct GGUF (sections 2, 3 and 6 need it)")
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="HBM bandwidth (H200: 4800)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and tokens (a first look)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; nothing was run")
    model = args.model if args.model and Path(args.model).is_file() else None
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  model {model or '(none: random weights)'}",
          flush=True)
    sections = [("kernels", check_kernels)]
    if model:
        sections.append(("agreement", lambda: check_agreement(model, 16 if args.quick else 64, 32)))
        sections.append(("quant", lambda: check_quant(model, 1024 if args.quick else 4096, 256,
                                                      64 if args.quick else 128)))
    sections.append(("decode", lambda: check_decode(model, (1, 64, 256), 64 if args.quick else 128)))
    sections.append(("gemm", lambda: check_gemm(args.bandwidth_gbs, {"o_proj": (4096, 4096)} if args.quick
                                                else LLAMA8B, (1, 16, 64, 256))))
    if model:
        sections.append(("job", lambda: check_job(model, 1024, 64 if args.quick else 128)))
    # A time limit (bench/gpu_check.sh's `timeout`) ends the run with the table of what was measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("gpu_check: stopped by SIGTERM"))
    try:
        for name, fn in sections:
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # one broken section must not hide the others' figures
                traceback.print_exc()
                row(name, "section failed", f"{type(e).__name__}: {str(e)[:60]}", "FAIL")
            print(f"# {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        summarize(args.json)
    sys.exit(1 if any(r[3] == "FAIL" for r in TABLE) else 0)


def summarize(json_path: Path | None) -> None:
    """The summary table on stdout, and the rows as JSON where asked."""
    print("\n| section | case | figure | verdict |\n| --- | --- | --- | --- |")
    for r in TABLE:
        print("| " + " | ".join(r) + " |", flush=True)
    if json_path:
        json_path.write_text(json.dumps([dict(zip(("section", "case", "figure", "verdict"), r)) for r in TABLE], indent=1))


if __name__ == "__main__":
    main()
