"""One model step over a flat batch, reading and writing the paged KV cache.

`build_batch` (on the scheduling rank) turns the scheduler's choice into a `StepBatch` of plain tensors;
`Runner.execute(batch)` runs the model on it and returns float32 logits for the rows that sample
(`execute_greedy`: only each row's argmax, for steps that want nothing else of the logits). That
single call is everything a tensor-parallel worker needs: every rank executes the same batch on its own
shard of the model and of the KV cache, and rank 0 samples.

Flat batch layout: sequences in order of their query count: the decodes (one row each) first, then the
multi-token chunks. On CPU, where `kernels.cpu_attention` builds, every query is a row of its native pass,
which walks the row's block table in place. Otherwise (torch's path) decode attention is one batched matmul
over the block tables of all decodes (gathered whole blocks, padding masked); short chunks (up to
SHORT_CHUNK queries: a speculating sequence's guesses) join it with one row per query; longer prefill
chunks use `causal_attention` per sequence.

Shared-prefix decode attention (torch's path): decodes whose block tables start with the same cached blocks
(rows of one prefix group) read those blocks once per step, in one matmul for the whole group's queries, and gather
only their own remaining blocks; the two partial softmaxes are merged exactly (running max and sum).
Without it, every row of a group copies the whole shared prefix out of the pool at every layer.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch

from kernels.cpu_attention import NativeKernelUnavailable, PagedDecodeKernel, load_paged_decode
from pipeline.engine.host_memory import keep_step_buffers
from pipeline.engine.prefill import output_positions, wants_hidden
from pipeline.engine.sequence import Sequence
from pipeline.model.attention import causal_attention
from pipeline.model.llama import LlamaModel
from pipeline.model.lora.peft_file import read_adapter
from pipeline.model.native_decode import NativeRows

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """Everything one step needs, as tensors (cheap to broadcast to tensor-parallel ranks)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset where each token's K/V goes
    query_start: torch.Tensor  # [B + 1] int64: sequence b owns rows query_start[b]:query_start[b+1]
    context_lens: torch.Tensor  # [B] int64: keys each sequence attends to after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one query row
    logits_rows: torch.Tensor  # [S] int64: rows whose logits are wanted
    block_copies: torch.Tensor = field(default_factory=lambda: torch.empty(0, 2, dtype=torch.long))  # [C, 2]
    # [T] int64: the resident LoRA slot each token runs (-1: the base model); empty when no token has one
    lora_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> StepBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return StepBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


# A sequence and the positions of this step whose outputs it records: logits for prompt logprobs and scores,
# final hidden states for embeddings (`pipeline.engine.prefill`).
PromptSpan = tuple[Sequence, range]


