"""Build, cache and call the native CPU paged attention (`kernels/cpu_attention.c`): the decode pass, and
the write of each step's new keys and values into the pools.

The C source is compiled once per (head_dim, query group, block size, compiler, CPU) by
`kernels.native_build` (the system C compiler, `-march=native`, cached under `$PIPELINE_KERNEL_CACHE`,
default `~/.cache/pipeline/kernels`) and called through ctypes.

Where it cannot run (no compiler, a CPU without AVX2, a shape the kernel does not take, or
`PIPELINE_NATIVE` leaving out `attention`), `load_paged_decode` says why and callers keep torch's path.
"""

from __future__ import annotations

import ctypes
import subprocess
from functools import cache
from pathlib import Path

import torch

from kernels import native_build
from kernels.native_build import built_library, c_compiler, function_address

SOURCE = Path(__file__).with_name("cpu_attention.c")
VECTOR_FLOATS = 16  # head_dim and block_size must be multiples of this (AVX-512 width; AVX2 takes 8)
MAX_GROUP = 16  # query heads per KV head held in registers / on the stack per task


class NativeKernelUnavailable(RuntimeError):
    """The native kernel cannot run here; the message says why."""


# pool dtypes the kernel reads (bfloat16: -DKV_BF16; int8: -DKV_I8, with a float32 scale per key and value)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_DEFINES = {torch.bfloat16: "-DKV_BF16", torch.int8: "-DKV_I8"}


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (q int8 [..., D], scale float32 [...]): the int8 pools' format, one scale per
    vector, s = max|x| / 127 and q = round(x / s) (a zero vector: s = 0, q = 0)."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)[..., None]).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 vectors int8 pools stand for."""
    return q.float() * scale[..., None]


class PagedDecodeKernel:
    """The compiled kernels for one (head_dim, group, block_size, pool dtype)."""

    def __init__(self, library: ctypes.CDLL, head_dim: int, group: int, block_size: int, kv_dtype: torch.dtype):
        self.head_dim, self.group, self.block_size, self.kv_dtype = head_dim, group, block_size, kv_dtype
        self._fn = library.paged_decode
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [
            ctypes.c_int64] * 3 + [ctypes.c_float]
        # int8 pools: scores in integer arithmetic, the queries rounded to int16 (AVX-512 builds)
        self.integer_scores = bool(library.paged_integer_scores())
        self._write = library.paged_write
        self._write.restype = None
        self._write.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [
            ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
        # the entry points, for native code that runs the write and decode itself (`kernels.cpu_decode_layers`)
        self.write_address, self.decode_address = function_address(self._write), function_address(self._fn)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
              v_pool: torch.Tensor, k_scales: torch.Tensor | None = None,
              v_scales: torch.Tensor | None = None) -> None:
        """Store token i's k[i], v[i] ([n, Hkv, D] float32) at slot slots[i] (block * block_size + offset) of
        the pools, rounded to the pools' dtype as `Tensor.to` rounds (int8 pools: as `quantize_kv`, the
        scales into k_scales / v_scales [Hkv, num_blocks, block_size] float32). k and v may be views with
        tokens any stride apart (slices of a fused qkv output): they are read in place, not copied."""
        hkv, num_blocks, block_size, dim = k_pool.shape
        if (dim, block_size) != (self.head_dim, self.block_size) or k.shape != v.shape or k.shape[1:] != (hkv, dim):
            raise ValueError(f"kernel built for head_dim/block {self.head_dim}/{self.block_size}, called with "
                             f"keys {tuple(k.shape)}, values {tuple(v.shape)} and pools {tuple(k_pool.shape)}")
        k, v = _packed_tokens("k", k), _packed_tokens("v", v)
        for name, t, dtype in (("slots", slots, torch.int64), ("k_pool", k_pool, self.kv_dtype),
                               ("v_pool", v_pool, self.kv_dtype)):
            _check(name, t, dtype)
        if slots.shape != (k.shape[0],):
            raise ValueError(f"slots must have {k.shape[0]} entries, got {tuple(slots.shape)}")
        ks, vs = self._scales(k_pool, k_scales, v_scales)
        self._write(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr(), k.shape[0],
                    k_pool.data_ptr(), v_pool.data_ptr(), ks, vs, hkv, num_blocks)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, first: torch.Tensor, scale: float, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """q [rows, Hq, D] float32 over pools [Hkv, num_blocks, block_size, D] (int8 pools: with their
        scales): row r sees its keys at positions first[r] .. lens[r] - 1 through block table tables[r]
        (int64). Returns [rows, Hq, D] float32."""
        rows, hq, dim = q.shape
        hkv, num_blocks, block_size, _ = k_pool.shape
        if (dim, hq // hkv, block_size) != (self.head_dim, self.group, self.block_size):
            raise ValueError(f"kernel built for head_dim/group/block {self.head_dim}/{self.group}/"
                             f"{self.block_size}, called with {dim}/{hq // hkv}/{block_size}")
        for name, t, dtype in (("q", q, torch.float32), ("k_pool", k_pool, self.kv_dtype),
                               ("v_pool", v_pool, self.kv_dtype), ("tables", tables, torch.int64),
                               ("lens", lens, torch.int64), ("first", first, torch.int64)):
            _check(name, t, dtype)
        if tables.shape[0] != rows or lens.shape != (rows,) or first.shape != (rows,):
            raise ValueError(f"tables/lens/first must have {rows} rows, got {tuple(tables.shape)}, "
                             f"{tuple(lens.shape)}, {tuple(first.shape)}")
        ks, vs = self._scales(k_pool, k_scales, v_scales)
        out = torch.empty_like(q)
        self._fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), ks, vs, tables.data_ptr(), tables.shape[1],
                 lens.data_ptr(), first.data_ptr(), out.data_ptr(), rows, hkv, num_blocks, scale)
        return out

    def _scales(self, pool: torch.Tensor, k_scales: torch.Tensor | None,
                v_scales: torch.Tensor | None) -> tuple[int | None, int | None]:
        """The scale pools' addresses: required with int8 pools (shaped like the pools without D), else
        none."""
        if self.kv_dtype != torch.int8:
            if k_scales is not None or v_scales is not None:
                raise ValueError(f"{self.kv_dtype} pools have no scales")
            return None, None
        for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
            if t is None or t.shape != pool.shape[:3]:
                raise ValueError(f"int8 pools need {name} shaped {tuple(pool.shape[:3])}, got "
                                 f"{None if t is None else tuple(t.shape)}")
            _check(name, t, torch.float32)
        return k_scales.data_ptr(), v_scales.data_ptr()


