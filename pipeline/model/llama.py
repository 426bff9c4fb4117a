"""The decoder every supported family shares (Llama layout), over a flat batch of tokens.

Where families differ the difference is a `ModelConfig` field read here: q/k/v biases (Qwen2), q/k
RMSNorm (Qwen3), a sliding window (Mistral; applied by the attention backend). See
`pipeline.model.families` for how a family is declared.

`forward(input_ids [T], positions [T], attn)` returns hidden states [T, H]; `compute_logits` turns the
rows that need sampling into logits. Sequences, caches and batching belong to the attention backend
(`pipeline.model.attention`) and the engine, not to the model.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.attention import AttentionBackend, attend, bound_backend
from pipeline.model.collectives import SINGLE, TPGroup
from pipeline.model.config import ModelConfig
from pipeline.model.layers import (
    LMHead,
    ParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    apply_rope,
    compiled_copy,
)
from pipeline.model.lora.delta import LoraStep, bound_lora
from pipeline.model.lora.peft_file import Adapter
from pipeline.model.lora.table import LoraTable
from pipeline.model.native_decode import NativeDecodeLayers, native_decode_layers


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.layer = layer
        # a tensor, so one compiled layer graph serves every layer (an int would be a per-layer constant);
        # on the CPU whatever the model's device, so reading it never waits for a GPU
        self.register_buffer("layer_index", torch.tensor(layer, device="cpu"), persistent=False)
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        # this rank's q and k/v widths inside the fused qkv output
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = ParallelLinear(
            cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], 0, cfg.attention_bias, tp, dtype
        )
        self.o_proj = ParallelLinear(cfg.q_size, [cfg.hidden_size], 1, False, tp, dtype)
        if cfg.qk_norm:  # per head, so tensor parallelism needs nothing special
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, cos_sin)
        out = attend(q, k, v, self.layer_index)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = ParallelLinear(cfg.hidden_size, [i, i], 0, cfg.mlp_bias, tp, dtype)
        self.down_proj = ParallelLinear(i, [cfg.hidden_size], 1, cfg.mlp_bias, tp, dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, dtype)

    def forward(self, x, cos_sin):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend will call ($CXX or g++), if it is installed."""
    return shutil.which(os.environ.get("CXX") or "g++")


