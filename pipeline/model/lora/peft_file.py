"""Reading a PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`) and checking it
against the model it will run on.

Why checked here, in full, before any weight is placed: an adapter the model cannot take (a module it does
not have, a rank or shape that does not match, a changed vocabulary) must fail as one clear message, at
start for a configured adapter and as an error row for a row's own, never mid-step.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pipeline.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections of a decoder layer an adapter may target, in checkpoint (Hugging Face) names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's shorthand for every linear layer but the output head.
ALL_LINEAR = "all-linear"
# Modules whose own weights an adapter may carry that change the vocabulary (resized or retrained).
VOCABULARY_MODULES = ("embed_tokens", "lm_head", "embed_out", "wte")

# A LoRA tensor's name: ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>[.<adapter name>].weight
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.([A-Za-z_]+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """Why an adapter cannot run on this model (one line, naming the adapter)."""


@dataclass(frozen=True)
class Adapter:
    """An adapter's low-rank pairs at full (unsharded) size, float32: (layer, module) -> (A [r, in],
    B [out, r]), and the factor the product is scaled by (alpha / r, or alpha / sqrt(r) for rsLoRA)."""

    name: str
    rank: int
    scale: float
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> list[str]:
        return sorted({module for _, module in self.pairs}, key=TARGETS.index)


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of `cfg`'s layers."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_config(path: Path, name: str) -> dict:
    """The adapter's `adapter_config.json`, checked for what this runtime supports."""
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: {config_file} not found (expected a PEFT LoRA checkpoint folder)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {config_file}: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {name!r}: {config_file} does not hold a JSON object")
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type={kind!r}; only LORA adapters are supported")
    saved = [m for m in raw.get("modules_to_save") or [] if m]
    if saved:
        what = "changes the vocabulary" if any(m in VOCABULARY_MODULES for m in saved) else "replaces whole modules"
        raise AdapterError(f"adapter {name!r} {what} (modules_to_save={saved}); only low-rank deltas on the "
                           "layers' projections are supported")
    if raw.get("trainable_token_indices"):
        raise AdapterError(f"adapter {name!r} changes the vocabulary (trainable_token_indices)")
    unsupported = {"use_dora": raw.get("use_dora"), "fan_in_fan_out": raw.get("fan_in_fan_out"),
                   "lora_bias": raw.get("lora_bias"), "rank_pattern": raw.get("rank_pattern"),
                   "alpha_pattern": raw.get("alpha_pattern"), "layer_replication": raw.get("layer_replication")}
    unsupported = {k: v for k, v in unsupported.items() if v}
    if raw.get("bias", "none") != "none":
        unsupported["bias"] = raw["bias"]
    if unsupported:
        raise AdapterError(f"adapter {name!r}: {', '.join(f'{k}={v}' for k, v in unsupported.items())} is not "
                           "supported")
    targets = raw.get("target_modules")
    if isinstance(targets, list | tuple):
        unknown = [t for t in targets if t not in TARGETS and t.rsplit(".", 1)[-1] not in TARGETS]
        if unknown:
            raise AdapterError(f"adapter {name!r} targets {unknown}, which the model does not have as LoRA "
                               f"targets (it has {', '.join(TARGETS)})")
    for key in ("r", "lora_alpha"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise AdapterError(f"adapter {name!r}: {key}={value!r} in {CONFIG_FILE}; expected a number > 0")
    return raw


def read_adapter(path: str | Path, cfg: ModelConfig, name: str | None = None) -> Adapter:
    """The adapter at `path` (a local folder), checked against a model of shape `cfg`; AdapterError naming
    the adapter and the problem otherwise."""
    path = Path(path)
    name = name or str(path)
    raw = read_config(path, name)
    rank = int(raw["r"])
    alpha = float(raw["lora_alpha"])
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    tensors = _read_tensors(path / WEIGHTS_FILE, name)
    shapes = module_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key in sorted(tensors, key=lambda k: ".lora_" not in k):  # a LoRA pair's target is named first
        tensor, m = tensors[key], _TENSOR.search(key)
        if m is None:
            if ".lora_" in key:
                module = key.split(".lora_")[0].rsplit(".", 1)[-1]
                raise AdapterError(f"adapter {name!r} targets {module!r}, which the model does not have as a "
                                   f"LoRA target (it has {', '.join(TARGETS)})")
            if any(f"{v}." in key for v in VOCABULARY_MODULES):
                raise AdapterError(f"adapter {name!r} changes the vocabulary (it carries {key})")
            raise AdapterError(f"adapter {name!r}: tensor {key} is not a LoRA pair of a layer projection")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise AdapterError(f"adapter {name!r} targets {module!r}, which the model does not have "
                               f"(it has {', '.join(TARGETS)})")
        if layer >= cfg.num_layers:
            raise AdapterError(f"adapter {name!r}: {key} is for layer {layer}; the model has {cfg.num_layers}")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for (layer, module), pair in sorted(halves.items()):
        pairs[(layer, module)] = _checked_pair(pair, layer, module, shapes[module], rank, name)
    return Adapter(name, rank, scale, pairs)


def _read_tensors(file: Path, name: str) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise AdapterError(f"adapter {name!r}: {file} not found")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except (OSError, SafetensorError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {file}: {e}") from None


def _checked_pair(pair: dict[str, torch.Tensor], layer: int, module: str, shape: tuple[int, int], rank: int,
                  name: str) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"adapter {name!r}, layer {layer} {module}"
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{where}: lora_{'B' if 'A' in pair else 'A'} is missing")
    a, b = pair["A"], pair["B"]
    features_in, features_out = shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have rank r={rank}")
    if a.shape[1] != features_in or b.shape[0] != features_out:
        raise AdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's "
                           f"{features_in} -> {features_out} projection (expected [{rank}, {features_in}] and "
                           f"[{features_out}, {rank}])")
    return a.float(), b.float()
