"""Which CPU kernels run here: each W8A8 part's int8 GEMM, the decoder layers' path and the greedy LM head,
from the CPU's features and the loaded model, in one record (`CpuKernels`) that the job logs in one line at
start and keeps in `_metrics.json` (`model.cpu_kernels`).

The features choose the int8 GEMM wherever measurements put one ahead on every machine of a class (the
table in docs/quantization.md, "Which CPU kernels run"):
- AVX-512 VNNI without AMX: the native VNNI GEMM (`kernels.vnni_gemm`): 1.05-1.48x the faster of oneDNN's
  two at 1-256 rows on a Zen 4, and the native decoder layers need it. Without it (no C compiler,
  `PIPELINE_NATIVE` leaving out `gemm`), `torch._int_mm` for the layers and oneDNN's packed GEMM for the
  head: on an AVX-512 VNNI Xeon the packed GEMM ran the layers slower (81 against 64 ms) and the head
  faster (17.6 against 22.9).
- AVX2 without AVX-512 VNNI: oneDNN's packed GEMM; `torch._int_mm` runs a reference kernel there (~4
  against 125-320 GOP/s on a Zen 3).
- Neither: `torch._int_mm`.
With AMX the three are timed at load on the model's own weights (`pipeline.model.w8a8_gemm`): oneDNN's
GEMMs run on the tiles, and which is fastest depends on the shapes (SmolLM2's layers: oneDNN's packed GEMM
1.5x `torch._int_mm`; a 128-wide test model's LM head: the native GEMM).

Whatever a rule names, a packed GEMM is first tried on a slice of one weight (its products must be the
exact sums, and it must not be a fallback kernel); where it fails, `torch._int_mm` runs.

Weight-only steps (below the W8A8 switch) run torch's int4 kernel, or under model.quant=auto where the
native W4A8 GEMM runs here (`kernels.cpu_w4a8`: AVX-512 VNNI), that GEMM below the row count at which the
load timed it no longer faster (`pipeline.model.w8a8_crossover`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from kernels import cpu_w4a8, vnni_gemm
from kernels.argmax import ARGMAX_CHUNK
from kernels.native_build import cpu_identity, native_parts
from kernels.packed_int8 import OneDNNWeight, packed_weight
from kernels.vnni_gemm import NativeInt8Weight
from pipeline.model.native_decode import native_decode_reason, native_model_reason, weight_only_reason
from pipeline.model.quant import QuantLinear, QuantLMHead

PLAIN, PACKED, NATIVE = "torch._int_mm", OneDNNWeight.name, NativeInt8Weight.name
KERNEL_FLAGS = ("amx_int8", "avx512_vnni", "avx512f", "avx_vnni", "avx2")  # /proc/cpuinfo's names
AMX, VNNI, AVX2, OTHER = "AMX", "AVX-512 VNNI", "AVX2", "other"  # the classes of CPU the kernels differ by


@dataclass(frozen=True)
class CpuFeatures:
    """What chooses the CPU kernels: the CPU's flags (those of KERNEL_FLAGS) and why the native VNNI GEMM
    cannot run here (None: it can)."""

    flags: frozenset[str]
    native_gemm: str | None

    @classmethod
    def here(cls) -> CpuFeatures:
        return cls(frozenset(cpu_identity().split()) & set(KERNEL_FLAGS), vnni_gemm.unavailable_reason())

    @property
    def cpu_class(self) -> str:
        """AMX (amx_int8), AVX-512 VNNI (avx512_vnni, no AMX), AVX2 (avx2 without AVX-512 VNNI, AVX-VNNI or
        not) or other."""
        for cls, flag in ((AMX, "amx_int8"), (VNNI, "avx512_vnni"), (AVX2, "avx2")):
            if flag in self.flags:
                return cls
        return OTHER


@dataclass(frozen=True)
class GemmRule:
    """The int8 GEMMs a part may run on: one where the features decide (and why), several where they are
    timed at load (and which GEMM is left out, and why)."""

    gemms: tuple[str, ...]
    why: str


def int8_gemm_rule(features: CpuFeatures, part: str) -> GemmRule:
    """The GEMMs a W8A8 part ("layers" or "lm_head") may run on with these features (the module's table)."""
    cls, no_native = features.cpu_class, features.native_gemm
    if cls == AMX:  # timed: `why` names what is left out
        if no_native:
            return GemmRule((PLAIN, PACKED), f"no {NATIVE} GEMM here: {no_native}")
        return GemmRule((PLAIN, PACKED, NATIVE), "")
    if cls == VNNI and not no_native:
        return GemmRule((NATIVE,), "AVX-512 VNNI without AMX")
    if cls == VNNI:
        return GemmRule((PLAIN,) if part == "layers" else (PACKED,),
                        f"AVX-512 VNNI without AMX, no {NATIVE} GEMM here: {no_native}")
    if cls == AVX2:
        return GemmRule((PACKED,), f"AVX2 without AVX-512 VNNI: {PLAIN} is a reference kernel there")
    return GemmRule((PLAIN,), "no AVX2")


@dataclass(frozen=True)
class CpuKernels:
    """Which CPU kernels a loaded model runs (`cpu_kernels`): a snapshot logged at start and kept in
    `_metrics.json`."""

    cpu: str  # the kernel table's row: CpuFeatures.cpu_class
    flags: list[str]  # the CPU's flags of KERNEL_FLAGS
    native: list[str]  # the native kernels PIPELINE_NATIVE keeps
    int8_gemm: dict[str, str]  # per W8A8 part: its GEMM and how it was chosen (`pipeline.model.w8a8_gemm`)
    weight_bound: int | None  # the W8A8 weights' largest |int8|
    decoder_layers: str  # native, compiled or eager, and why
    greedy_head: str  # how greedy steps take the LM head's argmax
    weight_only: str  # the weight-only steps' kernel: the native W4A8 GEMM below some rows, or torch's, and why

    def line(self) -> str:
        gemms = "; ".join(f"int8 GEMM {part}: {gemm}" for part, gemm in self.int8_gemm.items()) or "no int8 GEMM"
        bound = "" if self.weight_bound is None else f"; weights within +-{self.weight_bound}"
        return (f"{self.cpu} ({' '.join(self.flags) or 'no kernel flags'}; native kernels: "
                f"{','.join(self.native) or 'off'}): {gemms}{bound}; decoder layers: {self.decoder_layers}; "
                f"greedy head: {self.greedy_head}; weight-only steps: {self.weight_only}")

    def as_dict(self) -> dict:
        return asdict(self)


def cpu_kernels(model: nn.Module, features: CpuFeatures) -> CpuKernels:
    """The kernels `model` (a loaded `pipeline.model.llama.LlamaModel` on CPU, its engine made) runs here."""
    choice = model.kernel_choice
    return CpuKernels(features.cpu_class, sorted(features.flags), list(native_parts()),
                      dict(choice.int8_gemm) if choice else {}, choice.weight_bound if choice else None,
                      decoder_layers(model), greedy_head(model), weight_only_kernel(model))


def decoder_layers(model: nn.Module) -> str:
    """Which steps run native (W8A8 and weight-only ones, where the attention runs every row natively; and the
    arithmetic of their LoRA deltas), compiled or eager, and why not native."""
    torch_path = "compiled" if model.compiled else "eager"
    layers = model.native_layers
    if layers is None:
        why = native_model_reason(model) or native_decode_reason(model)
        return f"{torch_path} (not native: {why})"
    reasons = {"W8A8": native_decode_reason(model), "weight-only": weight_only_reason(model)}
    native = [kind for kind, why in reasons.items() if why is None]
    not_native = "; ".join(f"{kind}: {why}" for kind, why in reasons.items() if why is not None)
    if not native:
        return f"{torch_path} (not native: {not_native})"
    deltas = "AMX bfloat16 tiles" if layers.lora_tiles else "AVX-512 BF16 dot products" if layers.lora_bf16 \
        else "float32"
    text = f"native in {' and '.join(native)} steps, else {torch_path} (LoRA deltas in W8A8 steps: {deltas}"
    return text + (f"; not native in {not_native})" if not_native else ")")


def weight_only_kernel(model: nn.Module) -> str:
    """Which kernel the weight-only steps' int4 linears run: the native W4A8 GEMM below `w4a8_below` rows
    (where the linears have its layout), else torch's (and why not W4A8); "none" where every step is W8A8."""
    choice = model.kernel_choice
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not linears or (choice is not None and not choice.weight_only):
        return "none (float weights, or every step W8A8)"
    has_layout = any(m.w4a8_packed is not None for m in linears)
    if has_layout and choice is not None and choice.w4a8_below is not None:
        return f"native W4A8 below {choice.w4a8_below} rows, else torch's"
    why = (cpu_w4a8.unavailable_reason() or ("not faster at 1 row" if has_layout else "no W4A8 layout loaded"))
    return f"torch's (not W4A8: {why})"


def greedy_head(model: nn.Module) -> str:
    """How greedy steps take the argmax of the logits (`QuantLMHead.greedy`): in the native GEMM's pass, from
    the int8 GEMM's outputs' chunk maxima, or over the logits."""
    head = model.lm_head
    if not isinstance(head, QuantLMHead) or head.mode != "int8" or head.tp.size > 1 \
            or head.vocab_size < 2 * ARGMAX_CHUNK:
        return "argmax of the logits"
    if head.fast_packed is not None and isinstance(packed_weight(head.fast_packed), NativeInt8Weight):
        return f"in the {NATIVE} GEMM's pass (W8A8 steps)"
    return "chunk maxima of the int8 GEMM's outputs (W8A8 steps)"
