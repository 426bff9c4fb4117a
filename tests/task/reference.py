"""What the task tests compare with: log-probabilities and pooled hidden states computed from transformers'
outputs (the `tiny_reference` / SmolLM2 models of the tests), fed the job's own token ids."""

from __future__ import annotations

import torch


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], candidate: list[int]) -> list[float]:
    """Log-probability of each candidate token given the prompt and the candidate's tokens before it."""
    ids = torch.tensor([prompt + candidate])
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(candidate)]


@torch.no_grad()
def reference_hidden(model, ids: list[int]) -> torch.Tensor:
    """The final hidden states (after the final norm) of every position [T, H]."""
    return model.model(torch.tensor([ids])).last_hidden_state[0].float()


def pooled(hidden: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
