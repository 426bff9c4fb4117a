"""W8A8 on CPU: put each part's int8 weights on the GEMM `pipeline.model.cpu_kernels` names for this CPU
(`torch._int_mm` on the plain weights, oneDNN's GEMM on weights packed once, `kernels.packed_int8`, or our
own VNNI GEMM on weights packed into its panels, `kernels.vnni_gemm`), timing them on the model where the
CPU's features leave more than one (AMX). All three give the same bits (`kernels.dispatch.int8_products`):
the choice moves speed only, never a token.

What is timed: the part's W8A8 weights once each (of the layers, the first TIMED_LAYERS'), at TIMED_ROWS
rows of random int8 activations, as a step runs them (the weights streaming one after another, not one
layer's in cache); the layers and the head apart, as the winners differ (an AVX-512 VNNI Xeon ran the layers
faster on `torch._int_mm`, the head on the packed GEMM).

Before a packed GEMM is timed or, where the features name it alone, used, a few calls on a slice of one
weight check it: its products against the exact sums, bit for bit (a kernel that saturates is refused;
`kernels.packed_int8.weight_bound` keeps the weights within what it multiplies exactly), and its speed
against `torch._int_mm`'s, to screen out a fallback kernel: on a Zen 4 (AVX-512 VNNI, no AMX) oneDNN packed
the weight but multiplied it with `ref_int8`, 1,300x slower than `torch._int_mm`, and the full timing of it
took 9 minutes of the load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.dispatch import as_products, int8_outputs
from kernels.packed_int8 import (
    pack_int8_weight,
    pack_native_int8_weight,
    packed_gemm_name,
    release_packed,
    uint8_activations,
)
from pipeline.model.cpu_kernels import NATIVE, PACKED, PLAIN, CpuFeatures, GemmRule, int8_gemm_rule
from pipeline.model.native_decode import native_model_reason
from pipeline.model.quant import QuantLinear, QuantLMHead
from pipeline.stopwatch import alternating_best, best_seconds

TIMED_ROWS = 128  # a compute-bound batch, where W8A8 runs
# Layers whose weights are timed: more than the caches near a core hold (SmolLM2's first 4: 14 MB of int8),
# so they stream as in a step, and few enough that a large model's load holds two copies of little of it.
TIMED_LAYERS = 4
ROUNDS = 3  # alternating rounds; each GEMM's figure is the median of its rounds' best
REPS = 2
PACKERS = {PACKED: pack_int8_weight, NATIVE: pack_native_int8_weight}
# The layers take the native GEMM where it times within this of the fastest, where the model could run its
# decoder layers natively (`native_model_reason`): only on it do they run in one native call (`pipeline.model.native_decode`), which saves more of a step than this (a 1B-shaped
# model's 64-row step: 111 ms native against 122.5 ms compiled on oneDNN), and timings this close flipped
# between starts on a 2-core machine.
NATIVE_LAYERS_MARGIN = 0.1
SCREEN_CHANNELS = 256  # output channels of the weight slice the screening call runs on
# A packed call this many times slower than the plain one on the slice is a fallback kernel (the reference
# kernel ran ~1,300x slower on a Zen 4), not a tuned one losing by a margin
SCREEN_FACTOR = 10.0
SCREEN_REPS = 3


def int8_parts(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The modules whose W8A8 calls run an int8 GEMM on CPU, by part: "layers" (the decoder's linears) and
    "lm_head" (an int8 head); a part with none is left out."""
    parts: dict[str, list[nn.Module]] = {}
    linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.w8a8_scales is not None]
    if linears:
        parts["layers"] = linears
    if isinstance(model.lm_head, QuantLMHead) and model.lm_head.mode == "int8":
        parts["lm_head"] = [model.lm_head]
    return parts


def cpu_features() -> CpuFeatures:
    """This machine's (a seam for tests that stand in for another CPU)."""
    return CpuFeatures.here()


