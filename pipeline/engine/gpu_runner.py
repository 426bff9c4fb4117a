"""The single-GPU step: Triton paged attention, one host→device copy per step, CUDA graphs for decodes.

`GpuRunner.execute(batch)` takes the host-built `StepBatch` (CPU tensors from `build_batch`) and
- plans the step on the host (`plan_step`): every index the kernels need (slots, block tables, prefill
  tiles, shared-prefix groups, split counts) goes into one int64 tensor, from host data only;
- copies that tensor to the device once (pinned memory, non_blocking) and views its segments there;
- runs the model with `TritonPagedAttention`, which reads K/V in place through the block tables;
- returns the sampling rows' logits on the device. Nothing in the step waits for the device: the first
  device→host transfer is the sampler's `.tolist()` of the sampled ids.

Decode-only steps (every row a one-token query that samples) replay a CUDA graph captured for the smallest
bucket (1, 2, 4, 8, 16, 24, ... max_batch_size: `graph_buckets`) that holds the batch: its inputs live in
one static device buffer per bucket, which the step's single copy fills, and its block tables in one device
tensor updated by row (`pipeline.engine.device_tables`); padding rows have no keys and write their K/V to a
scratch block the cache manager never hands out.
The tensor-parallel and CPU paths keep `pipeline.engine.runner.Runner`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.argmax import row_argmax
from kernels.paged_attention import (
    SPLIT_CHOICES,
    decode_splits,
    merge_partials,
    paged_decode_partial,
    paged_prefill,
    prefill_block_m,
    prefill_tiles,
    prefix_decode_partial,
    prefix_rows_per_tile,
    prefix_tiles,
)
from pipeline.engine.device_tables import DeviceBlockTables
from pipeline.engine.runner import StepBatch, copy_blocks, shared_prefixes
from pipeline.model.llama import LlamaModel
from pipeline.model.lora.delta import LoraStep
from pipeline.model.lora.peft_file import read_adapter


def graph_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes a decode graph is captured for: 1, 2, 4, then steps of 8 up to 64, of 16 up to 128 and
    of 32 beyond, below max_batch_size, then it. A step pads at most 7, 15 or 31 rows (powers of two padded
    up to half the batch: 129 rows ran as 256)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, max(160, max_batch_size), 32)]
    return [*(n for n in sizes if n < max_batch_size), max_batch_size]


def graph_bucket(rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `rows` decode rows (None: more rows than any graph, run eagerly)."""
    return next((b for b in buckets if b >= rows), None)


@dataclass
class StepPlan:
    """One step's indices, laid out host-side in a single int64 tensor (`flat`, segment sizes `sizes`)."""

    flat: torch.Tensor
    sizes: list[int]
    num_tokens: int
    num_decodes: int
    table_width: int
    num_splits: int
    num_prefill_tiles: int
    prefix_groups: int  # 0: no shared-prefix pass
    prefix_width: int
    graph: bool  # a CUDA graph bucket's fixed shapes: decode rows only, every row samples
    copies: list[tuple[int, int]]  # block copies (copy-on-write of a forked sequence), host ints


SEGMENTS = ("input_ids", "positions", "slots", "context_lens", "start_blocks", "block_tables", "query_start",
            "logits_rows", "prefill_tiles", "prefix_rows", "prefix_tiles", "prefix_blocks", "prefix_tables")


