"""The GPU step path on CPU: `GpuRunner` with the Triton kernels under TRITON_INTERPRET=1 against the
reference decoding, its sync-freedom, and the pure logic behind CUDA graphs and memory sizing. The tests
that need a GPU skip without one (bench/gpu_check.sh runs the path on a real device)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("triton")
import kernels.paged_attention as pa  # noqa: E402
from pipeline.config import resolve_dtype  # noqa: E402
from pipeline.engine import gpu_runner, runner  # noqa: E402
from pipeline.engine.config import EngineConfig  # noqa: E402
from pipeline.engine.device_tables import DeviceBlockTables  # noqa: E402
from pipeline.engine.engine import Engine  # noqa: E402
from pipeline.engine.gpu_runner import GpuRunner, graph_bucket, graph_buckets, plan_step  # noqa: E402
from pipeline.engine.memory import kv_cache_budget  # noqa: E402
from pipeline.engine.request import Request, SamplingParams  # noqa: E402
from pipeline.engine.runner import build_batch  # noqa: E402
from pipeline.engine.sampler import sample  # noqa: E402
from pipeline.parallel.pool import rank_device  # noqa: E402
from tests.engine.conftest import EOS, build_tiny, random_prompts  # noqa: E402
from tests.reference import greedy  # noqa: E402

if type(pa._decode_kernel).__name__ != "InterpretedFunction":  # imported earlier without the interpreter
    pa = importlib.reload(pa)
    gpu_runner = importlib.reload(gpu_runner)
    GpuRunner, plan_step = gpu_runner.GpuRunner, gpu_runner.plan_step

BLOCK = 16


def interpreted_runner(num_sms: int):
    """GpuRunner on CPU; num_sms pretends a GPU that size so decode_splits picks split-K."""
    def make(model, num_blocks, block_size, device):
        r = GpuRunner(model, num_blocks, block_size, device, cuda_graphs=False)
        r.num_sms = num_sms
        return r
    return make


def test_graph_buckets_and_choice():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(44) == [1, 2, 4, 8, 16, 24, 32, 40, 44]
    assert graph_buckets(1) == [1] and graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(256)[10:] == [64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert graph_buckets(300)[-3:] == [256, 288, 300]
    for size in (1, 7, 64, 100, 256, 1000):  # every batch pads by less than a step of 8 / 16 / 32 rows
        buckets = graph_buckets(size)
        for rows in range(1, size + 1):
            padded = graph_bucket(rows, buckets)
            assert rows <= padded < rows + (8 if rows <= 64 else 16 if rows <= 128 else 32)
    buckets = graph_buckets(48)
    assert [graph_bucket(n, buckets) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 24, 40, 48]
    assert graph_bucket(49, buckets) is None  # larger than max_batch_size: eager


def test_engine_on_triton_kernels_matches_reference(tiny, monkeypatch):
    """Prompts sharing a 40-token prefix (shared-prefix pass), chunked prefill, split-K decode: the greedy
    tokens equal single-sequence decoding with a contiguous cache."""
    monkeypatch.setattr(runner, "MIN_SAVED_BLOCKS", 1)
    plans = []
    real_plan = gpu_runner.plan_step

    def spy(*args, **kwargs):
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(gpu_runner, "plan_step", spy)
    shared = random_prompts(1, 40, 40, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(4, 3, 12, seed=4)] + random_prompts(2, 20, 50, seed=5)
    sp = SamplingParams(max_tokens=6)
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB", block_size=BLOCK, max_batched_tokens=48),
                    make_runner=interpreted_runner(num_sms=64))
    results = {r.id: r.token_ids for r in engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])}
    for i, p in enumerate(prompts):
        assert results[i] == greedy(tiny.model, p, 6, stop_token_ids=[EOS]), i
    assert any(p.prefix_groups for p in plans), "no step used the shared-prefix pass"
    assert any(p.num_splits > 1 for p in plans), "no step split a row's blocks"
    assert any(p.num_prefill_tiles and p.num_decodes for p in plans), "no mixed prefill + decode step"


def test_sliding_window_model_on_triton_kernels_matches_reference(monkeypatch):
    """A Mistral-style window shorter than the prompts: chunked prefill and split-K decode see only each
    query's last `window` keys, as the contiguous reference does (shared-prefix groups are not formed)."""
    monkeypatch.setattr(runner, "MIN_SAVED_BLOCKS", 1)
    loaded = build_tiny(seed=2)
    loaded.model.config = loaded.config = replace(loaded.config, sliding_window=12)
    shared = random_prompts(1, 40, 40, seed=6)[0]
    prompts = [shared + tail for tail in random_prompts(2, 3, 9, seed=7)] + random_prompts(2, 20, 45, seed=8)
    sp = SamplingParams(max_tokens=8)
    engine = Engine(loaded, EngineConfig(kv_cache_memory="8MiB", block_size=BLOCK, max_batched_tokens=32),
                    make_runner=interpreted_runner(num_sms=64))
    results = {r.id: r.token_ids for r in engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])}
    for i, p in enumerate(prompts):
        assert results[i] == greedy(loaded.model, p, 8, stop_token_ids=[EOS]), i


class EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay reruns the captured step on the static buffer and
    writes the static logits, as a real replay does."""

    def __init__(self, runner_: GpuRunner, bucket: int):
        self.body = runner_.graph_body
        self.plan, self.static = runner_.graph_inputs(bucket)
        self.logits = self.body(self.plan, self.static)
        self.replays = 0

    def replay(self) -> None:
        self.logits.copy_(self.body(self.plan, self.static))
        self.replays += 1


def emulated_graphs(graphs: dict[int, EagerGraph], max_batch_size: int):
    """A runner factory: GpuRunner on the interpreter with every bucket's graph emulated."""
    def make(model, num_blocks, block_size, device):
        r = GpuRunner(model, num_blocks, block_size, device, cuda_graphs=False, max_batch_size=max_batch_size,
                      max_model_len=128)
        for bucket in r.buckets:
            graphs[bucket] = EagerGraph(r, bucket)
            r._graphs[bucket] = (graphs[bucket], graphs[bucket].static, graphs[bucket].plan, graphs[bucket].logits)
        return r
    return make


def test_engine_with_graph_replay_matches_reference(tiny):
    """Decode steps replayed from (emulated) graphs, beside one-token prefill chunks (a token budget below
    the batch size), with sequences growing past block boundaries and finishing at different steps (rows
    move): the greedy tokens equal the reference, and the device block tables hold what was sent."""
    graphs: dict[int, EagerGraph] = {}
    prompts = random_prompts(6, 10, 28, seed=12)
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB", block_size=BLOCK, max_batched_tokens=4,
                                       max_batch_size=8), make_runner=emulated_graphs(graphs, 8))
    requests = [Request(i, p, SamplingParams(max_tokens=4 + 2 * i)) for i, p in enumerate(prompts)]
    results = {r.id: r.token_ids for r in engine.generate(requests)}
    for i, p in enumerate(prompts):
        assert results[i] == greedy(tiny.model, p, 4 + 2 * i, stop_token_ids=[EOS]), i
    assert sum(g.replays for g in graphs.values()) > 0, "no step replayed a graph"
    assert torch.equal(engine.runner.tables.device_tables, engine.runner.tables.sent)


def test_warm_up_runs_every_split_count(tiny, monkeypatch):
    """Start-up runs the decode kernel once per split count it may choose, so that none compiles later
    (in a timed step, or never inside a graph capture)."""
    seen = set()
    real = gpu_runner.paged_decode_partial

    def spy(q, k_pool, v_pool, tables, lens, start, o_parts, *args):
        seen.add(o_parts.shape[0])
        return real(q, k_pool, v_pool, tables, lens, start, o_parts, *args)

    monkeypatch.setattr(gpu_runner, "paged_decode_partial", spy)
    GpuRunner(tiny.model, 8, BLOCK, torch.device("cpu"), cuda_graphs=False).warm_up()
    assert seen == set(pa.SPLIT_CHOICES)


def one_token_rows(contexts: list[int], logits_rows: list[int]) -> runner.StepBatch:
    """A step of one query row per sequence (sequence b in block b + 1), `logits_rows` sampling."""
    n = len(contexts)
    pos = torch.tensor(contexts) - 1
    blocks = torch.arange(1, n + 1)
    return runner.StepBatch(
        input_ids=torch.arange(5, 5 + n), positions=pos, slot_mapping=blocks * BLOCK + pos,
        query_start=torch.arange(n + 1), context_lens=torch.tensor(contexts), block_tables=blocks[:, None],
        num_decodes=n, logits_rows=torch.tensor(logits_rows, dtype=torch.long))


@pytest.mark.parametrize("logits_rows", [[1, 2], [0, 2], [0, 1, 2]])
def test_graph_step_returns_the_sampling_rows_only(tiny, logits_rows):
    """Every row has one query, but a one-token chunk that does not end its prompt samples nothing: the
    runner returns exactly `logits_rows`' logits, in order, graphs or not. The graph's step runs padded rows,
    so its matmuls may block (and round) differently: float32 rounding apart, where another row is O(1) apart."""
    graphs: dict[int, EagerGraph] = {}
    replayed = emulated_graphs(graphs, 4)(tiny.model, 8, BLOCK, torch.device("cpu"))
    eager = GpuRunner(tiny.model, 8, BLOCK, torch.device("cpu"), cuda_graphs=False)
    batch = one_token_rows([3, 5, 9], logits_rows)
    eager.attn.k, eager.attn.v = replayed.attn.k, replayed.attn.v  # one cache: both steps write the same K/V
    expected = eager.execute(batch)
    assert expected.shape[0] == len(logits_rows)
    torch.testing.assert_close(replayed.execute(batch), expected, rtol=1e-4, atol=1e-4)


