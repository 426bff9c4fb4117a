"""The GPU path checked and timed on one CUDA device in one call (docs/gpu.md, "The device check").

    bash bench/gpu_check.sh [--dry-run] [--only kernels,runners,...]

Nothing is staged and no model file is read: the models are random weights of SmolLM2-135M's shape and of
Llama-3-8B's layers (a few of them), built on the device, and the prompts are random token ids. Sections
run in order of importance; each writes its rows to the output folder (`$OUT`, default bench/out/gpu_check)
as it ends: `<n>-<section>.json`, and one line per row appended to `summary.md` as the row is measured. A
section that raises leaves `<n>-<section>.error.txt` (its traceback) and the next section runs.

1. kernels: every Triton kernel (paged decode with and without split-K and a sliding window, prefill,
   shared-prefix merge, W4A16, W8A16, W8A8 and its row quantization, segmented LoRA) and FP8 `_scaled_mm`
   against their torch references, bf16 and float32, GQA groups 3, 4 and 8, head dims 64 and 128, block
   sizes 16 and 32.
2. runners: the engine's own mixed steps (chunked prefill beside decodes, then decodes) run by the GPU
   runner with CUDA graphs, the GPU runner eagerly and the torch runner, on one model: max logit
   difference and argmax agreement per kind of step, and how many steps replayed a graph.
3. decode1: batch-1 decode steps, CUDA graphs against eager, in device milliseconds per step.
4. job: 512 prompts x 128 new tokens at batch 256 through the engine against Hugging Face `transformers`
   `generate` (bf16) at its best batch: tokens/s, their ratio, the share of steps replayed from a graph.
5. gemm: W4A16 and W8A8 GEMMs (and bf16 `torch.matmul`) at M = 1 and 256 on 4096x4096 and 14336x4096,
   timed inside one CUDA graph over more weight copies than L2 holds: share of the measured copy
   bandwidth and of the tensor-core peak.

Every compile and autotune happens before anything is timed (warm-up calls, graph capture at start-up).
`--dry-run`: tiny shapes on CPU under TRITON_INTERPRET=1, nothing timed; every section runs to its end
(the test suite runs it).
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # the interpreter is chosen when triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import paged_attention as pa  # noqa: E402
from kernels.argmax import row_argmax  # noqa: E402
from kernels.fp8 import fp8_matmul, fp8_matmul_reference, quantize_fp8_weight  # noqa: E402
from kernels.paged_attention_reference import (  # noqa: E402
    paged_decode_reference,
    paged_prefill_reference,
)
from kernels.triton_lora import lora_add_, lora_delta_reference, segment_tiles  # noqa: E402
from kernels.w8a8_reference import quantize_rows, w8a8_matmul_reference  # noqa: E402
from kernels.w8a8_triton import quantize_rows_triton, w8a8_matmul_triton  # noqa: E402
from kernels.wq_reference import quantize_int4, quantize_int8, wq_matmul_reference  # noqa: E402
from kernels.wq_triton import wq_matmul_triton  # noqa: E402
from pipeline.engine.config import EngineConfig  # noqa: E402
from pipeline.engine.engine import Engine  # noqa: E402
from pipeline.engine.gpu_runner import GpuRunner  # noqa: E402
from pipeline.engine.request import Request, SamplingParams  # noqa: E402
from pipeline.engine.runner import Runner, StepBatch  # noqa: E402
from pipeline.model.config import ModelConfig  # noqa: E402
from pipeline.model.llama import LlamaModel  # noqa: E402

# (name contains, HBM GB/s, dense bf16 TFLOP/s, dense int8 TOP/s): the vendors' datasheet figures, first
# match wins. The copy bandwidth is measured; the HBM figure is printed beside it.
PEAKS = (("H200", 4800, 989, 1979), ("H100 NVL", 3900, 835, 1671), ("H100 PCIe", 2000, 756, 1513),
         ("H100", 3350, 989, 1979))

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                      tie_word_embeddings=True)
LLAMA3_8B_LAYERS = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=4,
                               num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                               max_position_embeddings=8192)
TINY_SMOLLM2 = replace(SMOLLM2, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)
TINY_LLAMA = replace(LLAMA3_8B_LAYERS, vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=8, num_kv_heads=1, head_dim=16)


@dataclass
class Ctx:
    """What every section needs: where it runs, how big, where its rows go."""

    device: torch.device
    dry: bool
    out: Path
    name: str  # the GPU's, or the dry run's

    @property
    def peaks(self) -> tuple[float, float, float]:
        """(HBM GB/s, dense bf16 TFLOP/s, dense int8 TOP/s) of this GPU, from PEAKS."""
        for key, hbm, bf16, int8 in PEAKS:
            if key in self.name:
                return hbm, bf16, int8
        raise ValueError(f"no peak figures for {self.name!r} in bench/gpu_check.py's PEAKS (H100 and H200 kinds)")

    @property
    def smollm2(self) -> ModelConfig:
        return TINY_SMOLLM2 if self.dry else SMOLLM2

    @property
    def llama(self) -> ModelConfig:
        return TINY_LLAMA if self.dry else LLAMA3_8B_LAYERS

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Rows:
    """One section's rows: each appended to summary.md as it is made, all written to its JSON at the end."""

    def __init__(self, ctx: Ctx, section: str):
        self.ctx, self.section, self.rows = ctx, section, []

    def add(self, case: str, figure: str, verdict: str = "", **data) -> None:
        self.rows.append({"case": case, "figure": figure, "verdict": verdict, **data})
        line = f"| {self.section} | {case} | {figure} | {verdict} |"
        print(line, flush=True)
        with open(self.ctx.out / "summary.md", "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------------------------- shared
def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaModel:
    """Random weights scaled like a trained model's (unit-variance activations), built on the device."""
    with torch.device(device):
        model = LlamaModel(cfg, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=device) * p.shape[-1] ** -0.5)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=device))
    return model