def plan_step(batch: StepBatch, block_size: int, num_kv_heads: int, num_sms: int, group: int,
              pad_to: int | None = None, table_width: int | None = None, scratch_slot: int = 0,
              window: int | None = None) -> StepPlan:
    """Lay out everything a step needs from the host batch. pad_to/table_width: a CUDA graph bucket's fixed
    shapes (decode-only batches), padding rows pointing at `scratch_slot` with no keys; its block tables are
    not in the plan (the runner keeps them on the device, `DeviceBlockTables`). window: the model's
    sliding window (no shared-prefix groups: rows of a group see different keys of the prefix)."""
    if batch.input_ids.device.type != "cpu":
        raise ValueError("plan_step takes the host batch from build_batch (CPU tensors)")
    d, t = batch.num_decodes, batch.num_tokens
    lens = batch.context_lens.tolist()
    tables = batch.block_tables
    width = tables.shape[1] if table_width is None else table_width
    if tables.shape[1] < width:
        tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
    starts = batch.query_start.tolist()
    seg: dict[str, torch.Tensor] = {
        "input_ids": batch.input_ids, "positions": batch.positions, "slots": batch.slot_mapping,
        "context_lens": batch.context_lens, "block_tables": tables[:, :width].reshape(-1),
        "query_start": batch.query_start, "logits_rows": batch.logits_rows,
    }
    max_blocks = max((-(-n // block_size) for n in lens[:d]), default=1)
    if window is not None:  # blocks a row reads: those overlapping its last `window` keys
        max_blocks = min(max_blocks, -(-window // block_size) + 1)
    start = [0] * d
    groups: list[tuple[list[int], int]] = []
    if pad_to is None and d and window is None:
        groups = shared_prefixes(tables[:d].tolist(), lens[:d], block_size)
        for rows, shared in groups:
            for r in rows:
                start[r] = shared
    empty = torch.zeros(0, dtype=torch.long)
    seg["start_blocks"] = torch.tensor(start, dtype=torch.long)
    seg["prefill_tiles"] = _columns(prefill_tiles(starts, d, prefill_block_m()), 2)
    if groups:
        seg["prefix_rows"] = torch.tensor([r for rows, _ in groups for r in rows], dtype=torch.long)
        tiles = prefix_tiles([len(rows) for rows, _ in groups], prefix_rows_per_tile(group))
        seg["prefix_tiles"] = _columns(tiles, 3)
        seg["prefix_blocks"] = torch.tensor([shared for _, shared in groups], dtype=torch.long)
        prefix_width = max(shared for _, shared in groups)
        seg["prefix_tables"] = torch.stack([tables[rows[0], :prefix_width] for rows, _ in groups]).reshape(-1)
    else:
        prefix_width = 0
        for name in ("prefix_rows", "prefix_tiles", "prefix_blocks", "prefix_tables"):
            seg[name] = empty
    if pad_to is not None:  # a graph bucket: decode rows padded to its size, no keys, scratch slot
        pad = pad_to - d
        fill = {"input_ids": 0, "positions": 0, "slots": scratch_slot, "context_lens": 0, "start_blocks": 0}
        for name, value in fill.items():
            seg[name] = torch.cat([seg[name], torch.full((pad,), value, dtype=torch.long)])
        seg["query_start"] = seg["logits_rows"] = seg["prefill_tiles"] = empty
        seg["block_tables"] = empty  # the graphs read the tables kept on the device (`DeviceBlockTables`)
        max_blocks = width if window is None else min(width, -(-window // block_size) + 1)
        d = t = pad_to
    parts = [seg[name].to(torch.long) for name in SEGMENTS]
    return StepPlan(
        flat=torch.cat(parts), sizes=[p.numel() for p in parts], num_tokens=t, num_decodes=d,
        table_width=width, num_splits=decode_splits(d, num_kv_heads, max_blocks, num_sms),
        num_prefill_tiles=seg["prefill_tiles"].numel() // 2, prefix_groups=len(groups),
        prefix_width=prefix_width, graph=pad_to is not None,
        copies=[tuple(c) for c in batch.block_copies.tolist()],
    )


def _columns(rows: list[tuple[int, ...]], width: int) -> torch.Tensor:
    """Tuples as a flat [width, N] int64 tensor (one kernel argument per field)."""
    return torch.tensor(rows, dtype=torch.long).reshape(-1, width).T.reshape(-1)


@dataclass
class StepViews:
    """A plan's segments as device tensors (views of one buffer), shaped for the kernels."""

    plan: StepPlan
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    context_lens: torch.Tensor
    start_blocks: torch.Tensor
    block_tables: torch.Tensor
    query_start: torch.Tensor
    logits_rows: torch.Tensor
    prefill_tiles: torch.Tensor
    prefix_rows: torch.Tensor
    prefix_tiles: torch.Tensor
    prefix_blocks: torch.Tensor
    prefix_tables: torch.Tensor

    @classmethod
    def of(cls, plan: StepPlan, device_flat: torch.Tensor, block_tables: torch.Tensor | None = None) -> StepViews:
        """block_tables: a graph step's (its plan holds none)."""
        s = dict(zip(SEGMENTS, torch.split(device_flat, plan.sizes)))
        s["block_tables"] = s["block_tables"].view(-1, plan.table_width) if block_tables is None else block_tables
        s["prefill_tiles"] = s["prefill_tiles"].view(2, -1)
        s["prefix_tiles"] = s["prefix_tiles"].view(3, -1)
        s["prefix_tables"] = s["prefix_tables"].view(-1, max(1, plan.prefix_width))
        return cls(plan, **s)


class TritonPagedAttention:
    """`AttentionBackend` on the Triton kernels over per-layer pools [Hkv, num_blocks + 1, block_size, D];
    the extra last block is scratch for the K/V of graph padding rows. `step` is set per step. window: the
    model's sliding window (None: full attention)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, scale: float, window: int | None = None):
        shape = (num_kv_heads, num_blocks + 1, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size
        self.scale = scale
        self.window = window
        self.step: StepViews | None = None
        self.attention_seconds = 0.0  # not measured: the kernels run asynchronously (model_time covers them)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy_blocks((*self.k, *self.v), copies)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step, plan = self.step, self.step.plan
        kp, vp = self.k[layer], self.v[layer]
        hkv, nb, bs, dim = kp.shape
        kp.view(hkv, nb * bs, dim).index_copy_(1, step.slots, k.transpose(0, 1))
        vp.view(hkv, nb * bs, dim).index_copy_(1, step.slots, v.transpose(0, 1))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = plan.num_decodes
        if d:
            self._decode(q[:d], kp, vp, step, out[:d])
        if plan.num_prefill_tiles:
            paged_prefill(q, kp, vp, step.block_tables, step.query_start, step.context_lens, step.prefill_tiles,
                          self.scale, prefill_block_m(), out, self.window)
        return out

    def _decode(self, q, kp, vp, step: StepViews, out: torch.Tensor) -> None:
        plan = step.plan
        d, splits = q.shape[0], plan.num_splits
        parts = splits + (1 if plan.prefix_groups else 0)
        tables, lens = step.block_tables[:d], step.context_lens[:d]
        if parts == 1:  # the kernel's normalized output is the answer
            lse = torch.empty(1, *q.shape[:2], dtype=torch.float32, device=q.device)
            paged_decode_partial(q, kp, vp, tables, lens, step.start_blocks, out.unsqueeze(0), lse, self.scale,
                                 self.window)
            return
        o_parts = torch.empty(parts, *q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(parts, *q.shape[:2], dtype=torch.float32, device=q.device)
        paged_decode_partial(q, kp, vp, tables, lens, step.start_blocks, o_parts[:splits], lse[:splits], self.scale,
                             self.window)
        if plan.prefix_groups:
            o_parts[splits].zero_()
            lse[splits].fill_(float("-inf"))  # rows in no group: the part weighs nothing
            group = q.shape[1] // kp.shape[0]
            prefix_decode_partial(q, kp, vp, step.prefix_tables, step.prefix_blocks, step.prefix_rows,
                                  step.prefix_tiles, o_parts[splits], lse[splits], self.scale,
                                  prefix_rows_per_tile(group))
        merge_partials(o_parts, lse, out)


class GpuRunner:
    """`StepRunner` for one GPU (or the Triton interpreter on CPU, for tests)."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device,
                 cuda_graphs: bool = True, max_batch_size: int = 64, max_model_len: int | None = None):
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"engine.block_size={block_size}: the GPU kernels need a power of two >= 16")
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_kv_heads = cfg.num_kv_heads // model.tp.size
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.attn = TritonPagedAttention(cfg.num_layers, num_blocks, block_size, self.num_kv_heads, cfg.head_dim,
                                         model.dtype, device, model.scale, cfg.sliding_window)
        is_cuda = device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else 1
        max_len = max_model_len or cfg.max_position_embeddings
        self.graph_table_width = min(num_blocks, -(-max_len // block_size))
        self.buckets = graph_buckets(max_batch_size)
        self.tables = DeviceBlockTables(max_batch_size, self.graph_table_width, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, StepPlan, torch.Tensor]] = {}
        self.replays = 0  # steps served by a graph (bench/gpu_check.py reports their share)
        if is_cuda:
            self.warm_up()
        if cuda_graphs and is_cuda:
            self._capture_all()

    def upload(self, flat: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """The step's one host→device copy (pinned, non_blocking on CUDA); `into`: a graph's static buffer,
        of which it fills the first flat.numel() elements."""
        host = flat.pin_memory() if self.device.type == "cuda" else flat
        if into is None:
            return host.to(self.device, non_blocking=True)
        return into[: flat.numel()].copy_(host, non_blocking=True)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run one step; float32 logits [len(batch.logits_rows), vocab] on the device."""
        d = batch.num_decodes
        lora = self.model.lora_step(batch.lora_slots)  # a step with LoRA deltas runs eagerly, not from a graph
        graph = self._graphs and self._graph_step(batch) and lora is None
        bucket = graph_bucket(d, self.buckets) if graph else None
        width = batch.block_tables.shape[1]
        if bucket is not None and width <= self.graph_table_width:
            graph, static, _, logits = self._graphs[bucket]
            plan = self._plan(batch, bucket)
            self.attn.copy_blocks(plan.copies)
            fixed = plan.flat.numel()
            update = self.tables.changes(batch.block_tables)
            self.upload(torch.cat([plan.flat, update]), into=static)
            self.tables.apply(static[fixed : fixed + update.numel()], width)
            graph.replay()
            self.replays += 1
            return logits[:d]
        plan = self._plan(batch)
        self.attn.copy_blocks(plan.copies)
        return self.run(plan, self.upload(plan.flat), lora)

    @staticmethod
    def _graph_step(batch: StepBatch) -> bool:
        """Whether a graph (which returns one logits row per row, in order) serves this step: every row is a
        one-token query that samples. A one-token chunk that does not end its prompt has one row but no
        logits row (host tensors: no device read)."""
        d = batch.num_decodes
        return d == batch.num_tokens == batch.logits_rows.numel() and torch.equal(batch.logits_rows, torch.arange(d))

    def execute_greedy(self, batch: StepBatch) -> torch.Tensor:
        """The argmax of `execute`'s logits (the captured graphs end in them)."""
        return row_argmax(self.execute(batch))

    @torch.inference_mode()
    def execute_hidden(self, batch: StepBatch) -> torch.Tensor:
        """Run one step eagerly; the final hidden states [len(batch.logits_rows), hidden] of the wanted rows
        (steps with embedding rows: the engine applies the head to the rows that want logits)."""
        lora = self.model.lora_step(batch.lora_slots)
        plan = self._plan(batch)
        self.attn.copy_blocks(plan.copies)
        step = StepViews.of(plan, self.upload(plan.flat))
        self.attn.step = step
        return self.model(step.input_ids, step.positions, self.attn, lora).index_select(0, step.logits_rows)

    def _plan(self, batch: StepBatch, bucket: int | None = None) -> StepPlan:
        return plan_step(batch, self.block_size, self.num_kv_heads, self.num_sms, self.group, pad_to=bucket,
                         table_width=self.graph_table_width if bucket else None, scratch_slot=self.attn.scratch_slot,
                         window=self.attn.window)

    def load_adapter(self, slot: int, path: str, slots: int) -> None:
        """Place the LoRA adapter at `path` in `slot` of the model's `slots` resident adapters."""
        self.model.load_adapter(slot, read_adapter(path, self.model.config), slots)

    def run(self, plan: StepPlan, device_flat: torch.Tensor, lora: LoraStep | None = None,
            block_tables: torch.Tensor | None = None) -> torch.Tensor:
        """The device part of a step (no host reads): model, then the logits of the sampling rows."""
        step = StepViews.of(plan, device_flat, block_tables)
        self.attn.step = step
        hidden = self.model(step.input_ids, step.positions, self.attn, lora)
        if plan.graph:  # every row samples
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden.index_select(0, step.logits_rows))

    def graph_inputs(self, bucket: int) -> tuple[StepPlan, torch.Tensor]:
        """A bucket's plan (every row padding) and its static device buffer, which each step refills: the
        plan's segments, then room for the step's block-table update (`DeviceBlockTables.changes`)."""
        nothing = torch.zeros(0, dtype=torch.long)
        empty = StepBatch(input_ids=nothing, positions=nothing, slot_mapping=nothing,
                          query_start=torch.zeros(1, dtype=torch.long), context_lens=nothing,
                          block_tables=torch.zeros(0, 1, dtype=torch.long), num_decodes=0, logits_rows=nothing)
        plan = self._plan(empty, bucket)
        static = torch.zeros(plan.flat.numel() + bucket * (1 + self.graph_table_width), dtype=torch.long,
                             device=self.device)
        self.upload(plan.flat, into=static)
        return plan, static

    def graph_body(self, plan: StepPlan, static: torch.Tensor) -> torch.Tensor:
        """What a bucket's graph runs: the step on its static buffer and the device block tables."""
        return self.run(plan, static[: plan.flat.numel()], block_tables=self.tables.device_tables[: plan.num_decodes])

    def warm_up(self) -> None:
        """Compile the decode kernel for every split count it may use (SPLIT_CHOICES) before any step is timed
        or captured: a step of one padding row (no keys, scratch slot) per count."""
        plan, static = self.graph_inputs(1)
        for splits in SPLIT_CHOICES:
            self.graph_body(replace(plan, num_splits=splits), static)

    def _capture_all(self) -> None:
        """Capture one decode graph per bucket, largest first, sharing one memory pool."""
        pool = None
        for bucket in sorted(self.buckets, reverse=True):
            plan, static = self.graph_inputs(bucket)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile and autotune outside the capture
                    self.graph_body(plan, static)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.graph_body(plan, static)
            pool = graph.pool()
            self._graphs[bucket] = (graph, static, plan, logits)
        torch.cuda.synchronize(self.device)
