"""Building blocks of a Llama-family decoder: norms, rotary embeddings and tensor-parallel linears.

Linears know how to load their own shard of a full checkpoint tensor, so the same model code runs with
tp_size=1 (plain linears) and under tensor parallelism. Loading only uses `tensor.narrow`, so any
tensor-like object that supports it (e.g. raw quantized blocks) can be sharded the same way.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.argmax import row_argmax
from pipeline.model.collectives import SINGLE, TPGroup
from pipeline.model.lora.delta import add_lora

log = logging.getLogger(__name__)


def compiled_copy(fn: Callable, **options: Any) -> Callable:
    """`torch.compile(fn, **options)` on a copy of fn with a code object of its own (a bound method stays
    bound). Dynamo keeps compiled graphs per code object, so models compiled in one process would share one
    cache, and once it holds Dynamo's recompile limit (8 graphs) the next model would run eagerly."""
    func = getattr(fn, "__func__", fn)
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__ = func.__kwdefaults__
    pin_vector_isa()
    return torch.compile(own if fn is func else types.MethodType(own, fn.__self__), **options)


def pin_vector_isa(verdict: Callable[[], bool] | None = None) -> bool:
    """Write torch.compile's verdict on this CPU's vector instructions into its config
    (`torch._inductor.config.cpp.vec_isa_ok`) and return it; a value already set (TORCHINDUCTOR_VEC_ISA_OK)
    is kept. `verdict` (default `vector_isa_ok`, 3-4 s) may answer from an earlier start's check.

    Why: the CPU backend vectorizes its loops only where a small check program, built and loaded in a
    child process, passes; left unset, the verdict is not part of the key of torch's on-disk graph cache.
    One process whose check failed (a broken compiler or header cache, a load probe past its timeout) then
    caches scalar loops that every later process is served, its own check passing or not: on a Zen 4 such
    a cache made the 256-row steps of a W8A8 job 1.4-1.5x slower. Pinned, the verdict keys the cache."""
    from torch._inductor import config

    cpp = config.cpp
    if cpp.vec_isa_ok is None:
        cpp.vec_isa_ok = (verdict or vector_isa_ok)()
        if not cpp.vec_isa_ok:
            log.warning("torch.compile found no vector instructions it can use on this CPU (its check "
                        "program did not build or load): compiled loops are scalar and several times slower")
    return cpp.vec_isa_ok


def vector_isa_ok() -> bool:
    """torch.compile's own check of this CPU's vector instructions: whether a small program built with one of
    the instruction sets this CPU has loads. On x86-64 Linux (no `ATEN_CPU_CAPABILITY` or `simdlen` picking
    a set) the sets are checked widest first and the first that passes answers, as `pick_vec_isa` would:
    that checked every set, 10 builds and 23 child processes where an AMX CPU's widest needs 4 (11.1 s
    against 3.5 s on 2 cores, all of it in a first start's load)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa, supported_vec_isa_list, x86_isa_checker

    if (sys.platform, platform.machine()) != ("linux", "x86_64") or config.cpp.simdlen is not None \
            or os.environ.get("ATEN_CPU_CAPABILITY"):
        return bool(pick_vec_isa())
    flags = x86_isa_checker()
    return any(isa for isa in supported_vec_isa_list if all(flag in flags for flag in str(isa).split()))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 style long-context scaling when `scaling` asks for it."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout) with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] of `positions` [T]: gathered once per forward pass, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by the (cos, sin) tables of their positions."""
    cos, sin = cos_sin
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class ParallelLinear(nn.Module):
    """y = x W^T (+ b), with W split across tensor-parallel ranks along `shard_dim`.

    shard_dim=0 (column-parallel): each rank owns a slice of the outputs, no communication.
    shard_dim=1 (row-parallel): each rank owns a slice of the inputs; outputs are all-reduced.
    `output_sizes` lists the full sizes of sub-matrices fused along the output dimension (e.g. q, k, v);
    each is sharded separately so a rank's slice holds its own heads of every part.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        shard_dim: int,
        bias: bool = False,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.tp = tp
        self.shard_dim = shard_dim
        self.output_sizes = list(output_sizes)
        if shard_dim == 0:
            for size in output_sizes:
                if size % tp.size:
                    raise ValueError(f"output size {size} is not divisible by tensor_parallel={tp.size}")
            self.local_output_sizes = [s // tp.size for s in output_sizes]
            self.in_features = in_features
        else:
            if in_features % tp.size:
                raise ValueError(f"input size {in_features} is not divisible by tensor_parallel={tp.size}")
            self.local_output_sizes = list(output_sizes)
            self.in_features = in_features // tp.size
        self.out_features = sum(self.local_output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=dtype), requires_grad=False)
        # Row-parallel bias is added once, after the all-reduce, so every rank keeps the full bias.
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def init_args(self) -> tuple:
        """The constructor arguments that give a layer of this one's shape and sharding (for a quantized
        replacement built on the same split)."""
        full_in = self.in_features * (self.tp.size if self.shard_dim == 1 else 1)
        return full_in, self.output_sizes, self.shard_dim, self.bias is not None, self.tp, self.weight.dtype

    def local_rows(self, shard_id: int) -> tuple[int, int]:
        """(start, length) of part `shard_id` inside this rank's fused output rows."""
        start = sum(self.local_output_sizes[:shard_id])
        return start, self.local_output_sizes[shard_id]

    def shard_of(self, full, shard_id: int = 0, is_bias: bool = False):
        """This rank's slice of a full checkpoint tensor for part `shard_id`."""
        if self.shard_dim == 0:
            n = self.local_output_sizes[shard_id]
            return full.narrow(0, self.tp.rank * n, n)
        if is_bias:
            return full
        return full.narrow(1, self.tp.rank * self.in_features, self.in_features)

    def load(self, full: torch.Tensor, shard_id: int = 0, is_bias: bool = False) -> None:
        part = self.shard_of(full, shard_id, is_bias)
        target = self.bias if is_bias else self.weight
        start, n = self.local_rows(shard_id)
        target.data.narrow(0, start, n).copy_(part)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) on this rank's weight: the one step a quantized subclass replaces."""
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a bound LoRA step's deltas join the base product: before the all-reduce of a row-parallel layer,
        # so each rank's partial delta is summed with its partial product, once (pipeline.model.lora.delta)
        if self.shard_dim == 0:
            return add_lora(self, x, self.linear(x, self.bias))
        y = self.tp.all_reduce(add_lora(self, x, self.linear(x, None)))
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Token embedding, replicated on every rank (small next to the layers; keeps lookups local)."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Vocabulary-parallel output projection: each rank computes logits for its slice of the vocab."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp.size)
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, dim, dtype=dtype), requires_grad=False)

    def load(self, full: torch.Tensor) -> None:
        start = self.tp.rank * self.local_vocab
        n = max(0, min(self.local_vocab, self.vocab_size - start))
        self.weight.data[:n].copy_(full.narrow(0, start, n))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's most likely token id [N] (int64): the argmax of `forward(hidden)`, for steps that
        want nothing else of the logits."""
        return row_argmax(self(hidden))

    def compile(self, **options: Any) -> None:
        """Compile this head's forward with graphs of its own (`compiled_copy`)."""
        self.forward = compiled_copy(self.forward, **options)