class _NoTokenizer:
    """The engine's tokenizer needs: no EOS (every request runs to max_tokens), no text."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class Loaded:
    model: LlamaModel
    tokenizer: _NoTokenizer
    config: ModelConfig


def prompts(count: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def gpu_runner_factory(cuda_graphs: bool, max_batch_size: int):
    """The engine's runner factory on CPU (the dry run): GpuRunner on the interpreter, as on CUDA."""
    def make(model, num_blocks, block_size, device):
        return GpuRunner(model, num_blocks, block_size, device, cuda_graphs, max_batch_size)
    return make


def engine(ctx: Ctx, model: LlamaModel, kv: str, batch: int, tokens: int, max_len: int) -> Engine:
    """An engine over `model` with a fixed KV budget and CUDA graphs (on CUDA it runs GpuRunner, on CPU the
    same through the factory). max_len: the longest sequence, which sizes the graphs' block tables."""
    config = EngineConfig(device=str(ctx.device), kv_cache_memory=kv, max_batch_size=batch, max_model_len=max_len,
                          max_batched_tokens=tokens, prefix_caching=False)
    return Engine(Loaded(model, _NoTokenizer(), model.config), config, make_runner=gpu_runner_factory(True, batch))


def greedy_requests(ps: list[list[int]], max_tokens: int) -> list[Request]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [Request(i, p, sp) for i, p in enumerate(ps)]


def graph_timed(ctx: Ctx, calls: list[Callable[[], object]], replays: int = 3) -> float:
    """Device seconds per call with `calls` captured once into one CUDA graph (after a warm-up run of each:
    compilation and autotuning happen outside), the median of `replays` timed replays."""
    for fn in calls:
        fn()
    ctx.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2] / len(calls)


