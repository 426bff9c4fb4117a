"""One calibration pass at load: what W8A8 needs to know of the activations, measured on a fixed text.

Per-token int8 activations lose the most where a few channels are much larger than the rest: the step of
every other channel follows them. Two remedies use the ranges measured here (`pipeline.model.quant`): the
linears' inputs are smoothed (SmoothQuant: channel j of the input divided by s_j, column j of the weight
multiplied by it), and the LM head's outlier channels are split over several int8 columns. Where int8
weights are held to 7 bits, they are rounded against the inputs' Gram matrices (`pipeline.model.gptq`).

The text is `calibration.txt` (prose, a dialogue, code, SQL, a recipe, a letter, three languages; ~750
tokens for SmolLM2, of which the first CALIBRATION_TOKENS are run): fixed, so a model loads to the same
weights every time. Ranges from random token ids smoothed
SmolLM2 about half as well as text did (perplexity +2.2% against +0.7-1.7% for three different texts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.wq_cpu import native_bf16
from pipeline.model.attention import WholeSequence

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
CALIBRATION_TOKENS = 512


@dataclass
class LinearInput:
    """What the calibration pass fed one linear: max |x| per input channel [K] and, when asked for, the
    Gram matrix X^T X [K, K] of its inputs (float32), which error-compensating rounding weighs errors by."""

    absmax: torch.Tensor
    gram: torch.Tensor | None
    # the float32 weight the pass multiplied by (`calibrate`'s `weights`): the visit's to overwrite, in a buffer
    # the next product reuses (a visit copies what it keeps)
    weight: torch.Tensor | None = None


def calibration_ids(tokenizer) -> list[int]:
    """The first CALIBRATION_TOKENS token ids of the calibration text."""
    return tokenizer.encode(CALIBRATION_TEXT.read_text())[:CALIBRATION_TOKENS]


def product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the pass multiplies activations `x` by a float weight in: bfloat16 on a CPU that computes
    it natively (AMX, AVX512-BF16), else x's. The pass only gathers ranges: on SmolLM2 the layouts from a
    bfloat16 pass read +1.39% / +1.33% perplexity over float32 (w8a8; Q4_1 with W8A8 from 1 row) against
    +1.12% / +1.94% from a float32 pass, within the texts' spread; each range stays within 2% of the float32
    pass's (`tests/model/test_w8a8.py`). The 1B shape's pass on 2 busy cores: 12.0-13.5 s against 16.0-20.1 s
    with float32 products and each weight dequantized twice."""
    return torch.bfloat16 if x.device.type == "cpu" and native_bf16() else x.dtype


@torch.no_grad()
def calibrate(model: nn.Module, ids: list[int], linears: list[nn.Module],
              visit: Callable[[nn.Module, LinearInput], None], grams: bool = False,
              weights: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """One forward pass of `model` over `ids` as a single sequence: right after each of `linears` runs,
    `visit(linear, what entered it)` (with its Gram matrix if `grams`), so at most one Gram matrix is held
    at a time (a visit may change the linear: its call is over). Returns the final hidden state's channel
    maxima. With `weights`, each linear's product (its `linear(x, bias)` step) is taken on
    `weights(linear, out=...)`, its float32 weight written into a [out_features, in_features] buffer, in
    `product_dtype`, and the visit gets that weight (`LinearInput.weight`): a quantized weight is dequantized
    once, not again by the visit. The weight and its `product_dtype` copy go into buffers every product
    reuses: a 1B model's weights in fresh tensors faulted in ~6 GB of new pages, 2-3x the passes themselves
    on a VM.

    Gradient-free rather than inference mode, so tensors a visit makes are ordinary model buffers."""
    visited: set[nn.Module] = set()
    used: dict[nn.Module, torch.Tensor] = {}
    buffers: dict[torch.dtype, torch.Tensor] = {}

    def scratch(dtype: torch.dtype, module: nn.Module, device: torch.device) -> torch.Tensor:
        """A [out_features, in_features] view of the pass's one buffer of `dtype`, grown where too small."""
        shape = (module.out_features, module.in_features)
        size = shape[0] * shape[1]
        if dtype not in buffers or buffers[dtype].numel() < size:
            buffers.pop(dtype, None)  # freed before its larger successor is made
            buffers[dtype] = torch.empty(size, dtype=dtype, device=device)
        return buffers[dtype][:size].view(shape)

    def seen(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if module in visited:
            raise RuntimeError("a linear ran twice in the calibration pass: its inputs would be split")
        visited.add(module)
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        visit(module, LinearInput(x.abs().amax(0), x.T @ x if grams else None, used.pop(module, None)))

    def product(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            used[module] = weight = weights(module, out=scratch(torch.float32, module, x.device))
            dtype = product_dtype(x)
            low = weight if dtype == weight.dtype else scratch(dtype, module, x.device).copy_(weight)
            y = F.linear(x.to(dtype), low).to(x.dtype)
            return y if bias is None else y + bias

        return run

    hooks = [m.register_forward_hook(seen) for m in linears]
    if weights is not None:
        for m in linears:
            m.linear = product(m)  # the instance's step, shadowing its class's until the pass ends
    try:
        device = model.norm.weight.device
        tokens = torch.tensor(ids, device=device)
        hidden = model(tokens, torch.arange(len(ids), device=device),
                       WholeSequence(model.scale, model.config.sliding_window))
    finally:
        for hook in hooks:
            hook.remove()
        if weights is not None:
            for m in linears:
                del m.linear
    return hidden.abs().amax(0).float().cpu()
