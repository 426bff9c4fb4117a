"""Decoder layers of a CPU step in one native call (`kernels.cpu_decode_layers`), W8A8 or weight-only, where
the model and the step allow it; otherwise the model runs its layers as before (compiled graphs or eager).

Why: at 64 rows a compiled SmolLM2 step spent about a quarter of its main thread between kernels (graph
guards and wrappers, operator dispatch, the Python around each GEMM and attention call), while the second
core waited. The native run does the same arithmetic as the W8A8 layer, with the native GEMM and the native
paged attention called from C (figures in docs/performance.md).

What it takes: one rank, float32 activations, every layer the Llama layout (q/k/v biases as Qwen2's, no MLP
biases, no q/k norm), and a step whose every row the paged attention runs through its native kernel
(`NativeRows`). A W8A8 step needs the four linears on the native VNNI GEMM (chosen at load,
`pipeline.model.w8a8_gemm`); rows with a LoRA adapter run here too, the layers adding each linear's delta from
the model's `LoraTable` stacks. A weight-only step (model.quant=auto below its W8A8 switch) needs every
linear's int4 weight in the native W4A8 GEMM's layout (`kernels.cpu_w4a8`) and the step on that GEMM
(`KernelChoice.uses_w4a8`), and no adapter rows. Why the weight-only steps too: a step of one row of a
1B-shaped model spent ~30% of its time in the Python and graph glue between its GEMMs while the second core
waited (figures in docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kernels import cpu_decode_layers, cpu_w4a8, vnni_gemm
from kernels.cpu_attention import PagedDecodeKernel
from kernels.cpu_decode_layers import Layer, Linear, Step
from kernels.native_build import function_address
from kernels.packed_int8 import packed_weight
from kernels.vnni_gemm import NativeInt8Weight
from pipeline.model.lora.delta import LoraStep
from pipeline.model.lora.table import LoraTable
from pipeline.model.quant import QuantLinear


@dataclass
class NativeRows:
    """A step as the native layers read it from the paged attention: every token a row of the native
    kernel (`PagedAttention.native_rows`)."""

    kernel: PagedDecodeKernel
    slots: torch.Tensor  # [T] int64: where each token's key and value go
    tables: torch.Tensor  # [T, width] int64: each row's block table
    lens: torch.Tensor  # [T] int64: keys each row sees
    first: torch.Tensor  # [T] int64: each row's first key (a sliding window's start)
    scale: float  # the attention's softmax scale
    k_pools: list[torch.Tensor]  # per layer
    v_pools: list[torch.Tensor]
    k_scales: list[torch.Tensor] | None  # int8 pools' scales, per layer
    v_scales: list[torch.Tensor] | None
    spent: Callable[[float], None]  # takes the seconds spent in attention


def native_decode_reason(model: nn.Module) -> str | None:
    """Why `model` (a `pipeline.model.llama.LlamaModel`) cannot run its W8A8 steps' layers natively (None: it
    can)."""
    why = native_model_reason(model)
    if why:
        return why
    if model.kernel_choice.w8a8_rows is None:
        return "no step runs W8A8"
    for i, layer in enumerate(model.layers):
        for linear in _linears(layer):
            if not isinstance(linear, QuantLinear):
                return f"layer {i} has a linear that is not quantized"
            handle = linear.int8_layout[2]
            if handle is None or not isinstance(packed_weight(handle), NativeInt8Weight):
                return f"layer {i}'s linears do not run on the {NativeInt8Weight.name} GEMM"
    return None


def weight_only_reason(model: nn.Module) -> str | None:
    """Why `model` cannot run its weight-only steps' layers natively (None: it can, in steps of fewer than
    `KernelChoice.w4a8_below` rows without adapter rows)."""
    why = native_model_reason(model) or cpu_w4a8.unavailable_reason()
    if why:
        return why
    if model.kernel_choice.w4a8_below is None:
        return "its weight-only steps do not run the W4A8 GEMM"
    missing = _first_layer_without_w4a8(model)
    return None if missing is None else f"layer {missing} has a linear without the W4A8 layout"


def _first_layer_without_w4a8(model: nn.Module) -> int | None:
    """The first layer with a linear that lacks the W4A8 GEMM's int4 layout (None: every linear has it)."""
    for i, layer in enumerate(model.layers):
        if any(getattr(linear, "w4a8_packed", None) is None for linear in _linears(layer)):
            return i
    return None