def choose_int8_gemm(model: nn.Module, known: dict[str, str] | None = None) -> dict[str, str]:
    """Put each W8A8 part (`int8_parts`) on the GEMM `int8_gemm_rule` names for this CPU, or the fastest of
    those it names, timed on the part's own weights (of the layers, the first TIMED_LAYERS'), packing the
    weights (the plain int8 copies freed) for a packed GEMM, and return {part: the GEMM, and why: the
    figures, or the rule, and any GEMM left out}. A part in `known` (this function's answer for the same
    model on the same CPU, kept by the startup cache) takes the GEMM named there untimed, where the rule
    allows it."""
    features, chosen = cpu_features(), {}
    with torch.inference_mode():
        for part, modules in int8_parts(model).items():
            rule = int8_gemm_rule(features, part)
            packed = next((m.int8_layout[2] for m in modules if m.int8_layout[2] is not None), None)
            named = gemm_named((known or {}).get(part, ""), rule)
            if named is not None:
                _use(modules, named)
                chosen[part] = known[part]
            elif packed is not None:
                chosen[part] = packed_gemm_name(packed)
            elif len(rule.gemms) == 1:
                chosen[part] = _named_by_rule(modules, rule)
            else:
                native_layers = part == "layers" and native_model_reason(model) is None
                chosen[part] = _fastest(_timed(model, part, modules), modules, rule, native_layers)
    return chosen


def gemm_named(description: str, rule: GemmRule) -> str | None:
    """The GEMM a `choose_int8_gemm` answer names (its first words), if `rule` (or the fallback, `torch._int_mm`)
    allows it."""
    return next((n for n in (PLAIN, *rule.gemms) if description.startswith(n)), None)


def _use(modules: list[nn.Module], name: str) -> None:
    """Pack the weights of the modules not packed yet for the GEMM `name` (`torch._int_mm`: none)."""
    if name != PLAIN:
        for m in modules:
            if m.int8_layout[2] is None:
                m.use_packed_int8(PACKERS[name](m, m.int8_layout[0]))


def _named_by_rule(modules: list[nn.Module], rule: GemmRule) -> str:
    """The one GEMM the rule names, where it passes the screening on the first module's weight; else
    `torch._int_mm`. Its answer as `choose_int8_gemm`'s."""
    name, notes = rule.gemms[0], [rule.why]
    if name != PLAIN:
        why_not = _screening(modules[0], name)
        if why_not:
            name = PLAIN
            notes.append(why_not)
    _use(modules, name)
    return f"{name} ({'; '.join(notes)})"


def _fastest(timed: list[nn.Module], modules: list[nn.Module], rule: GemmRule, native_layers: bool = False) -> str:
    """Time the rule's GEMMs that pass the screening on `timed` (of `modules`), keep the fastest (with
    `native_layers`, the layers of a model that could run natively, the native GEMM within
    NATIVE_LAYERS_MARGIN of it) and pack `modules` for it; its
    answer as `choose_int8_gemm`'s."""
    candidates, notes = {}, []
    for name in rule.gemms:
        if name != PLAIN:
            why_not = _screening(timed[0], name)  # a failing kernel shows here, before any timing
            if why_not:
                notes.append(why_not)
            else:
                candidates[name] = [PACKERS[name](m, m.int8_layout[0]) for m in timed]
    names = [PLAIN, *candidates]
    passes = [gemm_pass(timed, TIMED_ROWS, [(m.int8_layout[0], m.int8_layout[1], h) for m, h in zip(timed, handles)])
              for handles in [[None] * len(timed), *candidates.values()]]
    seconds = alternating_best(passes, ROUNDS, REPS) if candidates else [0.0]
    winner = names[min(range(len(names)), key=seconds.__getitem__)]
    if native_layers and NATIVE in candidates and winner != NATIVE \
            and seconds[names.index(NATIVE)] <= (1 + NATIVE_LAYERS_MARGIN) * min(seconds):
        winner = NATIVE
        notes.append(f"{NATIVE} within {NATIVE_LAYERS_MARGIN:.0%} of the fastest: the decoder layers run natively on it")
    for name, handles in candidates.items():
        if name == winner:
            for m, handle in zip(timed, handles):
                m.use_packed_int8(handle)
        else:
            for handle in handles:
                release_packed(handle)
    _use(modules, winner)
    if candidates:
        notes.insert(0, ", ".join(f"{t * 1e3:.2f} ms {name}" for name, t in zip(names, seconds)) +
                     f" for {len(timed)} of its {len(modules)} weights at {TIMED_ROWS} rows")
    return f"{winner} ({'; '.join([*notes, *([rule.why] if rule.why else [])])})"


