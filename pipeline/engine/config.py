"""Engine settings: KV budget, batching limits, prefix caching. Validated once, with errors naming the key."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: str | int, key: str = "engine.kv_cache_memory") -> int:
    """`2GiB`, `512MB`, `1e9` or an int -> bytes (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a byte size like '2GiB' or an integer, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{key} must be a byte size like '2GiB' or '512MB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{key} must be > 0 bytes, got {value!r}")
    return n


AUTO_CPU_KV_BYTES = 2**30
BATCH_CANDIDATES = (16, 32, 64, 128, 256)  # what max_batch_size=auto measures
COMPILE_CHOICES = ("auto", "on", "off")


@dataclass
class EngineConfig:
    """How the engine batches and how much memory its KV cache may take.

    max_model_len=None means the model's max positions (capped by what the KV cache can hold);
    max_waiting=None means 4 x max_batch_size requests read ahead of the running batch.
    max_batch_size="auto" sizes the engine for the largest candidate of `pipeline.engine.batch_tuning`, and
    `Engine.tune_batch_size` narrows it to the measured best.
    """

    block_size: int = 16
    kv_cache_memory: str | int = "auto"  # auto: from free memory on CUDA (gpu_memory_utilization), 1 GiB on CPU
    max_batched_tokens: int = 512
    max_batch_size: int | str = 64  # or "auto"
    max_model_len: int | None = None
    prefix_caching: bool = True
    device: str = "auto"
    max_waiting: int | None = None
    seed: int = 0  # seeds the generators of requests that carry no seed of their own
    tensor_parallel: int = 1  # ranks the model is split across (pipeline/parallel/runner.py)
    cuda_graphs: bool = True  # CUDA: replay captured decode steps (docs/gpu.md); no effect on CPU
    # CPU: torch.compile the decoder layers (fused elementwise work): auto (models with W8A8 steps), on, off
    compile: str = "auto"
    gpu_memory_utilization: float = 0.9  # CUDA, kv_cache_memory=auto: share of device memory the job may use

    def __post_init__(self) -> None:
        for key in ("block_size", "max_batched_tokens", "max_batch_size", "tensor_parallel"):
            value = getattr(self, key)
            if key == "max_batch_size" and value == "auto":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"engine.{key} must be an integer >= 1{' or auto' * (key == 'max_batch_size')}, "
                                 f"got {value!r}")
        for key in ("max_model_len", "max_waiting"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"engine.{key} must be an integer >= 1 or null, got {value!r}")
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(f"engine.compile must be one of {', '.join(COMPILE_CHOICES)}, got {self.compile!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"engine.cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise ValueError(f"engine.gpu_memory_utilization must be a fraction in (0, 1], got {util!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"engine.prefix_caching must be true or false, got {self.prefix_caching!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"engine.seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"engine.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not self.kv_cache_auto:
            parse_bytes(self.kv_cache_memory)

    @property
    def kv_cache_auto(self) -> bool:
        return self.kv_cache_memory == "auto"

    @property
    def kv_cache_bytes(self) -> int:
        """The fixed KV budget: the configured size, or 1 GiB for `auto` (what `auto` means on CPU)."""
        return AUTO_CPU_KV_BYTES if self.kv_cache_auto else parse_bytes(self.kv_cache_memory)

    @property
    def batch_limit(self) -> int:
        """The most running samples the engine is sized for: max_batch_size, or auto's largest candidate."""
        return max(BATCH_CANDIDATES) if self.max_batch_size == "auto" else self.max_batch_size


SPECULATIVE_METHODS = ("none", "ngram", "draft")
DRAFT_DTYPES = ("float32", "bfloat16", "float16")
DRAFT_QUANTS = ("none", "int8", "int4", "gguf")


@dataclass
class DraftConfig:
    """The draft model of `speculative.method=draft` (loaded by the job: the engine loads no files).

    path=None drafts with the target checkpoint itself (exact but no faster: for tests and checks)."""

    path: str | None = None
    dtype: str = "float32"
    quant: str = "none"

    def __post_init__(self) -> None:
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ValueError(f"speculative.draft.path must be a model path or null, got {self.path!r}")
        if self.dtype not in DRAFT_DTYPES:
            raise ValueError(f"speculative.draft.dtype must be one of {', '.join(DRAFT_DTYPES)}, got {self.dtype!r}")
        if self.quant not in DRAFT_QUANTS:
            raise ValueError(f"speculative.draft.quant must be one of {', '.join(DRAFT_QUANTS)}, got {self.quant!r}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to `k` tokens, the model verifies them in one step.

    Per step, only where it pays (`pipeline.engine.spec_gate`): checking guesses costs little while a
    step is bound by reading the weights and up to k + 1 times a plain step where it is compute bound, so
    the engine speculates when the tokens a check yields (1 + guesses kept per sequence) beat the measured
    cost of the longer step by `min_gain`; never with more than `max_batch` sequences running.
    `adaptive_k` lets each sequence propose one more token after a fully accepted guess and one fewer
    (down to 1) after a fully rejected one.
    """

    method: str = "none"
    k: int = 4
    ngram_min: int = 2  # a 1-token match guesses too often in free text: every guess costs a position
    ngram_max: int = 4
    max_batch: int = 256
    min_gain: float = 1.1  # speculate when it yields at least this many times the tokens per second; 0: always
    adaptive_k: bool = False
    draft: DraftConfig = field(default_factory=DraftConfig)

    def __post_init__(self) -> None:
        if isinstance(self.draft, dict):
            self.draft = DraftConfig(**self.draft)
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        for key in ("k", "ngram_min", "ngram_max", "max_batch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative.{key} must be an integer >= 1, got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"speculative.ngram_min={self.ngram_min} must not exceed speculative.ngram_max={self.ngram_max}")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, int | float) or self.min_gain < 0:
            raise ValueError(f"speculative.min_gain must be a number >= 0, got {self.min_gain!r}")
        if not isinstance(self.adaptive_k, bool):
            raise ValueError(f"speculative.adaptive_k must be true or false, got {self.adaptive_k!r}")