def native_model_reason(model: nn.Module) -> str | None:
    """Why `model` could not run its layers natively whatever kernels its linears run on (None: it could, in
    the steps whose linears' kernels it calls)."""
    why = cpu_decode_layers.unavailable_reason()
    if why:
        return why
    if model.tp.size > 1 or model.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
        return "it needs one rank and float32 activations on CPU"
    if model.kernel_choice is None:
        return "its linears are not quantized (model.quant w8a8 or auto)"
    cfg = model.config
    if cfg.qk_norm or cfg.mlp_bias:
        return "the layers have q/k norms or MLP biases (the native layers are the Llama layer, q/k/v biases aside)"
    return None


def native_decode_layers(model: nn.Module) -> NativeDecodeLayers | None:
    """The native layers of `model`, or None where no step could run them: W8A8 steps need
    `native_decode_reason` None, weight-only ones every linear's W4A8 layout (whether those steps run the W4A8
    GEMM is settled after the load: `weight_only_reason`). The job logs which steps run them, and why not, with
    the other CPU kernels (`pipeline.model.cpu_kernels`)."""
    if native_model_reason(model):
        return None
    w4a8 = _first_layer_without_w4a8(model) is None
    return NativeDecodeLayers(model) if w4a8 or native_decode_reason(model) is None else None


def smoothed_a(a: torch.Tensor, smooth: torch.Tensor | None) -> torch.Tensor:
    """A^T stacked [slots, k, R] divided by the linear's smoothing vector [k] (None: A^T itself): the native
    layers project the input as they quantize it, smoothed (x A^T = (x smooth)(A^T / smooth)), so that no
    pass keeps a copy from before smoothing, and the fused gate_up + SiLU GEMM's smoothed activation serves
    the down projection's adapters."""
    return a if smooth is None else (a / smooth[:, None]).contiguous()


def column_ranks(b: torch.Tensor) -> torch.Tensor:
    """bool [slots, R, ceil(out / 16)]: whether each slot's B^T [slots, R, out] has a nonzero at a rank in each
    16 columns (a slot's part of `rank_bands`, kept so that loading one slot reads only its own B^T)."""
    used = b != 0
    return torch.nn.functional.pad(used, (0, -used.shape[2] % 16)).view(*used.shape[:2], -1, 16).any(-1)


def rank_bands(used: torch.Tensor) -> torch.Tensor:
    """int32 [ceil(out / 16), 2]: for each 16 columns of B^T, the ranks [lo, hi) outside which every slot's
    B^T is zero there (empty: [0, 0]), from `column_ranks`. A fused linear's B is block-diagonal (each part's
    columns take only its ranks: `pipeline.model.lora.table.linear_pair`), so its deltas skip half or more
    of the rank-space multiply-adds."""
    used = used.any(0)  # [R, V]
    ranks = torch.arange(used.shape[0])[:, None]
    hi = torch.where(used, ranks + 1, 0).amax(0)
    lo = torch.minimum(torch.where(used, ranks, used.shape[0]).amin(0), hi)
    return torch.stack([lo, hi], 1).to(torch.int32).contiguous()