def _run_layers(
    layers: tuple[DecoderLayer, ...], x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """A run of decoder layers: a plain function of the modules, so one compiled graph serves every run of
    the same length (their weights are the graph's inputs, not constants)."""
    for layer in layers:
        x = layer(x, cos_sin)
    return x


# Decoder layers per compiled graph. Each graph call costs ~0.3 ms on CPU (guards, wrappers) whatever it
# runs; 6 layers per call made a batch-128 SmolLM2 step ~4-9% faster than one layer per call (10 or 15 were
# no faster and compiled 4-8x longer: bench figures in docs/performance.md).
LAYERS_PER_GRAPH = 6


def layer_runs(layers: list[DecoderLayer], per_run: int) -> list[tuple[DecoderLayer, ...]]:
    """`layers` cut into consecutive runs of near-equal length, at most `per_run` each: at most two
    lengths, so at most two graphs to compile."""
    count = -(-len(layers) // per_run)
    bounds = [len(layers) * i // count for i in range(count + 1)]
    return [tuple(layers[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


# Checkpoint names (Hugging Face convention) of the parts fused into one module, with their part index.
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg.check_tensor_parallel(tp.size)
        self.config = cfg
        self.tp = tp
        self.dtype = dtype
        self.kv_dtype = dtype  # the KV cache's (load_model's kv_dtype): may be narrower than the activations
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings and tp.size == 1:
            # One tensor for both: the unsharded head is exactly the embedding table (under TP each rank's
            # head holds only its vocabulary slice, a copy loaded from the table).
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.scale = cfg.head_dim**-0.5
        # Set by pipeline.model.quant.attach_w8a8: picks each step's matmul kernel and counts its steps.
        self.kernel_choice = None
        self.run_layers = _run_layers  # or its compiled form (`compile_layers`)
        # W8A8 steps' layers in one native call where the model and step allow (set by `use_native_layers`)
        self.native_layers: NativeDecodeLayers | None = None
        self.layer_runs = [tuple(self.layers)]  # cut into shorter runs when compiled
        self.lora: LoraTable | None = None  # resident LoRA adapters (`enable_lora`)

    @property
    def compiled(self) -> bool:
        return self.run_layers is not _run_layers

    def compile_layers(self, per_graph: int = LAYERS_PER_GRAPH) -> None:
        """Run the decoder layers through `torch.compile`d graphs (dynamic token count), `per_graph` layers
        per call.

        What it buys on CPU: the norms, RoPE, SiLU, W8A8 activation quantization and scale epilogues of a
        layer fuse into a few generated loops instead of ~40 separate passes over the activations. The
        fused reductions may round differently from the eager ones (float32 last bits), so the exact path
        stays eager. Attention is the opaque `pipeline::attend` operator; the first steps of each new
        shape class (one token, many) pay the compilation: ~25 s for SmolLM2 on 2 cores, less once torch's
        on-disk graph cache holds it.
        """
        if self.tp.size > 1:
            raise ValueError("compiled layers need tensor_parallel=1 (collectives are not traced)")
        if cpp_compiler() is None:
            raise RuntimeError("compiled layers need a C++ compiler for torch.compile on CPU (g++, or $CXX): "
                               "install one (Debian: apt-get install g++) or set engine.compile=off")
        self.run_layers = compiled_copy(_run_layers, dynamic=True)
        self.layer_runs = layer_runs(list(self.layers), per_graph)
        # the head too: a W8A8 head's column split, activation quantization and int32 -> float scaling fuse
        # into two loops around the GEMM (eager, the scaling alone passes over [rows, vocab] three times)
        self.lm_head.compile(dynamic=True)

    def enable_lora(self, slots: int) -> LoraTable:
        """Room for `slots` resident LoRA adapters (`pipeline.model.lora.table`), made once."""
        if self.lora is None:
            self.lora = LoraTable(self, slots)
        return self.lora

    def load_adapter(self, slot: int, adapter: Adapter, slots: int) -> None:
        """Place `adapter` in `slot` of `slots` resident ones; the native layers pack it now (an adapter's
        first step then runs at once, and a load packs only its own slot)."""
        table = self.enable_lora(slots)
        table.load(slot, adapter)
        if self.native_layers is not None:
            self.native_layers.follow_lora(table)

    def use_native_layers(self) -> bool:
        """Run W8A8 steps' decoder layers in one native call (`pipeline.model.native_decode`) where this
        model can (else logged why not); returns whether it will."""
        self.native_layers = native_decode_layers(self)
        return self.native_layers is not None

    def lora_step(self, slots: torch.Tensor) -> LoraStep | None:
        """The LoRA deltas of a step whose token t runs the adapter in slot `slots[t]` (a host tensor, -1 or
        empty: the base model), or None when there are none (`pipeline.model.lora`)."""
        return None if self.lora is None or not slots.numel() else self.lora.step(slots)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                lora: LoraStep | None = None) -> torch.Tensor:
        """`lora`: the step's adapter deltas (`lora_step`): the native layers add them in their loops, the
        compiled graphs call the deltas' operator."""
        if self.kernel_choice is not None:
            self.kernel_choice.record(input_ids.shape[0])
        x = self.embed_tokens(input_ids)
        native_rows = getattr(attn, "native_rows", None)  # the paged attention's native kernel, if it has one
        if self.native_layers is None or native_rows is None \
                or not self.native_layers.run(x, positions, native_rows(), lora):
            cos_sin = self.rope(positions)
            with bound_backend(attn), bound_lora(lora):
                for run in self.layer_runs:
                    x = self.run_layers(run, x, cos_sin)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the given rows of hidden states."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of `compute_logits(hidden)` [N] (int64), without the logits where the head can."""
        return self.lm_head.greedy(hidden)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, full tensor) pairs in Hugging Face naming; each module keeps its own shard.

        Raises KeyError naming any checkpoint tensor the model does not know, and ValueError listing the
        model weights the checkpoint did not provide.
        """
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, full in tensors:
            name = name.removeprefix("model.")
            if name.startswith("lm_head."):
                if self.lm_head.weight is not self.embed_tokens.weight:  # tied and shared: the table wins
                    self.lm_head.load(full)
                seen.add("lm_head.weight")
                continue
            if name == "embed_tokens.weight":
                params[name].data.copy_(full)
                seen.add(name)
                if self.config.tie_word_embeddings:
                    if self.lm_head.weight is not self.embed_tokens.weight:
                        self.lm_head.load(full)
                    seen.add("lm_head.weight")
                continue
            module_path, _, leaf = name.rpartition(".")
            parent, _, short = module_path.rpartition(".")
            shard_id = 0
            if short in FUSED_PARTS:
                fused, shard_id = FUSED_PARTS[short]
                module_path = f"{parent}.{fused}"
            module = modules.get(module_path)
            if isinstance(module, ParallelLinear):
                module.load(full, shard_id, is_bias=leaf == "bias")
                seen.add(f"{module_path}.{leaf}")
            elif name in params:
                params[name].data.copy_(full)
                seen.add(name)
            else:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the {self.config.architecture} model")
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")