def build_batch(
    work: list[tuple[Sequence, int]], block_size: int, block_copies: list[tuple[int, int]] = ()
) -> tuple[StepBatch, list[Sequence], list[PromptSpan]]:
    """Lay out the scheduled (sequence, num_tokens) pairs; returns the batch, the sequences that sample
    this step (the first rows of `logits_rows`, in order) and the prompt positions whose logits follow them
    (requests with prompt_logprobs, and scores: position p's logits score prompt token p + 1), then those
    of embeddings, whose rows come last (their final hidden states are wanted, not logits). Prefill-only
    requests (`Sequence.prefill`) never sample.

    A speculating sequence's tokens continue into its guesses (`seq.draft`): it is a short prefill chunk
    whose last 1 + len(draft) rows all give logits (one per guess to check, plus the next token)."""
    # fewest tokens first (decodes, then short chunks), then by LoRA slot so that the decodes of one adapter
    # are one run of the step's deltas (pipeline.model.lora.delta); stable
    work = sorted(work, key=lambda w: (w[1], w[0].lora_slot))
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    lens: list[int] = []
    rows: list[int] = []
    samplers: list[Sequence] = []
    spans: list[PromptSpan] = []
    prompt_rows: list[int] = []
    hidden_spans: list[PromptSpan] = []
    hidden_rows: list[int] = []
    for seq, n in work:
        lo = seq.num_computed
        if seq.prefill is not None:
            span = output_positions(seq.prefill.task, lo, n, seq.num_tokens)
            if span:
                hidden = wants_hidden(seq.prefill.task)
                (hidden_spans if hidden else spans).append((seq, span))
                (hidden_rows if hidden else prompt_rows).extend(starts[-1] + p - lo for p in span)
        elif seq.sampling.prompt_logprobs and lo < seq.num_prompt_tokens - 1:
            span = range(lo, min(lo + n, seq.num_prompt_tokens - 1))
            spans.append((seq, span))
            prompt_rows.extend(starts[-1] + p - lo for p in span)
        ids.extend((seq.token_ids + seq.draft if seq.draft else seq.token_ids)[lo : lo + n])
        positions.extend(range(lo, lo + n))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(lo, lo + n))
        starts.append(starts[-1] + n)
        lens.append(lo + n)
        if seq.prefill is None and lo + n == seq.num_tokens + len(seq.draft):
            rows.extend(range(starts[-1] - 1 - len(seq.draft), starts[-1]))
            samplers.append(seq)
    width = max(len(seq.block_table) for seq, _ in work)
    adapters = any(seq.lora_slot >= 0 for seq, _ in work)
    lora_slots = [seq.lora_slot for seq, n in work for _ in range(n)] if adapters else []
    # one tensor from zero-padded lists: a tensor and a row write per sequence took milliseconds at 256 rows
    tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in work],
                          dtype=torch.long)
    batch = StepBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start=torch.tensor(starts, dtype=torch.long),
        context_lens=torch.tensor(lens, dtype=torch.long),
        block_tables=tables,
        num_decodes=sum(1 for _, n in work if n == 1),
        logits_rows=torch.tensor(rows + prompt_rows + hidden_rows, dtype=torch.long),
        block_copies=torch.tensor(list(block_copies), dtype=torch.long).reshape(-1, 2),
        lora_slots=torch.tensor(lora_slots, dtype=torch.long),
    )
    return batch, samplers, spans + hidden_spans


def copy_blocks(pools: tuple[torch.Tensor, ...], copies: list[tuple[int, int]]) -> None:
    """Make each (src, dst) block (dim 1 of every pool) a copy of src, in order, with one gather and scatter
    per pool: a step admitting many sequences onto shared partial blocks makes dozens of copies, and
    per-block slices cost each pool a call per copy. A source that an earlier copy wrote is read at that
    copy's own source instead, which holds the same keys, so the one gather sees what copying one by one
    would."""
    if not copies:
        return
    origin: dict[int, int] = {}
    for src, dst in copies:
        origin[dst] = origin.get(src, src)
    dst = torch.tensor(list(origin), device=pools[0].device)
    src = torch.tensor(list(origin.values()), device=pools[0].device)
    for pool in pools:
        pool[:, dst] = pool[:, src]


