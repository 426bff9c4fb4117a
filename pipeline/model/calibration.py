"""One calibration pass at load: the activation ranges W8A8 needs, measured on a fixed text.

Per-token int8 activations lose the most where a few channels are much larger than the rest: the step of
every other channel follows them. Two remedies use the ranges measured here (`pipeline.model.quant`): the
linears' inputs are smoothed (SmoothQuant: channel j of the input divided by s_j, column j of the weight
multiplied by it), and the LM head's outlier channels are split over several int8 columns.

The text is `calibration.txt` (prose, a dialogue, code, SQL, a recipe, a letter, three languages; ~750
tokens for SmolLM2, of which the first CALIBRATION_TOKENS are run): fixed, so a model loads to the same
weights every time. Ranges from random token ids smoothed
SmolLM2 about half as well as text did (perplexity +2.2% against +0.7-1.7% for three different texts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.model.attention import WholeSequence

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
CALIBRATION_TOKENS = 512


@dataclass
class ActivationRanges:
    """max |x| per input channel of each measured linear (by module), and of the final hidden state."""

    inputs: dict[nn.Module, torch.Tensor]
    final: torch.Tensor


def calibration_ids(tokenizer) -> list[int]:
    """The first CALIBRATION_TOKENS token ids of the calibration text."""
    return tokenizer.encode(CALIBRATION_TEXT.read_text())[:CALIBRATION_TOKENS]


@torch.inference_mode()
def measure_ranges(model: nn.Module, ids: list[int], linears: list[nn.Module]) -> ActivationRanges:
    """One forward pass of `model` over `ids` as a single sequence, recording the channel maxima of what
    enters each of `linears` and of the final hidden state."""
    ranges: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple) -> None:
        x = args[0].detach()
        seen = x.abs().reshape(-1, x.shape[-1]).amax(0).float().cpu()
        ranges[module] = torch.maximum(ranges[module], seen) if module in ranges else seen

    hooks = [m.register_forward_pre_hook(record) for m in linears]
    try:
        device = model.norm.weight.device
        tokens = torch.tensor(ids, device=device)
        hidden = model(tokens, torch.arange(len(ids), device=device),
                       WholeSequence(model.scale, model.config.sliding_window))
    finally:
        for hook in hooks:
            hook.remove()
    return ActivationRanges(ranges, hidden.abs().amax(0).float().cpu())
