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
from torch import nn

from pipeline.model.attention import WholeSequence

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
CALIBRATION_TOKENS = 512


@dataclass
class LinearInput:
    """What the calibration pass fed one linear: max |x| per input channel [K] and, when asked for, the
    Gram matrix X^T X [K, K] of its inputs (float32), which error-compensating rounding weighs errors by."""

    absmax: torch.Tensor
    gram: torch.Tensor | None


def calibration_ids(tokenizer) -> list[int]:
    """The first CALIBRATION_TOKENS token ids of the calibration text."""
    return tokenizer.encode(CALIBRATION_TEXT.read_text())[:CALIBRATION_TOKENS]


@torch.no_grad()
def calibrate(model: nn.Module, ids: list[int], linears: list[nn.Module],
              visit: Callable[[nn.Module, LinearInput], None], grams: bool = False) -> torch.Tensor:
    """One forward pass of `model` over `ids` as a single sequence: right after each of `linears` runs,
    `visit(linear, what entered it)` (with its Gram matrix if `grams`), so at most one Gram matrix is held
    at a time (a visit may change the linear: its call is over). Returns the final hidden state's channel
    maxima.

    Gradient-free rather than inference mode, so tensors a visit makes are ordinary model buffers."""
    visited: set[nn.Module] = set()

    def seen(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if module in visited:
            raise RuntimeError("a linear ran twice in the calibration pass: its inputs would be split")
        visited.add(module)
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        visit(module, LinearInput(x.abs().amax(0), x.T @ x if grams else None))

    hooks = [m.register_forward_hook(seen) for m in linears]
    try:
        device = model.norm.weight.device
        tokens = torch.tensor(ids, device=device)
        hidden = model(tokens, torch.arange(len(ids), device=device),
                       WholeSequence(model.scale, model.config.sliding_window))
    finally:
        for hook in hooks:
            hook.remove()
    return hidden.abs().amax(0).float().cpu()
