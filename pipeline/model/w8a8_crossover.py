"""`model.quant=auto` on CPU: from how many rows W8A8 beats the weight-only kernels, timed on the model itself.

The roofline (`pipeline.model.quant_choice`) places each batch size in its regime from the probe's peaks, but
at small batches neither kernel runs near its roofline, and by how much each misses differs from CPU to CPU.
On a Zen 5 the roofline put SmolLM2's crossing at 6 rows, while a batch-1 job decoded 50-52 tok/s on the
packed Q4_1 kernels and 82-93 in W8A8. So where auto loaded both layouts, it times both on the loaded model
and switches where they cross.

What is timed: the first TIMED_LAYERS decoder layers' products (qkv, o, gate_up, down), and the LM head
apart, as each kind of step runs them (weight-only steps: the packed bf16 kernels and the float LM head;
W8A8 steps: the int8 GEMM each layout runs on, `pipeline.model.w8a8_gemm`, and the W8A8 head), at 1, 2,
4 ... rows. Where the linears also have the native W4A8 layout (`kernels.cpu_w4a8`), weight-only steps are
timed on it too, and it runs the weight-only steps below the first size at which it is not the faster of
the two; that weight-only step is then the one compared with W8A8. A step costs about num_layers /
TIMED_LAYERS x the timed layers plus the head: distinct layers, so their weights stream from memory as in a
step, not one layer's from cache num_layers times (which also took num_layers / TIMED_LAYERS times as long:
the 1B shape's timing ~12 s of a busy first start). The elementwise work around the products (activation
quantization, casts) is left out: compiled layers fuse it into the loops both kinds of step have anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kernels.cpu_w4a8 import w4a8_matmul
from kernels.dispatch import int8_outputs, packed_matmul, quantize_for_gemm, wq_matmul
from pipeline.model.quant import (
    QuantLinear,
    QuantLMHead,
    drop_weight_only_layouts,
    pack_torch_int4_where_read,
)
from pipeline.model.quant_choice import QuantChoice
from pipeline.stopwatch import alternating_best

# Row counts timed: 1, 2, 4 ... up to this. Larger batches are compute-bound, where the roofline's peaks
# decide reliably (SmolLM2 on 2 cores: ~1.5 s for sizes up to 32, 5-6 s up to 64 with 5 rounds of 3).
MAX_TIMED_ROWS = 32
TIMED_LAYERS = 4  # distinct decoder layers timed; their figure is scaled to the model's num_layers
ROUNDS = 3  # alternating rounds per row count; each kernel's figure is the median of its rounds' best
REPS = 2
# Weight-only steps run only where they are this much faster than W8A8: each kind of step needs compiled
# graphs of its own (SmolLM2 on 2 cores: ~10-15 s more of the first start) and its layout in memory, and
# at 1-4 rows the two are often within the timing noise of a 2-core machine (runs flipped between them).
WEIGHT_ONLY_MARGIN = 0.1
# ... and that much more at each doubling of the rows, up to this: every row count more that runs weight-only
# is compiled graphs more. Over nine first starts of the 1B shape on 2 cores (load 0.8-3.2), its 4-row
# weight-only steps timed up to 1.19x faster than W8A8 and its 2-row ones 1.26-1.60x (but on the busiest
# start, where W8A8 won both); a flat 10% put three of them at W8A8 from 8 rows, whose jobs spent 21.0-24.0 s
# in torch.compile against 5.6-7.2 s from 4 rows (once 23.2).
MAX_WEIGHT_ONLY_MARGIN = 0.3


@dataclass(frozen=True)
class Crossover:
    """The measured crossing: W8A8 from `w8a8_rows` rows (None: never, within the sizes timed), and the
    estimated step seconds of each kind, by rows: {rows: (weight-only, w8a8)}, the weight-only step on the
    kernel it runs on. Where the native W4A8 GEMM was timed: its step seconds by rows (`w4a8_seconds`,
    against torch's int4 kernel's, `torch_seconds`) and below how many rows it runs (`w4a8_below`: the
    first size timed where it was not faster; None: not at 1 row)."""

    w8a8_rows: int | None
    step_seconds: dict[int, tuple[float, float]]
    w4a8_seconds: dict[int, tuple[float, float]] = field(default_factory=dict)  # {rows: (torch, w4a8)}
    w4a8_below: int | None = None

    def as_json(self) -> dict:
        return {"w8a8_rows": self.w8a8_rows, "step_seconds": [[r, *s] for r, s in self.step_seconds.items()],
                "w4a8_seconds": [[r, *s] for r, s in self.w4a8_seconds.items()], "w4a8_below": self.w4a8_below}

    @classmethod
    def from_json(cls, value: dict) -> Crossover:
        return cls(value["w8a8_rows"], {int(r): (wo, w8) for r, wo, w8 in value["step_seconds"]},
                   {int(r): (t, w4) for r, t, w4 in value["w4a8_seconds"]}, value["w4a8_below"])

    def describe(self) -> str:
        figures = ", ".join(f"{rows}: {wo * 1e3:.2f} vs {w8 * 1e3:.2f}" for rows, (wo, w8) in self.step_seconds.items())
        where = "never" if self.w8a8_rows is None else f"from {self.w8a8_rows} rows"
        text = f"measured W8A8 {where} (products per step, ms, weight-only vs W8A8, by rows: {figures})"
        if self.w4a8_seconds:
            native = ", ".join(f"{rows}: {t * 1e3:.2f} vs {w4 * 1e3:.2f}" for rows, (t, w4) in self.w4a8_seconds.items())
            below = "never" if self.w4a8_below is None else f"below {self.w4a8_below} rows"
            text += f"; weight-only steps on the native W4A8 GEMM {below} (torch int4 vs W4A8: {native})"
        return text


def w4a8_limit(seconds: dict[int, tuple[float, float]]) -> int | None:
    """From {rows: (torch int4, W4A8) step seconds}: the first size at which W4A8 is not faster (every call
    of fewer rows runs it), the largest size + 1 where it always is, None where it loses at the first."""
    for rows in sorted(seconds):
        torch_s, w4a8_s = seconds[rows]
        if w4a8_s >= torch_s:
            return rows if rows > min(seconds) else None
    return max(seconds) + 1 if seconds else None


def crossing(step_seconds: dict[int, tuple[float, float]]) -> int | None:
    """The smallest row count from which W8A8 is at most `weight_only_margin` slower than weight-only at
    every larger size timed too; None if it is slower by more at the largest."""
    rows = None
    for r in sorted(step_seconds, reverse=True):
        weight_only, w8a8 = step_seconds[r]
        if w8a8 > weight_only * (1 + weight_only_margin(r)):
            break
        rows = r
    return rows


def weight_only_margin(rows: int) -> float:
    """By how much weight-only steps of `rows` rows must beat W8A8 to run: WEIGHT_ONLY_MARGIN at 1 row, that
    much more at each doubling, at most MAX_WEIGHT_ONLY_MARGIN."""
    return min(WEIGHT_ONLY_MARGIN * rows.bit_length(), MAX_WEIGHT_ONLY_MARGIN)


def rows_to_load(choice: QuantChoice, timed: bool) -> int | None:
    """The `w8a8_rows` auto loads its model with: the roofline's crossing; where the crossing will be timed,
    W8A8 attached in any case from 1 row until `apply_measured_crossover` sets it: both layouts must be
    there, and the model's startup-cache key (which holds the value) must not follow the probe's figures. A
    warm start that probed again (the first start's probe timed on busy CPUs) moved the roofline's crossing,
    and with it the key: the 1B shape's model was built again, 38.9 s."""
    return 1 if timed else choice.w8a8_rows


def apply_measured_crossover(choice: QuantChoice, model: torch.nn.Module, max_batch: int,
                             measure: Callable[[torch.nn.Module, int], Crossover] | None = None,
                             ) -> tuple[QuantChoice, Crossover]:
    """Time auto's crossing on `model` (loaded with both layouts) up to min(max_batch, MAX_TIMED_ROWS) rows,
    switch the model's kernel choice there (from 1 row: W8A8 throughout, the weight-only layouts freed),
    and return `choice` updated (its reason extended with the figures) and the measurement. Where W8A8 does
    not win at the largest size timed, the roofline's crossing stands if it lies beyond the sizes timed,
    else weight-only at every batch. `measure` (default `measure_crossover`) may answer from an earlier
    start's measurement (the startup cache)."""
    crossover = (measure or measure_crossover)(model, min(max_batch, MAX_TIMED_ROWS))
    rows = crossover.w8a8_rows
    if rows is None and choice.w8a8_rows is not None and choice.w8a8_rows > max(crossover.step_seconds):
        rows = choice.w8a8_rows
    reason = f"{choice.reason}; {crossover.describe()}"
    if rows == 1:  # every step W8A8: the weight-only layouts would only hold memory
        reason += f"; weight-only layouts freed ({drop_weight_only_layouts(model) / 2**20:.0f} MiB)"
    else:
        model.kernel_choice.w8a8_rows = rows
        model.kernel_choice.w4a8_below = crossover.w4a8_below
        pack_torch_int4_where_read(model)  # made for the timed layers only, until a call reads it
        freed = drop_unused_int4_layouts(model)
        if freed:
            reason += f"; {freed / 2**20:.0f} MiB of int4 layouts no step runs freed"
    return replace(choice, w8a8_rows=rows, reason=reason), crossover


def drop_unused_int4_layouts(model: torch.nn.Module) -> int:
    """Free the int4 layout no weight-only call reads after the choice: the native W4A8 one where it never
    runs, torch's where the W4A8 GEMM runs every weight-only call (below the W8A8 switch); the bytes freed."""
    choice, freed = model.kernel_choice, 0
    below, w8a8_rows = choice.w4a8_below, choice.w8a8_rows
    names = (("w4a8_packed",) if below is None
             else ("packed_weight", "packed_scales") if w8a8_rows is not None and below >= w8a8_rows else ())
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.w4a8_packed is not None:
            for name in names:
                buffer = getattr(m, name)
                freed += buffer.numel() * buffer.element_size() if buffer is not None else 0
                setattr(m, name, None)
    return freed


def settled(step_seconds: dict[int, tuple[float, float]]) -> bool:
    """Whether W8A8 was no slower than weight-only at the two largest sizes timed so far: larger steps are
    not timed then. A weight-only step's products grow with its rows (each row streams the dequantized
    weights through the vector units) while W8A8's stay near flat up to the tens of rows, so the larger
    sizes would only confirm the crossing, and they are the costliest to time (the 1B shape's 32-row
    weight-only step took as long as its 1-8-row ones together)."""
    largest = sorted(step_seconds)[-2:]
    return len(largest) == 2 and all(step_seconds[r][1] <= step_seconds[r][0] for r in largest)


def measure_crossover(model: torch.nn.Module, max_rows: int) -> Crossover:
    """Time both kinds of step's products on `model` (quantized with both layouts, W8A8 attached) at 1, 2,
    4 ... `max_rows` rows, alternating, until `settled`, and return where W8A8 starts to win."""
    layers = model.layers[:TIMED_LAYERS]
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, QuantLinear)]
    if not linears or any(m.w8a8_scales is None for m in linears) or not isinstance(model.lm_head, QuantLMHead):
        raise ValueError("measure_crossover needs a weight-only quantized model with its W8A8 layouts attached")
    sizes = [1 << i for i in range(max(1, max_rows).bit_length()) if 1 << i <= max_rows]
    native = all(m.w4a8_packed is not None for m in linears)
    for m in linears:  # torch's int4 layout, timed against W4A8's, where the load left it out
        m.pack_torch_int4()
    scale = model.config.num_layers / len(layers)
    seconds: dict[int, tuple[float, float]] = {}
    w4a8: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for rows in sizes:
            compact = model.kernel_choice.head_uses_compact(rows)
            calls = [_weight_only_layers(linears, rows, False), _w8a8_layers(linears, rows),
                     _head_call(model, rows, True)]
            if native:
                calls.append(_weight_only_layers(linears, rows, True))
            if not compact:
                calls.append(_head_call(model, rows, False))
            timed = alternating_best(calls, ROUNDS, REPS)
            weight_only_head = timed[2] if compact else timed[-1]
            seconds[rows] = (timed[0] * scale + weight_only_head, timed[1] * scale + timed[2])
            if native:
                w4a8[rows] = (seconds[rows][0], timed[3] * scale + weight_only_head)
            if settled(_on_kernels(seconds, w4a8)):
                break
    below = w4a8_limit(w4a8)
    seconds = _on_kernels(seconds, w4a8)
    return Crossover(crossing(seconds), seconds, w4a8, below)


