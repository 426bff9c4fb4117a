"""Roofline arithmetic for LLM inference: what the hardware can move and compute against what a step needs.

Pure functions of a model shape (`ModelConfig`), a hardware profile and a weight precision — no torch, no
I/O — so `python -m pipeline.roofline`, the run report and the tests share one set of formulas.

Conventions: a multiply-add is 2 FLOPs; bytes are bytes (1 GB = 1e9 B, 1 TB/s = 1e12 B/s); "context" is
the number of positions a decode step attends over. A decode step reads every weight matrix once (the
input-embedding table is only gathered a row per token, so it is not read when untied; tied, it is read as
the LM head) plus the KV cache of every running sequence; activations are ignored (small beside both).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.model.config import ModelConfig

GB = 1e9
TB = 1e12


# --------------------------------------------------------------------------------------------- precision
@dataclass(frozen=True)
class Precision:
    """Storage format of weight matrices: `bits` per weight plus `group_bytes` of scale/zero per group."""

    name: str
    bits: int
    group_size: int = 0
    group_bytes: int = 0

    def bytes_for(self, n: int) -> float:
        """Bytes to store `n` weights, group scales included (a partial last group still pays its scale)."""
        groups = math.ceil(n / self.group_size) if self.group_size else 0
        return n * self.bits / 8 + groups * self.group_bytes

    @property
    def bits_per_weight(self) -> float:
        return self.bits + (8 * self.group_bytes / self.group_size if self.group_size else 0.0)


_FIXED = {
    "fp32": Precision("fp32", 32),
    "float32": Precision("fp32", 32),
    "bf16": Precision("bf16", 16),
    "bfloat16": Precision("bf16", 16),
    "fp16": Precision("fp16", 16),
    "float16": Precision("fp16", 16),
    "fp8": Precision("fp8", 8),
    "int8": Precision("int8", 8),  # per-output-channel scales: N values per N*K matrix, ignored
    "int4": Precision("int4", 4),  # the usual "4 bits per weight": group scales ignored
    # GGUF block formats: 32 weights + fp16 scale (q8_0) or fp16 scale and min (q4_0 has scale only)
    "q8_0": Precision("q8_0", 8, 32, 2),
    "q4_0": Precision("q4_0", 4, 32, 2),
    "q4_1": Precision("q4_1", 4, 32, 4),
}
_GROUPED = re.compile(r"^int([48])-g(\d+)$")


def precision(spec: str | Precision) -> Precision:
    """Parse a precision name: fp32/bf16/fp16/fp8/int8/int4, q8_0/q4_0/q4_1, or `int4-g<group>` / `int8-g<group>`
    (group-wise with a 16-bit scale and a 16-bit zero per group, as torch's int4 CPU kernel stores them)."""
    if isinstance(spec, Precision):
        return spec
    key = str(spec).strip().lower()
    if key in _FIXED:
        return _FIXED[key]
    m = _GROUPED.match(key)
    if m and int(m.group(2)) > 0:
        return Precision(key, int(m.group(1)), int(m.group(2)), 4)
    raise ValueError(
        f"unknown precision {spec!r}; known: {sorted(set(_FIXED))} or int4-g<group> / int8-g<group>"
    )


def dtype_bytes(name: str) -> int:
    """Bytes per element of an activation / KV-cache dtype name (fp32, bf16, fp16, fp8)."""
    p = precision(name)
    if p.group_size or p.name not in ("fp32", "bf16", "fp16", "fp8", "int8"):
        raise ValueError(f"{name!r} is not a plain element dtype for activations or the KV cache")
    return p.bits // 8


# ------------------------------------------------------------------------------------------------ hardware
@dataclass(frozen=True)
class HardwareProfile:
    """One device: peak dense FLOP/s per compute dtype, memory bandwidth and capacity, optional price."""

    name: str
    bandwidth: float  # bytes/s
    flops: dict[str, float]  # compute dtype ("bf16", "fp32", ...) -> dense FLOP/s
    memory: float  # bytes
    price_per_hour: float | None = None  # per device, in the user's currency

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.memory <= 0 or not self.flops or min(self.flops.values()) <= 0:
            raise ValueError(f"hardware {self.name!r}: bandwidth, memory and every peak must be > 0")

    def peak(self, compute_dtype: str) -> float:
        key = precision(compute_dtype).name
        if key not in self.flops:
            raise ValueError(f"hardware {self.name!r} has no peak for {compute_dtype!r}; has {sorted(self.flops)}")
        return self.flops[key]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> HardwareProfile:
        """Build from the `hardware` config group (TB/s, TFLOP/s and GB, as data sheets print them)."""
        name = cfg.get("name", "?")
        unknown = sorted(set(cfg) - set(_HARDWARE_KEYS))
        if unknown:
            raise ValueError(f"hardware {name!r}: unknown keys {unknown}; expected {list(_HARDWARE_KEYS)}")
        missing = [k for k in _HARDWARE_KEYS[:4] if cfg.get(k) is None]
        if missing:
            raise ValueError(f"hardware {name!r} misses {missing}")
        try:
            return cls(
                name=str(name),
                bandwidth=float(cfg["bandwidth_tbs"]) * TB,
                flops={precision(k).name: float(v) * 1e12 for k, v in dict(cfg["peak_tflops"]).items()},
                memory=float(cfg["memory_gb"]) * GB,
                price_per_hour=None if cfg.get("price_per_hour") is None else float(cfg["price_per_hour"]),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"hardware {name!r}: {e}") from None


_HARDWARE_KEYS = ("name", "bandwidth_tbs", "peak_tflops", "memory_gb", "price_per_hour")


def ridge_point(hw: HardwareProfile, compute_dtype: str = "bf16") -> float:
    """FLOP per byte a kernel needs to be compute-bound rather than bandwidth-bound."""
    return hw.peak(compute_dtype) / hw.bandwidth


def aggregate_bandwidth(hw: HardwareProfile, tp: int) -> float:
    """Bandwidth of `tp` devices each reading its own shard (interconnect time not included)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tp}")
    return hw.bandwidth * tp


# -------------------------------------------------------------------------------------------- model shape
def matrix_params(cfg: ModelConfig) -> int:
    """Weights in matrices read by every step: attention and MLP projections of all layers and the LM head."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def vector_params(cfg: ModelConfig) -> int:
    """Norm weights and biases: tiny, kept in 16 bits (or 32) whatever the matrix precision."""
    bias = (cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else 0
    mlp_bias = (2 * cfg.intermediate_size + cfg.hidden_size) if cfg.mlp_bias else 0
    return cfg.num_layers * (2 * cfg.hidden_size + bias + mlp_bias) + cfg.hidden_size


def _vector_bytes(p: Precision) -> int:
    return 4 if p.bits >= 32 else 2


def weight_bytes(cfg: ModelConfig, weights: str | Precision, embedding: str | Precision | None = None) -> float:
    """Bytes to store the model (the checkpoint: a tied embedding counted once). `embedding` defaults to `weights`."""
    p = precision(weights)
    pe = precision(embedding) if embedding is not None else p
    table = cfg.vocab_size * cfg.hidden_size
    body = matrix_params(cfg) - table  # layers only
    total = p.bytes_for(body) + pe.bytes_for(table) + vector_params(cfg) * _vector_bytes(p)
    if not cfg.tie_word_embeddings:
        total += p.bytes_for(table)  # separate LM head, stored at the matrix precision
    return total


def weight_read_bytes(cfg: ModelConfig, weights: str | Precision, embedding: str | Precision | None = None) -> float:
    """Bytes of weights one forward step reads: everything but an untied input-embedding table."""
    total = weight_bytes(cfg, weights, embedding)
    if not cfg.tie_word_embeddings:
        pe = precision(embedding) if embedding is not None else precision(weights)
        total -= pe.bytes_for(cfg.vocab_size * cfg.hidden_size)
    return total


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16", tp: int = 1) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element; per device under TP."""
    return 2 * cfg.num_layers * -(-cfg.num_kv_heads // tp) * cfg.head_dim * dtype_bytes(kv_dtype)


def kv_bytes_per_sequence(cfg: ModelConfig, context: int, kv_dtype: str = "bf16") -> int:
    return kv_bytes_per_token(cfg, kv_dtype) * context


def forward_flops(cfg: ModelConfig, tokens: float, kv_positions_read: float) -> float:
    """FLOPs of forward passes over `tokens` tokens whose attention covers `kv_positions_read` (query, key)
    pairs in all: 2 per matrix weight per token, 2 x 2 per pair and head dim (QK^T and PV) in every layer."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * kv_positions_read
    return tokens * 2 * matrix_params(cfg) + attention


def forward_bytes(
    cfg: ModelConfig, weights: str | Precision, steps: float, tokens: float, kv_positions_read: float,
    kv_dtype: str = "bf16", embedding: str | Precision | None = None,
) -> float:
    """Bytes `steps` forward passes move: the weights once per step, the KV rows read, one new KV row per token."""
    kv = kv_bytes_per_token(cfg, kv_dtype)
    return steps * weight_read_bytes(cfg, weights, embedding) + (kv_positions_read + tokens) * kv


def decode_step_flops(cfg: ModelConfig, batch: int, context: int) -> float:
    """FLOPs of one decode step of `batch` sequences, each attending over `context` positions."""
    return forward_flops(cfg, batch, batch * context)


def decode_step_bytes(
    cfg: ModelConfig, weights: str | Precision, batch: int, context: int, kv_dtype: str = "bf16",
    embedding: str | Precision | None = None,
) -> float:
    """Bytes one decode step moves: the weights once, each sequence's KV over `context`, one new KV row each."""
    return forward_bytes(cfg, weights, 1, batch, batch * context, kv_dtype, embedding)


# ------------------------------------------------------------------------------------------------ ceilings
@dataclass(frozen=True)
class Ceiling:
    """Decode throughput bounds (tokens/s) at one batch and context; `tokens_per_s` is the lower of the two."""

    batch: int
    context: int
    bandwidth_bound: float
    compute_bound: float
    step_bytes: float
    step_flops: float

    @property
    def tokens_per_s(self) -> float:
        return min(self.bandwidth_bound, self.compute_bound)

    @property
    def bound(self) -> str:
        return "memory" if self.bandwidth_bound <= self.compute_bound else "compute"

    @property
    def intensity(self) -> float:
        """FLOP per byte of the step: compare with the ridge point."""
        return self.step_flops / self.step_bytes


def decode_ceiling(
    cfg: ModelConfig, hw: HardwareProfile, weights: str | Precision, batch: int = 1, context: int = 0,
    kv_dtype: str = "bf16", compute_dtype: str = "bf16", tp: int = 1, embedding: str | Precision | None = None,
) -> Ceiling:
    """Tokens/s upper bound of decoding `batch` sequences at `context`: min(bandwidth bound, compute bound).

    Under tensor parallelism each of `tp` devices reads and computes its shard (communication ignored).
    """
    if batch < 1 or context < 0:
        raise ValueError(f"batch must be >= 1 and context >= 0, got batch={batch} context={context}")
    step_bytes = decode_step_bytes(cfg, weights, batch, context, kv_dtype, embedding)
    step_flops = decode_step_flops(cfg, batch, context)
    return Ceiling(
        batch=batch,
        context=context,
        bandwidth_bound=batch * aggregate_bandwidth(hw, tp) / step_bytes,
        compute_bound=batch * hw.peak(compute_dtype) * tp / step_flops,
        step_bytes=step_bytes,
        step_flops=step_flops,
    )


def prefill_seconds(
    cfg: ModelConfig, hw: HardwareProfile, weights: str | Precision, tokens: int, prompt_len: int,
    chunk_tokens: int = 8192, compute_dtype: str = "bf16", kv_dtype: str = "bf16", tp: int = 1,
) -> float:
    """Lower bound on the time to prefill `tokens` prompt tokens (prompts of `prompt_len`), `chunk_tokens` per step.

    FLOPs: 2 per matrix weight per token plus causal attention (each token attends to ~prompt_len/2 positions);
    bytes: the weights once per chunk plus the KV rows written. Usually compute-bound.
    """
    if tokens < 0 or prompt_len < 1 or chunk_tokens < 1:
        raise ValueError(f"need tokens >= 0, prompt_len >= 1, chunk_tokens >= 1; got {tokens}, {prompt_len}, {chunk_tokens}")
    if tokens == 0:
        return 0.0
    flops = forward_flops(cfg, tokens, tokens * prompt_len / 2)
    # attention reads of the prompt's own KV stay in on-chip tiles: only the weights and KV writes count
    moved = forward_bytes(cfg, weights, math.ceil(tokens / chunk_tokens), tokens, 0, kv_dtype)
    return max(flops / (hw.peak(compute_dtype) * tp), moved / aggregate_bandwidth(hw, tp))


def max_batch(
    cfg: ModelConfig, weights: str | Precision, context: int, memory_bytes: float, kv_dtype: str = "bf16",
    embedding: str | Precision | None = None,
) -> int:
    """Largest number of sequences of `context` tokens whose KV fits beside the weights in `memory_bytes`."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    free = memory_bytes - weight_bytes(cfg, weights, embedding)
    return max(0, int(free // kv_bytes_per_sequence(cfg, context, kv_dtype)))


def cost_per_million_tokens(tokens_per_s: float, price_per_hour: float, devices: int = 1) -> float:
    """What a million tokens cost at `price_per_hour` per device when `devices` together make `tokens_per_s`."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
    return price_per_hour * devices / (tokens_per_s * 3600) * 1e6


# ------------------------------------------------------------------------------------------- one setup
@dataclass(frozen=True)
class Roofline:
    """A model on a hardware profile at given precisions: the object the plan and the run report share."""

    model: ModelConfig
    hw: HardwareProfile
    weights: Precision
    kv_dtype: str = "bf16"
    compute_dtype: str = "bf16"
    tp: int = 1

    @classmethod
    def of(
        cls, model: ModelConfig, hw: HardwareProfile, dtype: str, weights: str | None = None,
        kv_dtype: str | None = None, compute_dtype: str | None = None, tp: int = 1,
    ) -> Roofline:
        """A model run in `dtype` (float32, bfloat16, ...): weights, KV cache and matmuls default to it."""
        return cls(model, hw, precision(weights or dtype), kv_dtype or dtype, compute_dtype or dtype, tp)

    @property
    def bandwidth(self) -> float:
        return aggregate_bandwidth(self.hw, self.tp)

    @property
    def peak(self) -> float:
        return self.hw.peak(self.compute_dtype) * self.tp

    @property
    def ridge(self) -> float:
        return self.peak / self.bandwidth

    def ceiling(self, batch: int = 1, context: int = 0) -> Ceiling:
        return decode_ceiling(
            self.model, self.hw, self.weights, batch, context, self.kv_dtype, self.compute_dtype, self.tp
        )

    def work(self, steps: float, tokens: float, kv_positions_read: float) -> tuple[float, float]:
        """(bytes, FLOPs) of `steps` forward passes over `tokens` tokens that read `kv_positions_read`
        cached positions in all (summed over the tokens' attention): what a stretch of a run did."""
        return (
            forward_bytes(self.model, self.weights, steps, tokens, kv_positions_read, self.kv_dtype),
            forward_flops(self.model, tokens, kv_positions_read),
        )

    def seconds(self, moved: float, flops: float) -> float:
        """Least time the hardware needs for that much traffic and arithmetic."""
        return max(moved / self.bandwidth, flops / self.peak)