def _packed_tokens(name: str, t: torch.Tensor) -> torch.Tensor:
    """A float32 CPU t [n, H, D] with each token's H x D values packed, as the write kernel reads it (tokens
    may be any stride apart), copied only where they are not."""
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    return t if t.stride()[1:] == (t.shape[2], 1) else t.contiguous()


def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """The kernels take raw pointers: every tensor must be contiguous, on the CPU, of the dtype they read."""
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}")


def machine_reason() -> str | None:
    """Why no native kernel runs on this machine, whatever the shape (None: it builds where shapes allow)."""
    return native_build.machine_reason("attention", "avx2", "AVX2")


def load_paged_decode(head_dim: int, group: int, block_size: int,
                      kv_dtype: torch.dtype = torch.float32) -> PagedDecodeKernel:
    """The kernel for this shape and pool dtype, built on first use (and cached on disk);
    NativeKernelUnavailable if not."""
    reason = machine_reason()
    if reason is not None:
        raise NativeKernelUnavailable(reason)
    outcome = _kernel_or_reason(head_dim, group, block_size, kv_dtype)
    if isinstance(outcome, str):
        raise NativeKernelUnavailable(outcome)
    return outcome


@cache
def _kernel_or_reason(head_dim: int, group: int, block_size: int, kv_dtype: torch.dtype) -> PagedDecodeKernel | str:
    """Built once per process and shape; a failure is remembered too, so it is not retried per engine."""
    if head_dim % VECTOR_FLOATS or block_size % VECTOR_FLOATS or not 1 <= group <= MAX_GROUP:
        return (f"head_dim {head_dim} and block_size {block_size} must be multiples of {VECTOR_FLOATS}, "
                f"and query heads per KV head ({group}) at most {MAX_GROUP}")
    if kv_dtype not in KV_DTYPES:
        return f"KV pools in {kv_dtype} (the kernel reads {' or '.join(map(str, KV_DTYPES))})"
    defines = (f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", f"-DBLOCK={block_size}",
               *([_DEFINES[kv_dtype]] if kv_dtype in _DEFINES else []))
    try:
        library = built_library(c_compiler(), SOURCE, defines)
        return PagedDecodeKernel(ctypes.CDLL(str(library)), head_dim, group, block_size, kv_dtype)
    except (OSError, subprocess.SubprocessError) as e:
        return f"building or loading {SOURCE.name} failed: {e}"