def _on_kernels(seconds: dict[int, tuple[float, float]],
                w4a8: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """{rows: (weight-only, W8A8)} with each weight-only step on the kernel it runs on: W4A8 below
    `w4a8_limit`, torch's int4 kernel from there."""
    below = w4a8_limit(w4a8)
    if below is None:
        return seconds
    return {r: (w4a8[r][1] if r < below else wo, w8) for r, (wo, w8) in seconds.items()}


def _weight_only_layers(linears: list[QuantLinear], rows: int, w4a8: bool) -> Callable[[], None]:
    """The timed layers' products at `rows` rows as weight-only steps run them (on the native W4A8 GEMM
    with `w4a8`)."""
    inputs = [torch.randn(rows, m.in_features) for m in linears]
    packed = [m.cpu_packed for m in linears]  # built once: the property makes a new one per read

    def run() -> None:
        for m, p, x in zip(linears, packed, inputs):
            if w4a8:
                w4a8_matmul(x, m.w4a8_packed, m.out_features)
            elif p is not None:
                packed_matmul(x, p)
            else:
                wq_matmul(x, m.qweight, m.scales, m.mins, m.bits)

    return run


def _w8a8_layers(linears: list[QuantLinear], rows: int) -> Callable[[], None]:
    """The timed layers' products at `rows` rows as W8A8 steps run them: int8 x int8 on the GEMM each
    weight runs on (`pipeline.model.w8a8_gemm`)."""
    calls = [(quantize_for_gemm(torch.randn(rows, m.in_features), m.int8_layout[2])[0], m.int8_layout)
             for m in linears]

    def run() -> None:
        for q, layout in calls:
            int8_outputs(q, *layout)

    return run


def _head_call(model: torch.nn.Module, rows: int, compact: bool) -> Callable[[], None]:
    """The LM head's product at `rows` rows: its compact copy's (int8 or bf16) with `compact`, else the
    float weight's."""
    head = model.lm_head
    if not compact:
        hidden = torch.randn(rows, model.config.hidden_size, dtype=model.dtype)
        return lambda: torch.nn.functional.linear(hidden, head.weight)
    if head.mode == "int8":
        q = quantize_for_gemm(torch.randn(rows, head.in_features), head.fast_packed)[0]
        return lambda: int8_outputs(q, *head.int8_layout)
    x = torch.randn(rows, head.in_features, dtype=head.fast_weight.dtype)
    return lambda: torch.nn.functional.linear(x, head.fast_weight)