SYNCING = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
           torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu,
           torch.Tensor.numpy, torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique}


class SyncGuard(TorchFunctionMode):
    """Records every call that copies a tensor's data to the host (a device→host sync on a GPU). Calls made
    inside `allowed_in` (functions that only ever see host tensors) and inside Triton itself (the
    interpreter reads its arguments on the host; a GPU launch does not) are not counted."""

    def __init__(self, allowed_in: tuple[str, ...] = ()):
        super().__init__()
        self.allowed_in = allowed_in
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        to_host = func is torch.Tensor.to and args[0].device.type != "cpu" and "cpu" in map(str, args[1:])
        if (func in SYNCING or to_host) and not self._allowed():
            frame = sys._getframe(1)
            self.calls.append(f"{getattr(func, '__name__', func)} at {frame.f_code.co_filename}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))

    def _allowed(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if "triton" in frame.f_code.co_filename or frame.f_code.co_name in self.allowed_in:
                return True
            frame = frame.f_back
        return False


# build_batch turns scheduled Python sequences into the host batch; plan_step lays out that host batch (it
# refuses device tensors). Everything else in a step runs on the device on a GPU.
HOST_SIDE = ("build_batch", "plan_step")


def test_step_issues_no_device_to_host_sync_before_sampling(tiny):
    """build_batch + one step (planning, upload, model, logits) + greedy sampling up to the sampled ids
    read no tensor data back to the host outside the host-side builders; the sampler's `.tolist()` of the
    ids is the step's one transfer."""
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB", block_size=BLOCK, max_batched_tokens=64),
                    make_runner=interpreted_runner(num_sms=64))
    for i, p in enumerate(random_prompts(3, 20, 30, seed=8)):
        engine.add_request(Request(i, p, SamplingParams(max_tokens=4)))
    engine.step()  # prefill
    work = engine.scheduler.schedule()
    guard = SyncGuard(allowed_in=HOST_SIDE)
    with guard:
        batch, samplers, _ = build_batch(work, BLOCK)
        logits = engine.runner.execute(batch)
        tokens = logits.argmax(dim=-1)
    assert guard.calls == []
    assert sample(logits, samplers).token_ids == tokens.tolist()
    with pytest.raises(ValueError, match="host batch"):
        plan_step(batch.to(torch.device("meta")), BLOCK, 2, 1, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (sync debug mode, CUDA graphs)")
def test_cuda_step_is_sync_free_and_graphs_match_eager():
    tiny = build_tiny()
    loaded = type(tiny)(tiny.model.to("cuda"), tiny.tokenizer, tiny.config)
    outs = {}
    for graphs in (False, True):
        engine = Engine(loaded, EngineConfig(kv_cache_memory="8MiB", block_size=BLOCK, cuda_graphs=graphs,
                                             max_batch_size=8, device="cuda"))
        prompts = random_prompts(5, 10, 40, seed=9)
        for i, p in enumerate(prompts):
            engine.add_request(Request(i, p, SamplingParams(max_tokens=8)))
        engine.step()
        batch, _, _ = build_batch(engine.scheduler.schedule(), BLOCK)
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs[graphs] = engine.runner.execute(batch).clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.allclose(outs[False], outs[True], atol=1e-4)


def test_graph_plan_has_fixed_shapes_and_padding_without_keys(tiny):
    engine = Engine(tiny, EngineConfig(kv_cache_memory="8MiB", block_size=BLOCK))
    for i, p in enumerate(random_prompts(3, 5, 20, seed=1)):
        engine.add_request(Request(i, p, SamplingParams(max_tokens=3)))
    engine.step()
    batch, _, _ = build_batch(engine.scheduler.schedule(), BLOCK)
    assert batch.num_decodes == batch.num_tokens == 3
    scratch = 999 * BLOCK
    plan = plan_step(batch, BLOCK, 2, 132, 2, pad_to=4, table_width=8, scratch_slot=scratch)
    empty = plan_step(batch_of_nothing(), BLOCK, 2, 132, 2, pad_to=4, table_width=8, scratch_slot=scratch)
    assert plan.sizes == empty.sizes and plan.num_splits == empty.num_splits  # one graph serves both
    seg = dict(zip(gpu_runner.SEGMENTS, torch.split(plan.flat, plan.sizes)))
    assert seg["slots"][3] == scratch and seg["context_lens"][3] == 0
    assert torch.equal(seg["slots"][:3], batch.slot_mapping)
    assert seg["block_tables"].numel() == 0  # kept on the device (DeviceBlockTables)


def test_device_tables_send_only_changed_rows():
    tables = DeviceBlockTables(rows=4, width=6, device=torch.device("cpu"))
    first = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]])
    update = tables.changes(first)
    assert update.tolist() == [0, 1, 2, 1, 2, 0, 3, 0, 0, 4, 5, 6]  # every row new: indices, then the rows
    tables.apply(update, 3)
    assert tables.changes(first).numel() == 0  # nothing changed: nothing sent
    grown = torch.tensor([[1, 2, 0, 0], [3, 7, 0, 0], [4, 5, 6, 8]])  # rows 1 and 2 gained a block
    update = tables.changes(grown)
    assert update.tolist() == [1, 2, 3, 7, 0, 0, 4, 5, 6, 8]
    tables.apply(update, 4)
    moved = torch.tensor([[3, 7]])  # row 0 finished, row 1 moved up; a narrower step compares 2 columns
    tables.apply(tables.changes(moved), 2)
    assert tables.device_tables[:3, :4].tolist() == [[3, 7, 0, 0], [3, 7, 0, 0], [4, 5, 6, 8]]
    assert torch.equal(tables.device_tables, tables.sent)