class PagedAttention:
    """`AttentionBackend` over per-layer block pools shaped [Hkv, num_blocks, block_size, D].

    Head-major pools make a gather of whole blocks land directly in the [Hkv, B, L, D] layout the
    batched decode matmul wants, with no transpose copy.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, scale: float, window: int | None = None,
                 native_group: int | None = None):
        """dtype: the pools' (the KV cache dtype; queries may be wider). native_group: query heads per KV
        head, to run the rows through the native CPU kernel (`kernels.cpu_attention`) where it builds for
        these pools; None keeps torch's path. int8 pools (a scale per key and value vector, in float32 scale
        pools) run on the native kernel only."""
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.native = native_decode_kernel(head_dim, native_group, block_size, dtype, device)
        self._native_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # tables, lens, first
        # Sliding window (ModelConfig.sliding_window): blocks wholly before a query's window are not read.
        self.window = window
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # {"k_scales": [...], "v_scales": [...]} per layer for int8 pools, else empty
        self.scales: dict[str, list[torch.Tensor]] = {} if dtype != torch.int8 else {
            name: [torch.zeros(shape[:3], device=device) for _ in range(num_layers)]
            for name in ("k_scales", "v_scales")}
        self.block_size = block_size
        self.scale = scale
        self.batch: StepBatch | None = None
        self.attention_seconds = 0.0
        self._decode_mask: torch.Tensor | None = None  # additive: 0 for keys, -inf for padding
        self._decode_rows: torch.Tensor | None = None  # rows of the [Hkv * num_blocks, block] pool view
        self.num_rows = 0  # query rows of this step in the batched decode pass (a prefix of the batch)
        self._decode_order: torch.Tensor | None = None  # decode rows regrouped (None: batch order)
        self._shared: list[tuple[int, int, torch.Tensor]] = []  # (first, end) regrouped row, pool rows of the prefix
        self._prefills: list[tuple[int, int, int, torch.Tensor]] = []  # (row lo, row hi, keys, pool rows)
        self._key_buf = self._value_buf = torch.empty(0, dtype=dtype, device=device)

    def prepare(self, batch: StepBatch) -> None:
        """Per-step metadata shared by all layers."""
        self.batch = batch
        starts, seq_lens = batch.query_start.tolist(), batch.context_lens.tolist()
        # The decodes, and the short chunks right after them (`build_batch` orders by length), run as rows
        # of the batched pass, one per query, each seeing the keys up to its own position. With the native
        # kernel every chunk does: it beat causal passes at every chunk size measured (1.4-3.9x, 16 to 512
        # queries, bench/cpu_attention.py).
        seqs = len(seq_lens) if self.native is not None else batch.num_decodes
        while seqs < len(seq_lens) and starts[seqs + 1] - starts[seqs] <= SHORT_CHUNK:
            seqs += 1
        d = self.num_rows = starts[seqs]
        if d:
            counts = batch.query_start[1 : seqs + 1] - batch.query_start[:seqs]
            lens = torch.tensor([seq_lens[b] - n + i for b in range(seqs) for n in [starts[b + 1] - starts[b]]
                                 for i in range(1, n + 1)], device=batch.context_lens.device)
            tables = batch.block_tables[:seqs].repeat_interleave(counts, dim=0)
            if self.native is not None:  # the kernel walks each row's table itself
                first = (lens - self.window).clamp_(min=0) if self.window else torch.zeros_like(lens)
                self._native_rows = (tables, lens, first)
            else:
                self._prepare_gathered_decode(tables, lens)
        self._prefills = []
        for b in range(seqs, len(seq_lens)):
            keys = seq_lens[b]
            # first block read: the one holding the first query's first key in the window (0 without one)
            first = max(0, keys - (starts[b + 1] - starts[b]) - self.window + 1) // self.block_size if self.window else 0
            blocks = batch.block_tables[b, first : -(-keys // self.block_size)]
            self._prefills.append((starts[b], starts[b + 1], keys - first * self.block_size, self._pool_rows(blocks)))
        copy_blocks((*self.k, *self.v, *(p for pools in self.scales.values() for p in pools)),
                    batch.block_copies.tolist())

    def _prepare_gathered_decode(self, tables: torch.Tensor, lens: torch.Tensor) -> None:
        """torch's decode path: which pool rows to gather for each query row, the padding mask, and the
        shared-prefix groups that read their common blocks once."""
        d = self.num_rows
        groups = [] if self.window else shared_prefixes(tables.tolist(), lens.tolist(), self.block_size)
        self._decode_order, self._shared = None, []
        first_key = torch.zeros_like(lens)  # of the row's own pass, relative to its first gathered block
        if self.window:  # start each row at the block holding its first key in the window
            visible = (lens - self.window).clamp_(min=0)
            skip = visible // self.block_size
            cols = (skip[:, None] + torch.arange(tables.shape[1], device=lens.device)).clamp_(
                max=tables.shape[1] - 1)
            tables, lens, first_key = tables.gather(1, cols), lens - skip * self.block_size, visible % self.block_size
        if groups:  # decode rows regrouped so that each group is a contiguous slice
            grouped = [row for rows, _ in groups for row in rows]
            rest = sorted(set(range(d)) - set(grouped))
            self._decode_order = torch.tensor(grouped + rest, device=lens.device)
            lens, tables = lens[self._decode_order], tables[self._decode_order]
            skip = torch.zeros(d, dtype=torch.long, device=lens.device)  # blocks the group pass reads
            lo = 0
            for rows, num_blocks in groups:
                skip[lo : lo + len(rows)] = num_blocks
                self._shared.append((lo, lo + len(rows), self._pool_rows(tables[lo, :num_blocks])))
                lo += len(rows)
            cols = (skip[:, None] + torch.arange(tables.shape[1], device=lens.device)).clamp_(
                max=tables.shape[1] - 1)
            tables = tables.gather(1, cols)  # each row's own blocks first
            lens = lens - skip * self.block_size  # keys left for the row's own pass
        width = -(-int(lens.max()) // self.block_size)
        self._decode_rows = self._pool_rows(tables[:, :width].reshape(-1))
        hkv = self.k[0].shape[0]
        keys = torch.arange(width * self.block_size, device=lens.device)  # key positions of a row's own pass
        mask = torch.zeros(d, 1, keys.numel(), dtype=self.k[0].dtype, device=lens.device)
        hidden = (keys[None, :] >= lens[:, None]) | (keys[None, :] < first_key[:, None])
        mask.masked_fill_(hidden[:, None, :], float("-inf"))
        self._decode_mask = mask.repeat(hkv, 1, 1)  # additive, [Hkv * d, 1, L]
        # One gather buffer per step for all layers: fresh large tensors cost page faults every time.
        row = self.block_size * self.k[0].shape[-1]
        if self._key_buf.numel() < self._decode_rows.numel() * row:
            self._key_buf = self._key_buf.new_empty(self._decode_rows.numel() * row)
            self._value_buf = self._value_buf.new_empty(self._decode_rows.numel() * row)

    def _pool_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Rows of the pool viewed as [Hkv * num_blocks, block_size * D] holding `blocks`, head-major:
        a row gather along dim 0 is a plain memcpy of whole blocks (dim-1 gathers take a slow path)."""
        hkv, num_blocks = self.k[0].shape[:2]
        return (torch.arange(hkv, device=blocks.device)[:, None] * num_blocks + blocks).reshape(-1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        batch = self.batch
        kp, vp = self.k[layer], self.v[layer]
        hkv, nb, bs, dim = kp.shape
        if self.native is not None:  # cast and scatter in one native pass
            self.native.write(k.float(), v.float(), batch.slot_mapping, kp, vp, **self._layer_scales(layer))
        else:
            flat_k, flat_v = kp.view(hkv, nb * bs, dim), vp.view(hkv, nb * bs, dim)
            flat_k.index_copy_(1, batch.slot_mapping, k.transpose(0, 1).to(kp.dtype))
            flat_v.index_copy_(1, batch.slot_mapping, v.transpose(0, 1).to(vp.dtype))
        model_dtype = q.dtype  # the kernel computes in float32, torch's path in the queries' dtype
        q = q.float() if self.native is not None else q
        d = self.num_rows
        if d == q.shape[0]:  # decodes only (the steady state): no output assembly needed
            out = self._decode(q, kp, vp, layer).to(model_dtype)
            self.attention_seconds += time.perf_counter() - t0
            return out
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode(q[:d], kp, vp, layer)
        for lo, hi, length, rows in self._prefills:
            ks = kp.view(hkv * nb, -1).index_select(0, rows).view(hkv, -1, dim)[:, :length].transpose(0, 1)
            vs = vp.view(hkv * nb, -1).index_select(0, rows).view(hkv, -1, dim)[:, :length].transpose(0, 1)
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)  # a narrower cache is widened, not the queries narrowed
            out[lo:hi] = causal_attention(q[lo:hi], ks, vs, length - (hi - lo), self.scale, self.window)
        self.attention_seconds += time.perf_counter() - t0
        return out.to(model_dtype)

    def native_rows(self) -> NativeRows | None:
        """This step as the model's native layers read it (`pipeline.model.native_decode`), where the native
        kernel runs every row of it (with that kernel every chunk is rows: every prepared step with rows)."""
        batch = self.batch
        if self.native is None or batch is None or not 0 < self.num_rows == batch.num_tokens:
            return None
        tables, lens, first = self._native_rows
        return NativeRows(self.native, batch.slot_mapping, tables, lens, first, self.scale, self.k, self.v,
                          self.scales.get("k_scales"), self.scales.get("v_scales"), self._spend)

    def _spend(self, seconds: float) -> None:
        self.attention_seconds += seconds

    def _layer_scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The int8 pools' scale pools of `layer`, as the native kernel's keyword arguments (else none)."""
        return {name: pools[layer] for name, pools in self.scales.items()}

    def _decode(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, layer: int) -> torch.Tensor:
        """Each query row over its own keys: [d, Hq, D] -> [d, Hq, D]."""
        if self.native is not None:
            return self.native(q.contiguous(), kp, vp, *self._native_rows, self.scale, **self._layer_scales(layer))
        d, hq, dim = q.shape
        hkv = kp.shape[0]
        group = hq // hkv
        order = self._decode_order
        if order is not None:
            q = q.index_select(0, order)
        rows = self._decode_rows
        width = kp.shape[2] * dim
        size = rows.numel() * width
        keys = torch.index_select(kp.view(-1, width), 0, rows, out=self._key_buf[:size].view(-1, width))
        values = torch.index_select(vp.view(-1, width), 0, rows, out=self._value_buf[:size].view(-1, width))
        keys = keys.view(hkv * d, -1, dim).to(q.dtype)  # [Hkv * d, L, D], widened from a narrower cache
        values = values.view(hkv * d, -1, dim).to(q.dtype)
        qg = q.view(d, hkv, group, dim).transpose(0, 1).reshape(hkv * d, group, dim)
        # mask + scale * q k^T in one call (in the model dtype, as causal_attention), softmax in float32.
        if self._decode_mask.dtype != q.dtype:  # a narrower cache: the mask follows the queries, once a step
            self._decode_mask = self._decode_mask.to(q.dtype)
        scores = torch.baddbmm(self._decode_mask, qg, keys.transpose(1, 2), alpha=self.scale).float()
        if order is None:
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            out = torch.bmm(probs, values)  # [Hkv * d, group, D]
            return out.view(hkv, d, group, dim).transpose(0, 1).reshape(d, hq, dim)
        # Each group's softmax runs over its shared keys and each row's own keys together (one row of
        # scores per query); the shared part's output is one matmul for the whole group.
        own = scores.view(hkv, d * group, -1)
        probs = torch.empty_like(own)
        shared_out = []
        qh = qg.view(hkv, d * group, dim)
        pool_k, pool_v = kp.view(-1, width), vp.view(-1, width)
        for lo, hi, pool_rows in self._shared:
            k_s = pool_k.index_select(0, pool_rows).view(hkv, -1, dim).to(q.dtype)  # [Hkv, S, D]: once per group
            v_s = pool_v.index_select(0, pool_rows).view(hkv, -1, dim).to(q.dtype)
            part = slice(lo * group, hi * group)
            shared_scores = torch.bmm(qh[:, part], k_s.transpose(1, 2)).mul_(self.scale).float()
            p = torch.softmax(torch.cat([shared_scores, own[:, part]], dim=-1), dim=-1)
            probs[:, part] = p[..., k_s.shape[1] :]
            shared_out.append((part, torch.bmm(p[..., : k_s.shape[1]].to(v_s.dtype), v_s)))
        rest = slice(self._shared[-1][1] * group, None)
        probs[:, rest] = torch.softmax(own[:, rest], dim=-1)
        out = torch.bmm(probs.view_as(scores).to(values.dtype), values).view(hkv, d * group, dim)
        for part, extra in shared_out:
            out[:, part] += extra
        out = out.view(hkv, d, group, dim).transpose(0, 1).reshape(d, hq, dim)
        return torch.empty_like(out).index_copy_(0, order, out)


def native_decode_kernel(head_dim: int, group: int | None, block_size: int, dtype: torch.dtype,
                         device: torch.device) -> PagedDecodeKernel | None:
    """The native decode attention for pools of `dtype` on CPU, or None where torch's path runs instead
    (group None asks for it; a kernel that cannot build is logged with the reason). int8 pools, which
    torch's path does not read, get an error saying why instead."""
    why = "no query group was given for it" if group is None else "it runs on CPU only" if device.type != "cpu" else None
    if why is None:
        try:
            return load_paged_decode(head_dim, group, block_size, dtype)
        except NativeKernelUnavailable as e:
            why = str(e)
            if dtype != torch.int8:
                log.info("decode attention runs on torch ops: the native CPU kernel is unavailable (%s)", e)
    if dtype == torch.int8:
        raise ValueError(f"model.kv_cache_dtype=int8 needs the native CPU attention kernel, and {why}: "
                         "use bfloat16 or float32")
    return None