class LoraStacks:
    """One linear's resident adapters as the native layers read them, made from the table's stacks `a` / `b`:
    A^T folded by the smoothing vector, B^T's bands, and (`bf16`) both as AMX's bfloat16 tiles (which AVX-512
    BF16's dot products read too). Refilled a slot at a time as adapters load, so that loading one adapter packs
    only its own pairs."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, smooth: torch.Tensor | None, bf16: bool):
        self.a, self.b, self.smooth = a, b, smooth  # the table's stacks, refilled in place slot by slot
        self.smoothed = smoothed_a(a, smooth)
        self.used = column_ranks(b)
        self.band = rank_bands(self.used)
        self.a16 = self.b16 = None
        if bf16:
            self.a16 = cpu_decode_layers.pack_tiles(self.smoothed, 32)
            b16 = cpu_decode_layers.pack_tiles(b, 16).flatten()
            self.b16 = torch.nn.functional.pad(b16, (0, 512))  # a tile's 512 zeros past the last slot's

    def refill(self, slot: int) -> None:
        """Pack slot `slot` again from the table's stacks (after a load placed a new adapter there)."""
        one = slice(slot, slot + 1)
        if self.smoothed is not self.a:
            self.smoothed[one] = smoothed_a(self.a[one], self.smooth)
        self.used[one] = column_ranks(self.b[one])
        self.band.copy_(rank_bands(self.used))
        if self.a16 is not None:
            self.a16[one] = cpu_decode_layers.pack_tiles(self.smoothed[one], 32)
            self.b16[:-512].view(self.a.shape[0], -1)[slot] = cpu_decode_layers.pack_tiles(self.b[one], 16).flatten()

    def point(self, linear: Linear) -> None:
        """Fill `linear`'s LoRA fields with these stacks' addresses."""
        linear.lora_a, linear.lora_b = _address(self.smoothed), _address(self.b)
        linear.lora_band, linear.lora_rank = self.band.data_ptr(), self.a.shape[2]
        linear.lora_a16 = None if self.a16 is None else self.a16.data_ptr()
        linear.lora_b16 = None if self.b16 is None else self.b16.data_ptr()


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _address(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous() or t.dtype != torch.float32:
        raise ValueError(f"the native layers read contiguous float32 vectors, got {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


def _linear(module: nn.Module, w8a8: bool) -> Linear:
    """The linear's fields a W8A8 step reads (`w8a8`; else its shape alone: `w4` is filled when a weight-only
    step first runs)."""
    bias = _address(module.bias)
    if not w8a8:
        return Linear(n=module.out_features, k=module.in_features, bias=bias)
    weight: NativeInt8Weight = packed_weight(module.int8_layout[2])
    return Linear(weight.panels.data_ptr(), weight.correction.data_ptr(), _address(module.w8a8_scales),
                  _address(module.w8a8_smooth), weight.out_features, weight.in_features, bias=bias)


class NativeDecodeLayers:
    """The model's layers as the native call reads them: W8A8 weights' addresses filled once (where its W8A8
    steps can run here: `w8a8`), the int4 ones at the first weight-only step (the layouts are settled by then:
    `pipeline.model.w8a8_crossover` frees those no step reads), the KV pools' when the attention's pools
    change, the rows' each step."""

    def __init__(self, model: nn.Module):
        cfg = model.config
        self.model = model
        self.w8a8 = native_decode_reason(model) is None
        self.layers = (Layer * len(model.layers))()
        for entry, layer in zip(self.layers, model.layers):
            entry.input_norm = _address(layer.input_layernorm.weight)
            entry.post_norm = _address(layer.post_attention_layernorm.weight)
            entry.qkv, entry.o, entry.gate_up, entry.down = (_linear(m, self.w8a8) for m in _linears(layer))
        self.shape = dict(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim, intermediate=cfg.intermediate_size)
        self.eps = model.layers[0].input_layernorm.eps
        self.gemm = self.gemm_silu = None
        if self.w8a8:
            self.gemm = function_address(vnni_gemm.library().int8_gemm_hooked)
            self.gemm_silu = function_address(vnni_gemm.library().int8_gemm_silu_hooked)
        self._w4: list[torch.Tensor] | None = None  # the int4 layouts the layers point at, once looked up
        self.gemm_w4: int | None = None  # the W4A8 GEMM's entry point, then
        self.weight_only: bool | None = None  # whether weight-only steps run here (None: not yet looked up)
        self._pools: list[torch.Tensor] | None = None  # the k pools whose addresses the layers hold
        self._lora_version = 0  # the LoRA table's loads whose adapters the layers' stacks hold
        self._lora_width = 0
        self._lora_stacks: dict[int, LoraStacks] = {}  # by linear's lora_id: what the layers point at
        self.lora_tiles = cpu_decode_layers.lora_tiles()  # the deltas on AMX's bfloat16 tiles
        self.lora_bf16 = self.lora_tiles or cpu_decode_layers.lora_dots()  # else AVX-512 BF16's dot products
        self._scratch = torch.empty(0)

    def run(self, x: torch.Tensor, positions: torch.Tensor, rows: NativeRows | None,
            lora: LoraStep | None = None) -> bool:
        """Run every layer over x [T, hidden] (the residual stream, updated in place) where this step can:
        every row native (`rows`), W8A8 at T rows with `lora`'s adapter deltas, or weight-only on the W4A8 GEMM
        without adapter rows. Returns whether it ran."""
        t, choice = x.shape[0], self.model.kernel_choice
        if rows is None or t == 0 or not x.is_contiguous():
            return False
        if choice.uses_w8a8(t):
            if not self.w8a8:
                return False
            gemm_w4 = None
        elif choice.uses_w4a8(t) and lora is None and self._weight_only_ready():
            gemm_w4 = self.gemm_w4
        else:
            return False
        if rows.k_pools is not self._pools:
            self._point_at(rows)
        cfg = self.shape
        rope = self.model.rope
        cos, sin = rope.cos[positions], rope.sin[positions]  # [T, head_dim / 2], contiguous
        step = Step(rows=t, eps=self.eps, attention_scale=rows.scale, cos=cos.data_ptr(), sin=sin.data_ptr(),
                    slots=rows.slots.data_ptr(), tables=rows.tables.data_ptr(), lens=rows.lens.data_ptr(),
                    first=rows.first.data_ptr(), table_stride=rows.tables.shape[1],
                    num_blocks=rows.k_pools[0].shape[1], gemm=self.gemm, gemm_silu=self.gemm_silu,
                    write=rows.kernel.write_address, decode=rows.kernel.decode_address, gemm_w4=gemm_w4, **cfg)
        slots = None if lora is None else self._lora_slots(lora, t)
        if slots is not None:
            step.lora_slots, step.lora_width, step.lora_tiles = slots.data_ptr(), self._lora_width, self.lora_tiles
        self._fill_scratch(step, t)
        rows.spent(cpu_decode_layers.decode_layers(self.layers, step, x.data_ptr()))
        self.model.kernel_choice.native_layer_steps += 1
        return True

    def _weight_only_ready(self) -> bool:
        """Whether weight-only steps run here (`weight_only_reason`), the layers pointed at the int4 layouts on
        the first ask (the tensors held: a layout freed later stays valid for them)."""
        if self.weight_only is None:
            self.weight_only = weight_only_reason(self.model) is None
            if self.weight_only:
                self.gemm_w4, self._w4 = cpu_w4a8.gemm_address(), []
                for linear, module in self._linear_pairs():
                    linear.w4 = module.w4a8_packed.data_ptr()
                    self._w4.append(module.w4a8_packed)
        return self.weight_only

    def _linear_pairs(self) -> Iterator[tuple[Linear, nn.Module]]:
        """Each linear's native entry (a view into `layers`: writes reach the native call) with its module."""
        for entry, layer in zip(self.layers, self.model.layers):
            yield from zip((entry.qkv, entry.o, entry.gate_up, entry.down), _linears(layer))

    def _point_at(self, rows: NativeRows) -> None:
        for i, entry in enumerate(self.layers):
            entry.k_pool, entry.v_pool = rows.k_pools[i].data_ptr(), rows.v_pools[i].data_ptr()
            if rows.k_scales is not None:
                entry.k_scale, entry.v_scale = rows.k_scales[i].data_ptr(), rows.v_scales[i].data_ptr()
        self._pools = rows.k_pools

    def _lora_slots(self, lora: LoraStep, t: int) -> torch.Tensor:
        """Each of the step's T rows' adapter slot (-1: base), the layers' LoRA stacks brought up to date."""
        self.follow_lora(self.model.lora)
        return torch.nn.functional.pad(lora.row_slots, (0, t - lora.row_slots.shape[0]), value=-1)

    def follow_lora(self, table: LoraTable) -> None:
        """Bring the layers' adapter stacks up to the table's loads: the slots loaded since are packed again,
        a linear whose stacks a load replaced (widened to a higher rank) is packed whole. The model calls this
        as each adapter loads, so that no step packs adapters. (Adapter rows run here only in W8A8 steps.)"""
        if table.version == self._lora_version or not self.w8a8:
            return
        loaded = set(table.loaded_slots[self._lora_version:])
        for linear, module in self._linear_pairs():
            a, b = table.a[module.lora_id], table.b[module.lora_id]
            stacks = self._lora_stacks.get(module.lora_id)
            if a is None:
                continue  # no slot's adapter has targeted this linear yet
            if stacks is None or stacks.a is not a:
                stacks = self._lora_stacks[module.lora_id] = LoraStacks(a, b, module.w8a8_smooth, self.lora_bf16)
            else:
                for slot in loaded:
                    stacks.refill(slot)
            stacks.point(linear)
        self._lora_width = max((a.shape[2] for a in table.a if a is not None), default=0)
        self._lora_version = table.version

    def _fill_scratch(self, step: Step, t: int) -> None:
        """Point the step's scratch buffers into one float32 allocation, kept and grown as steps need."""
        first = self.layers[0]
        widest = max(step.hidden, step.heads * step.head_dim, step.intermediate)
        sizes = {"tmp": t * widest, "qkv": t * first.qkv.n, "q": t * step.heads * step.head_dim,
                 "attn": t * step.heads * step.head_dim, "gate_up": t * first.gate_up.n, "proj": t * step.hidden,
                 "sx": t, "u": -(-t * widest // 4),  # u: uint8, in float32 units
                 "lora_t": t * step.lora_width,  # lora_x16: bfloat16, in float32 units
                 "lora_x16": -(-cpu_decode_layers.lora_x16_values(t, widest, step.lora_width) // 2) if self.lora_bf16 and step.lora_width else 0}
        total = sum(-(-n // 16) * 16 for n in sizes.values())  # each buffer 64-byte aligned
        if self._scratch.numel() < total:
            self._scratch = torch.empty(total, dtype=torch.float32)
        address = self._scratch.data_ptr()
        for name, n in sizes.items():
            setattr(step, name, address)
            address += -(-n // 16) * 16 * 4