def _screening(module: nn.Module, name: str) -> str | None:
    """Why the packed GEMM `name` is not used on these weights (`_screened_out`, or it cannot pack them), or
    None."""
    try:
        return _screened_out(module, TIMED_ROWS, name)
    except RuntimeError as e:
        return f"no {name} GEMM here: {str(e).splitlines()[0]}"


def _screened_out(module: nn.Module, rows: int, name: str) -> str | None:
    """The fastest of SCREEN_REPS calls of each GEMM (after a warm-up call), `torch._int_mm` and the packed
    GEMM `name`, on the first SCREEN_CHANNELS output channels of the module's weight: why the packed GEMM is
    not worth timing in full (products not those of the exact sums, or a fallback kernel, SCREEN_FACTOR
    times slower or more), or None. Raises RuntimeError where it cannot pack or run the weight."""
    weight, scales, _ = module.int8_layout
    piece, piece_scales = weight[:SCREEN_CHANNELS], scales[:SCREEN_CHANNELS]
    handle = PACKERS[name](piece, piece)
    try:
        q = torch.randint(-127, 128, (rows, piece.shape[1]), dtype=torch.int8)
        # best of 3: one call preempted on a busy machine must not read as a fallback kernel
        packed_s = best_seconds(lambda: int8_outputs(q, None, piece_scales, handle), reps=SCREEN_REPS)
        plain_s = best_seconds(lambda: int8_outputs(q, piece, piece_scales), reps=SCREEN_REPS)
        exact = torch.equal(int8_outputs(q, None, piece_scales, handle),
                            as_products(int8_outputs(q, piece, piece_scales), piece_scales.reshape(1, -1)))
    finally:
        release_packed(handle)
    if not exact:
        return f"{name}'s products differ from {PLAIN}'s exact sums on one weight's slice: not used"
    if packed_s < SCREEN_FACTOR * plain_s:
        return None
    return (f"{packed_s * 1e3:.2f} ms {name} vs {plain_s * 1e3:.3f} {PLAIN} for {piece.shape[0]} channels of one "
            f"weight at {rows} rows: a fallback kernel, not timed further")


def _timed(model: nn.Module, part: str, modules: list[nn.Module]) -> list[nn.Module]:
    """The modules of a part that are timed: of the layers, those of the first TIMED_LAYERS."""
    if part != "layers":
        return modules
    first = {id(m) for layer in model.layers[:TIMED_LAYERS] for m in layer.modules()}
    return [m for m in modules if id(m) in first]


def gemm_pass(modules: list[nn.Module], rows: int,
              layouts: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]]) -> Callable[[], None]:
    """One pass of the modules' int8 GEMMs (`kernels.dispatch.int8_outputs`: without the elementwise work
    that compiled steps fuse into their own loops) at `rows` rows of random int8 activations, module i on
    layouts[i] (its `int8_layout`, or the plain or packed one to be timed)."""
    inputs = {m.in_features: torch.randint(-127, 128, (rows, m.in_features), dtype=torch.int8) for m in modules}
    # a packed weight's activations as steps pass them: already uint8 (`kernels.dispatch.quantize_for_gemm`)
    calls = [(inputs[m.in_features] if layout[2] is None else uint8_activations(inputs[m.in_features]), layout)
             for m, layout in zip(modules, layouts, strict=True)]

    def run() -> None:
        for q, layout in calls:
            int8_outputs(q, *layout)

    return run