# Chunks of at most this many queries (a speculating sequence's k + 1, a prompt's short last piece) join the
# batched decode pass, one row per query, instead of a causal pass of their own: on CPU a per-sequence
# pass costs ~10 small ops per layer, which made checking 4 guesses for 16 sequences cost 3-4 decode steps.
SHORT_CHUNK = 16

# A group pass costs a dozen small ops per layer; it pays once it saves gathering about this many blocks
# ((rows - 1) x shared blocks). Measured on SmolLM2 / 2 CPU cores: groups of a few rows behind a 2-3 block
# system prompt (the bundled sample) ran 10-20% slower end to end without this floor.
MIN_SAVED_BLOCKS = 64


def shared_prefixes(tables: list[list[int]], lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Groups of decode rows whose block tables start with the same physical blocks, with how many, where
    reading those blocks once saves at least MIN_SAVED_BLOCKS block reads.

    Only blocks wholly before every member's current token count (they are full and read-only: a block
    is shared only through the prefix cache), so each row keeps at least its newest key for its own pass.
    Plain Python on the step's small tables: it runs every step, usually to find nothing.
    """
    by_first: dict[int, list[int]] = defaultdict(list)
    for row, table in enumerate(tables):
        by_first[table[0]].append(row)
    groups = []
    for rows in by_first.values():
        most = min((lens[r] - 1) // block_size for r in rows)
        if (len(rows) - 1) * most < MIN_SAVED_BLOCKS:
            continue
        first = tables[rows[0]]
        num_blocks = next((i for i in range(most) if any(tables[r][i] != first[i] for r in rows)), most)
        if (len(rows) - 1) * num_blocks >= MIN_SAVED_BLOCKS:
            groups.append((rows, num_blocks))
    return groups


class Runner:
    """Owns the model and its KV pools; `execute` is the whole per-step interface."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device):
        cfg = model.config
        self.model = model
        self.device = device
        self.attn = PagedAttention(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads // model.tp.size, cfg.head_dim,
            model.kv_dtype, device, model.scale, cfg.sliding_window, native_group=cfg.num_heads // cfg.num_kv_heads,
        )
        if device.type == "cpu":  # after the pools are allocated: large ones keep their own mappings
            keep_step_buffers()

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run one step; float32 logits [len(batch.logits_rows), vocab] (possibly zero rows)."""
        return self.model.compute_logits(self._sampling_hidden(batch))

    @torch.inference_mode()
    def execute_greedy(self, batch: StepBatch) -> torch.Tensor:
        """Run one step; each logits row's argmax [len(batch.logits_rows)], without the logits where the
        model's head can (`LlamaModel.greedy_tokens`)."""
        return self.model.greedy_tokens(self._sampling_hidden(batch))

    @torch.inference_mode()
    def execute_hidden(self, batch: StepBatch) -> torch.Tensor:
        """Run one step; the final hidden states (after the model's final norm) [len(batch.logits_rows),
        hidden] of the wanted rows, for steps with embedding rows (the engine applies the head to the rows
        that want logits)."""
        return self._sampling_hidden(batch)

    def load_adapter(self, slot: int, path: str, slots: int) -> None:
        """Place the LoRA adapter at `path` (a local folder, checked by the caller) in `slot` of the model's
        `slots` resident adapters."""
        self.model.load_adapter(slot, read_adapter(path, self.model.config), slots)

    def _sampling_hidden(self, batch: StepBatch) -> torch.Tensor:
        """The model's final hidden states of the rows whose logits the step wants."""
        lora = self.model.lora_step(batch.lora_slots.cpu())
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        self.attn.prepare(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.attn, lora)
        return hidden.index_select(0, batch.logits_rows)


class StepRunner(Protocol):
    """What the engine needs of a runner: one step in, logits out (or, for steps where every row is plain
    greedy, just each row's argmax), and the attention state it reports on. A runner that can also return
    final hidden states (`execute_hidden`: `Runner`, `GpuRunner`) serves embedding requests."""

    attn: PagedAttention

    def execute(self, batch: StepBatch) -> torch.Tensor: ...

    def execute_greedy(self, batch: StepBatch) -> torch.Tensor: ...

    def load_adapter(self, slot: int, path: str, slots: int) -> None: ...


# (model, num_blocks, block_size, device) -> runner; `Runner` itself, or a tensor-parallel one.
RunnerFactory = Callable[[LlamaModel, int, int, torch.device], StepRunner]


def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
    """Bytes one block takes across all layers (K and V, and int8's float32 scale per vector) on this rank."""
    cfg = model.config
    elem = torch.empty((), dtype=model.kv_dtype).element_size()
    per_vector = cfg.head_dim * elem + (4 if model.kv_dtype == torch.int8 else 0)
    return 2 * cfg.num_layers * block_size * (cfg.num_kv_heads // model.tp.size) * per_vector