def batch_of_nothing():
    z = torch.zeros(0, dtype=torch.long)
    return runner.StepBatch(input_ids=z, positions=z, slot_mapping=z, query_start=torch.zeros(1, dtype=torch.long),
                            context_lens=z, block_tables=torch.zeros(0, 1, dtype=torch.long), num_decodes=0,
                            logits_rows=z)


GIB = 2**30


def test_kv_budget_arithmetic():
    # 141 GiB device, 0.9 of it allowed; 3 GiB in use (weights + context), 2 GiB activation peak.
    total, free = 141 * GIB, 138 * GIB
    budget = kv_cache_budget(total, free, 2 * GIB, 0.9, block_bytes=2**20, min_blocks=8)
    assert budget == int(141 * GIB * 0.9) - 3 * GIB - 2 * GIB
    # Another process holding memory counts against the share too.
    assert kv_cache_budget(total, free - 10 * GIB, 2 * GIB, 0.9, 2**20, 8) == budget - 10 * GIB


def test_kv_budget_refuses_a_model_that_does_not_fit():
    with pytest.raises(ValueError, match=r"does not fit.*0\.5.*40\.00 GiB.*in use.*activations"):
        kv_cache_budget(80 * GIB, 40 * GIB, 1 * GIB, 0.5, block_bytes=2**20, min_blocks=4)
    with pytest.raises(ValueError, match="does not fit"):  # room, but not for one max_model_len sequence
        kv_cache_budget(80 * GIB, 79 * GIB, 0, 0.9, block_bytes=GIB, min_blocks=80)


def test_sync_guard_sees_host_reads():
    def build_batch():  # a host-side builder: its reads are allowed
        return x.tolist()

    x = torch.ones(3)
    with SyncGuard(allowed_in=HOST_SIDE) as guard:
        x.sum().item()
        x.tolist()
        int(x[0])
        bool(x.any())
        build_batch()
    assert len(guard.calls) == 4


def test_config_keys_are_validated(tiny):
    assert EngineConfig(cuda_graphs=False, gpu_memory_utilization=1).gpu_memory_utilization == 1
    for bad in ({"cuda_graphs": "yes"}, {"gpu_memory_utilization": 0}, {"gpu_memory_utilization": 1.5},
                {"gpu_memory_utilization": True}):
        with pytest.raises(ValueError, match=f"engine.{next(iter(bad))}"):
            EngineConfig(**bad)
    assert EngineConfig().kv_cache_bytes == 2**30  # auto on CPU: 1 GiB
    with pytest.raises(ValueError, match="power of two"):
        GpuRunner(tiny.model, 4, 8, torch.device("cpu"))


def test_auto_dtype_and_rank_device():
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float16", "cpu") == "float16"
    assert resolve_dtype("auto", "auto") == ("bfloat16" if torch.cuda.is_available() else "float32")
    assert rank_device("cuda:2", 0) == "cuda:2" and rank_device("cuda:2", 1) == "cuda:3"
    assert rank_device("cuda", 1) == "cuda:1" and rank_device("cpu", 3) == "cpu"


def test_a_model_packed_for_cpu_is_not_moved_to_cuda():
    from pipeline.model.quant import pack_model_for_cpu, quantize_model

    loaded = build_tiny(dtype=torch.bfloat16)
    quantize_model(loaded.model, "int4", 32, weights_loaded=True)
    assert pack_model_for_cpu(loaded.model) > 0
    with pytest.raises(ValueError, match="packed for the CPU kernels; load it on the GPU"):
        Engine(loaded, EngineConfig(device="cuda", kv_cache_memory="8MiB"))