# ------------------------------------------------------------------------------------------- 1. kernels
def check_kernels(ctx: Ctx, rows: Rows) -> None:
    # (block size, Hq, Hkv, head dim): SmolLM2's group of 3, Llama-3-8B's group of 4, a group of 8
    cases = ((16, 4, 2, 16), (32, 8, 1, 16)) if ctx.dry else ((16, 9, 3, 64), (32, 32, 8, 128), (32, 32, 4, 128))
    for dtype in (torch.bfloat16, torch.float32):
        for block, hq, hkv, dim in cases:
            _attention(ctx, rows, dtype, block, hq, hkv, dim)
        _prefix_merge(ctx, rows, dtype)
        _gemms(ctx, rows, dtype)
        _lora(ctx, rows, dtype)
    if ctx.device.type != "cuda" or torch.cuda.get_device_capability(ctx.device) < (8, 9):
        rows.add("FP8 _scaled_mm", "skipped: needs FP8 tensor cores (Ada, Hopper)")
        return
    g = torch.Generator(device=ctx.device).manual_seed(5)
    for m in (1, 64):
        w = torch.randn(4096, 4096, device=ctx.device, generator=g) * 0.02
        wq, ws = quantize_fp8_weight(w)
        x = torch.randn(m, 4096, device=ctx.device, generator=g).to(torch.bfloat16)
        _verdict(rows, f"FP8 _scaled_mm bf16 M={m} 4096x4096", fp8_matmul(x, wq, ws), fp8_matmul_reference(x, wq, ws),
                 2**-7)


def _tol(dtype: torch.dtype) -> float:
    """Relative tolerance: bf16 rounding of the output, or float32 accumulation-order noise."""
    return 2**-7 if dtype == torch.bfloat16 else 1e-4


def _attention(ctx: Ctx, rows: Rows, dtype: torch.dtype, block: int, hq: int, hkv: int, dim: int) -> None:
    dev = ctx.device
    g = torch.Generator(device=dev).manual_seed(block + hq)
    lens = [1, 17, 40, 5] if ctx.dry else [1, 17, 300, 1000, 2048, 77, 512, 5]
    width = -(-max(lens) // block)
    nb = len(lens) * width + 1
    k_pool = torch.randn(hkv, nb, block, dim, device=dev, generator=g).to(dtype)
    v_pool = torch.randn(hkv, nb, block, dim, device=dev, generator=g).to(dtype)
    tables = torch.randperm(nb - 1, device=dev)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    ctx_lens = torch.tensor(lens, device=dev)
    q = torch.randn(len(lens), hq, dim, device=dev, generator=g).to(dtype)
    name = f"{str(dtype)[6:]} bs={block} Hq/Hkv={hq}/{hkv} D={dim}"
    for splits, window in ((1, None), (4, None), (3, 24 if ctx.dry else 500)):
        out = pa.paged_decode(q, k_pool, v_pool, tables, ctx_lens, dim**-0.5, num_splits=splits, window=window)
        ref = paged_decode_reference(q, k_pool, v_pool, tables, ctx_lens, dim**-0.5, window)
        _verdict(rows, f"paged decode {name} splits={splits} window={window}", out, ref, _tol(dtype))
    # rows: two decodes (not the prefill kernel's), then chunks of the remaining sequences after context
    new = [1, 1, 20, 3] if ctx.dry else [1, 1, 300, 40, 200, 77, 100, 5]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    qp = torch.randn(starts[-1], hq, dim, device=dev, generator=g).to(dtype)
    qs = torch.tensor(starts, device=dev)
    bm = pa.prefill_block_m()
    tiles = torch.tensor(pa.prefill_tiles(starts, 2, bm), device=dev).T.contiguous()
    for window in (None, 16 if ctx.dry else 128):
        out = pa.paged_prefill(qp, k_pool, v_pool, tables, qs, ctx_lens, tiles, dim**-0.5, bm, torch.zeros_like(qp),
                               window)
        ref = paged_prefill_reference(qp, k_pool, v_pool, tables, qs, ctx_lens, 2, dim**-0.5, window)
        _verdict(rows, f"paged prefill {name} window={window}", out, ref, _tol(dtype))


def _prefix_merge(ctx: Ctx, rows: Rows, dtype: torch.dtype) -> None:
    """Three rows sharing their first blocks: prefix pass + own pass, merged by log-sum-exp."""
    dev, block, hq, hkv, dim = ctx.device, 16, 9, 3, 64
    lens = [70, 65, 90, 10] if ctx.dry else [700, 650, 900, 100]
    shared = 3 if ctx.dry else 40
    g = torch.Generator(device=dev).manual_seed(1)
    width = -(-max(lens) // block)
    nb = len(lens) * width
    k_pool = torch.randn(hkv, nb, block, dim, device=dev, generator=g).to(dtype)
    v_pool = torch.randn(hkv, nb, block, dim, device=dev, generator=g).to(dtype)
    tables = torch.randperm(nb, device=dev).view(len(lens), width).to(torch.int32)
    tables[1:3, :shared] = tables[0, :shared]
    q = torch.randn(len(lens), hq, dim, device=dev, generator=g).to(dtype)
    ctx_lens = torch.tensor(lens, device=dev)
    start = torch.tensor([shared, shared, shared, 0], device=dev)
    splits = 2
    o = torch.zeros(splits + 1, len(lens), hq, dim, device=dev)
    lse = torch.full((splits + 1, len(lens), hq), float("-inf"), device=dev)
    pa.paged_decode_partial(q, k_pool, v_pool, tables, ctx_lens, start, o[:splits], lse[:splits], dim**-0.5)
    per = pa.prefix_rows_per_tile(hq // hkv)
    tiles = torch.tensor(pa.prefix_tiles([3], per), device=dev).T.contiguous()
    pa.prefix_decode_partial(q, k_pool, v_pool, tables[:1, :shared].contiguous(), torch.tensor([shared], device=dev),
                             torch.tensor([0, 1, 2], device=dev), tiles, o[splits], lse[splits], dim**-0.5, per)
    out = pa.merge_partials(o, lse, torch.empty_like(q))
    ref = paged_decode_reference(q, k_pool, v_pool, tables, ctx_lens, dim**-0.5)
    _verdict(rows, f"shared-prefix decode + merge {str(dtype)[6:]}", out, ref, _tol(dtype))


def _gemms(ctx: Ctx, rows: Rows, dtype: torch.dtype) -> None:
    dev = ctx.device
    g = torch.Generator(device=dev).manual_seed(2)
    shapes = ((1, 64, 128), (17, 96, 256)) if ctx.dry else ((1, 4096, 4096), (7, 1000, 4096), (256, 14336, 4096))
    if dtype == torch.float32:  # one shape: every compile and autotune costs seconds on the device
        shapes = shapes[1:2]
    for m, n, k in shapes:
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        x = torch.randn(m, k, device=dev, generator=g).to(dtype)
        for bits, group in ((4, 32), (4, 128), (8, None)):
            q, s, mins = quantize_int4(w, group) if bits == 4 else (*quantize_int8(w, group), None)
            _verdict(rows, f"W{bits}A16 g{group or 'chan'} {str(dtype)[6:]} M={m} N={n} K={k}",
                     wq_matmul_triton(x, q, s, mins, bits), wq_matmul_reference(x, q, s, mins, bits), _tol(dtype))
        qw, sw = quantize_int8(w)
        _verdict(rows, f"W8A8 Triton {str(dtype)[6:]} M={m} N={n} K={k}", w8a8_matmul_triton(x, qw, sw),
                 w8a8_matmul_reference(x, qw, sw), _tol(dtype))
        q, s = quantize_rows_triton(x)
        ref_q, ref_s = quantize_rows(x)
        differ = (q != ref_q).sum().item() + (s != ref_s).sum().item()
        rows.add(f"W8A8 row quantization kernel {str(dtype)[6:]} M={m} K={k} vs quantize_rows",
                 f"{differ} values differ", "ok" if differ == 0 else "FAIL", differ=differ)


def _lora(ctx: Ctx, rows: Rows, dtype: torch.dtype) -> None:
    """The segmented LoRA kernel: decodes of four adapters and a prefill chunk of one, base rows between."""
    dev = ctx.device
    g = torch.Generator(device=dev).manual_seed(3)
    k, n = (96, 80) if ctx.dry else (4096, 14336)
    runs = [(0, 5, 0), (5, 9, 3), (10, 11, 1), (11, 14, 2), (14, 60 if ctx.dry else 526, 1)]
    slots = [-1] * runs[-1][1]
    for start, end, slot in runs:
        slots[start:end] = [slot] * (end - start)
    for rank in (16, 64):
        a = (torch.randn(4, k, rank, device=dev, generator=g) * k**-0.5).to(dtype)
        b = (torch.randn(4, rank, n, device=dev, generator=g) * 0.1).to(dtype)
        x = torch.randn(len(slots), k, device=dev, generator=g).to(dtype)
        y = torch.randn(len(slots), n, device=dev, generator=g).to(dtype)
        ref = lora_delta_reference(x, y, a, b, slots)
        got = lora_add_(x, y.clone(), a, b, segment_tiles(runs, dev))
        _verdict(rows, f"segmented LoRA {str(dtype)[6:]} rank {rank} T={len(slots)} {k}->{n}", got, ref, _tol(dtype))


def _verdict(rows: Rows, case: str, got: torch.Tensor, ref: torch.Tensor, rel_tol: float) -> None:
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() or 1.0
    rows.add(case, f"max err {err:.2e} ({err / scale:.1e} of max)", "ok" if err <= 2 * rel_tol * scale else "FAIL",
             max_err=err, rel_err=err / scale)


# ------------------------------------------------------------------------------------------- 2. runners
class ThreeRunners:
    """Stands in for the engine's runner: every step goes to the GPU runner with graphs (the engine's own),
    the GPU runner eagerly and the torch runner, each with its own KV pools; the torch runner's logits
    drive the engine. Records each step's kind and differences."""

    def __init__(self, graphs: GpuRunner, num_blocks: int, block_size: int, device: torch.device):
        model = graphs.model
        self.graphs = graphs
        self.eager = GpuRunner(model, num_blocks, block_size, device, cuda_graphs=False)
        self.torch = Runner(model, num_blocks, block_size, device)
        self.attn = self.torch.attn
        self.steps: list[dict] = []

    def execute(self, batch: StepBatch) -> torch.Tensor:
        ref = self.torch.execute(batch)
        replays = self.graphs.replays
        graphs = self.graphs.execute(batch)
        eager = self.eager.execute(batch)
        kind = ("decode" if batch.num_decodes == batch.num_tokens
                else "mixed" if batch.num_decodes else "prefill")
        same = (row_argmax(eager) == row_argmax(ref)).sum().item()
        self.steps.append({
            "kind": kind, "rows": ref.shape[0], "replayed": self.graphs.replays > replays,
            "eager_vs_torch": (eager - ref).abs().max().item() if ref.numel() else 0.0,
            "graphs_vs_eager": (graphs - eager).abs().max().item() if ref.numel() else 0.0,
            "argmax_same": same, "logit_scale": ref.abs().max().item() if ref.numel() else 1.0,
        })
        return ref

    def execute_greedy(self, batch: StepBatch) -> torch.Tensor:
        return row_argmax(self.execute(batch))


def check_runners(ctx: Ctx, rows: Rows) -> None:
    batch = 4 if ctx.dry else 32
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(ctx.smollm2, dtype, ctx.device)
        eng = engine(ctx, model, "16MiB" if ctx.dry else "2GiB", batch, 32 if ctx.dry else 256, 512)
        three = eng.runner = ThreeRunners(eng.runner, eng.num_blocks, eng.config.block_size, ctx.device)
        ps = prompts(5 if ctx.dry else 48, 3, 30 if ctx.dry else 400, model.config.vocab_size, seed=3)
        list(eng.generate(greedy_requests(ps, 3 if ctx.dry else 16)))
        # of the largest logit: float32 runners agree to rounding; in bf16 the torch runner's attention
        # runs in bf16 (the kernels in float32), so only a gross difference fails
        tol_graphs, tol_torch = (1e-3, 1e-3) if dtype == torch.float32 else (5e-2, 0.25)
        for kind in ("prefill", "mixed", "decode"):
            steps = [s for s in three.steps if s["kind"] == kind]
            if not steps:
                continue
            scale = max(s["logit_scale"] for s in steps)
            vs_torch = max(s["eager_vs_torch"] for s in steps)
            vs_eager = max(s["graphs_vs_eager"] for s in steps)
            same = sum(s["argmax_same"] for s in steps) / max(1, sum(s["rows"] for s in steps))
            replayed = sum(s["replayed"] for s in steps)
            ok = vs_torch <= tol_torch * scale and vs_eager <= tol_graphs * scale
            rows.add(f"SmolLM2-shaped {str(dtype)[6:]}: {len(steps)} {kind} steps ({replayed} replayed)",
                     f"max |logit diff| eager-torch {vs_torch:.2e}, graphs-eager {vs_eager:.2e} (max logit "
                     f"{scale:.1f}); argmax eager=torch {100 * same:.1f}%", "ok" if ok else "FAIL",
                     steps=len(steps), replayed=replayed, eager_vs_torch=vs_torch, graphs_vs_eager=vs_eager,
                     argmax_same=same, logit_scale=scale)
        if ctx.device.type == "cuda" and not any(s["replayed"] for s in three.steps):
            rows.add(f"SmolLM2-shaped {str(dtype)[6:]}: graph replays", "no step replayed a graph", "FAIL")
        del eng, three, model
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- 3. decode1
def one_decode(context: int, block_size: int) -> StepBatch:
    """A batch-1 decode step at `context` keys in blocks 0, 1, ... (the same slot every step)."""
    blocks = -(-context // block_size)
    pos = torch.tensor([context - 1])
    return StepBatch(input_ids=torch.tensor([7]), positions=pos, slot_mapping=pos.clone(),
                     query_start=torch.tensor([0, 1]), context_lens=torch.tensor([context]),
                     block_tables=torch.arange(blocks)[None], num_decodes=1, logits_rows=torch.tensor([0]))


def check_decode1(ctx: Ctx, rows: Rows) -> None:
    steps, block = (2, 16) if ctx.dry else (200, 16)
    for label, cfg in (("SmolLM2-shaped", ctx.smollm2), (f"Llama-3-8B-shaped x{ctx.llama.num_layers} layers", ctx.llama)):
        model = random_model(cfg, torch.bfloat16, ctx.device)
        batch = one_decode(64 if ctx.dry else 1024, block)
        ms = {}
        for graphs in (False, True):
            run = GpuRunner(model, batch.block_tables.shape[1] + 1, block, ctx.device, graphs, max_batch_size=1,
                            max_model_len=batch.block_tables.shape[1] * block)
            for _ in range(3):  # compiles outside the timing
                run.execute_greedy(batch)
            ctx.sync()
            start = time.perf_counter()
            if ctx.device.type == "cuda":
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
            for _ in range(steps):
                run.execute_greedy(batch)
            if ctx.device.type == "cuda":
                t1.record()
                t1.synchronize()
                ms[graphs] = t0.elapsed_time(t1) / steps
            else:
                ms[graphs] = 1e3 * (time.perf_counter() - start) / steps
            assert not graphs or ctx.device.type != "cuda" or run.replays >= steps
            del run
        if ctx.dry:
            rows.add(f"{label} batch 1", "dry run: not timed")
        else:
            ratio = ms[False] / ms[True]
            target = ("ok" if ratio >= 3 else "below 3x") if cfg is SMOLLM2 else ""
            rows.add(f"{label} batch 1, context {batch.context_lens.item()}",
                     f"eager {ms[False]:.3f} ms/step, graphs {ms[True]:.3f} ms/step: {ratio:.2f}x", target,
                     eager_ms=ms[False], graphs_ms=ms[True])
        del model


# ----------------------------------------------------------------------------------------------- 4. job
def check_job(ctx: Ctx, rows: Rows) -> None:
    count, new, batch, longest = (8, 3, 4, 24) if ctx.dry else (512, 128, 256, 512)
    cfg = ctx.smollm2
    ps = prompts(count, 8, longest, cfg.vocab_size, seed=4)
    model = random_model(cfg, torch.bfloat16, ctx.device)
    eng = engine(ctx, model, "16MiB" if ctx.dry else "8GiB", batch, 32 if ctx.dry else 4096, longest + new)
    list(eng.generate(greedy_requests(prompts(batch, 8, longest, cfg.vocab_size, seed=5), 3)))  # compiles
    before = (eng.stats.steps, getattr(eng.runner, "replays", 0))
    ctx.sync()
    t0 = time.perf_counter()
    generated = sum(len(r.token_ids) for r in eng.generate(greedy_requests(ps, new)))
    ctx.sync()
    seconds = time.perf_counter() - t0
    steps, replays = eng.stats.steps - before[0], getattr(eng.runner, "replays", 0) - before[1]
    ours = generated / seconds
    rows.add(f"engine: {count} prompts x {new} tokens, batch {batch}, SmolLM2-shaped bf16",
             f"{ours:,.0f} tok/s ({seconds:.1f} s), {replays}/{steps} steps replayed ({100 * replays / steps:.0f}%)",
             tok_s=ours, seconds=seconds, steps=steps, replayed=replays)
    del eng, model
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    best = _transformers(ctx, rows, cfg, ps, new, (4, 8) if ctx.dry else (512, 256, 128, 64))
    if not ctx.dry:
        rows.add("ours / transformers best", f"{ours / best:.2f}x", "ok" if ours >= 2 * best else "below 2x",
                 ratio=ours / best)


def _transformers(ctx: Ctx, rows: Rows, cfg: ModelConfig, ps: list[list[int]], new: int,
                  batches: tuple[int, ...]) -> float:
    """Generated tokens/s of `transformers` greedy `generate` on the same shape (random weights, bf16, its
    default attention) at each batch; the best."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
                         max_position_embeddings=cfg.max_position_embeddings, pad_token_id=0, eos_token_id=None,
                         bos_token_id=None)
    with torch.device(ctx.device):
        hf = LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()

    def run(chunk: list[list[int]]) -> int:
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(c)) + c for c in chunk], device=ctx.device)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk], device=ctx.device)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)
        return (out.shape[1] - width) * len(chunk)

    run(ps[:2])  # warm-up
    best = 0.0
    for batch in batches:
        ctx.sync()
        t0, generated = time.perf_counter(), 0
        for lo in range(0, len(ps), batch):
            generated += run(ps[lo : lo + batch])
        ctx.sync()
        rate = generated / (time.perf_counter() - t0)
        rows.add(f"transformers generate bf16, batch {batch}", f"{rate:,.0f} tok/s", tok_s=rate, batch=batch)
        best = max(best, rate)
    return best


# ---------------------------------------------------------------------------------------------- 5. gemm
def copy_bandwidth(ctx: Ctx) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), measured on 1 GiB."""
    src = torch.empty(2**30, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_timed(ctx, [lambda: dst.copy_(src)] * 4) / 1e9


def check_gemm(ctx: Ctx, rows: Rows) -> None:
    dev = ctx.device
    shapes = ((64, 128), (96, 256)) if ctx.dry else ((4096, 4096), (14336, 4096))
    ms = (1, 17) if ctx.dry else (1, 256)
    if not ctx.dry:
        bw = copy_bandwidth(ctx)
        hbm, bf16_peak, int8_peak = ctx.peaks
        rows.add("copy bandwidth (1 GiB device copy)", f"{bw:,.0f} GB/s ({100 * bw / hbm:.0f}% of {hbm:,} GB/s HBM)",
                 gbs=bw)
        l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    g = torch.Generator(device=dev).manual_seed(6)
    for n, k in shapes:
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        q4, s4, mins4 = quantize_int4(w, 128)
        q8, s8 = quantize_int8(w)
        wb = w.to(torch.bfloat16)
        formats = {  # label: (weight tensors, fn(x, weights), peak in TFLOP/s)
            "W4A16 g128": ((q4, s4, mins4), lambda x, t: wq_matmul_triton(x, t[0], t[1], t[2], 4), "bf16"),
            "W8A8 (with activation quantization)": ((q8, s8), lambda x, t: w8a8_matmul_triton(x, t[0], t[1]), "int8"),
            "bf16 torch.matmul": ((wb,), lambda x, t: torch.matmul(x, t[0].T), "bf16"),
        }
        for label, (weights, fn, peak_kind) in formats.items():
            wbytes = sum(t.numel() * t.element_size() for t in weights if t is not None)
            copies = 2 if ctx.dry else max(2, -(-3 * l2 // wbytes))  # more than L2 holds: every call reads HBM
            sets = [tuple(t.clone() if t is not None else None for t in weights) for _ in range(copies)]
            for m in ms:
                x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
                calls = [lambda x=x, t=t, fn=fn: fn(x, t) for t in sets]
                if ctx.dry:
                    for call in calls:
                        call()
                    rows.add(f"{label} M={m} N={n} K={k}", "dry run: not timed")
                    continue
                calls = calls * max(1, 64 // copies)
                sec = graph_timed(ctx, calls)
                moved = wbytes + 2 * (m * k + m * n)
                flops = 2 * m * n * k
                peak = bf16_peak if peak_kind == "bf16" else int8_peak
                rows.add(f"{label} M={m} N={n} K={k} ({copies} weight copies)",
                         f"{sec * 1e6:8.1f} us, {100 * moved / sec / 1e9 / bw:5.1f}% copy bw, "
                         f"{100 * flops / sec / 1e12 / peak:5.1f}% {peak_kind} peak",
                         _gemm_target(label, m, n, k, moved / sec / 1e9 / bw), us=sec * 1e6,
                         bw_share=moved / sec / 1e9 / bw, peak_share=flops / sec / 1e12 / peak)
            del sets


def _gemm_target(label: str, m: int, n: int, k: int, bw_share: float) -> str:
    if label.startswith("W4A16") and m == 1 and (n, k) == (4096, 4096):
        return "ok" if bw_share >= 0.6 else "below 60% bw"
    return ""


# ---------------------------------------------------------------------------------------------- driver
SECTIONS: dict[str, Callable[[Ctx, Rows], None]] = {
    "kernels": check_kernels, "runners": check_runners, "decode1": check_decode1, "job": check_job,
    "gemm": check_gemm,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton's interpreter), no timing")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench/out/gpu_check"))
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections, in the order given")
    args = ap.parse_args(argv)
    if args.dry_run:
        ctx = Ctx(torch.device("cpu"), True, args.out, "cpu (dry run)")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    else:
        ctx = Ctx(torch.device("cuda"), False, args.out, torch.cuda.get_device_name())
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    about = {"device": ctx.name, "torch": torch.__version__, "triton": triton.__version__, "dry_run": ctx.dry}
    (args.out / "device.json").write_text(json.dumps(about, indent=1))
    with open(args.out / "summary.md", "a") as f:
        f.write(f"\n# gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')} on {about['device']}, torch {torch.__version__}\n"
                "| section | case | figure | verdict |\n| --- | --- | --- | --- |\n")
    failed = False
    for n, name in enumerate(args.only.split(","), 1):
        rows = Rows(ctx, name)
        t0 = time.perf_counter()
        try:
            SECTIONS[name](ctx, rows)
        except Exception:  # one broken section must not hide the others' figures
            failed = True
            (args.out / f"{n}-{name}.error.txt").write_text(traceback.format_exc())
            rows.add("section failed", traceback.format_exc().strip().splitlines()[-1][:200], "FAIL")
        finally:
            (args.out / f"{n}-{name}.json").write_text(json.dumps(
                {"section": name, "seconds": time.perf_counter() - t0, "rows": rows.rows}, indent=1))
        failed |= any(r["verdict"] == "FAIL" for r in rows.rows)
        print(f"# {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
