"""How much device memory the KV cache may take on CUDA (`engine.kv_cache_memory=auto`).

The job may use `gpu_memory_utilization` of the device's total memory. What is already in use when the
engine starts (the weights, the CUDA context, other processes) and the activation peak of the largest
step (measured by running one) come off that; the rest holds KV blocks. The same share vLLM users know.
"""

from __future__ import annotations

import torch

from pipeline.model.llama import LlamaModel

GIB = 2**30


def kv_cache_budget(total: int, free: int, activation_peak: int, utilization: float, block_bytes: int,
                    min_blocks: int) -> int:
    """Bytes for KV blocks: utilization x total, less what is in use (total - free) and the activation
    peak. Raises ValueError, with the figures, when fewer than `min_blocks` blocks would fit."""
    in_use = total - free
    budget = int(total * utilization) - in_use - activation_peak
    if budget < min_blocks * block_bytes:
        raise ValueError(
            f"the model does not fit: engine.gpu_memory_utilization={utilization} allows "
            f"{total * utilization / GIB:.2f} GiB of {total / GIB:.2f} GiB; {in_use / GIB:.2f} GiB are in use "
            f"(weights, CUDA context, other processes) and a step's activations peak at "
            f"{activation_peak / GIB:.2f} GiB, leaving {max(budget, 0) / GIB:.2f} GiB for the KV cache, "
            f"less than the {min_blocks} blocks ({min_blocks * block_bytes / GIB:.2f} GiB) one sequence of "
            "max_model_len needs; raise engine.gpu_memory_utilization, lower engine.max_batched_tokens or "
            "engine.max_model_len, or quantize the model (model.quant)"
        )
    return budget


class _NoCacheAttention:
    """Attention stand-in for the profiling step: the right output shape, no cache (the Triton kernels
    keep their intermediates in registers, so the step's peak is in the linears, MLP and logits)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(q)


@torch.inference_mode()
def measure_activation_peak(model: LlamaModel, num_tokens: int, sampling_rows: int, device: torch.device) -> int:
    """Bytes above the current allocation that a step of `num_tokens` tokens with `sampling_rows` logits
    rows (and the sampler's sort of them) needs at its peak, measured on the device."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device) % model.config.max_position_embeddings
    hidden = model(ids, positions, _NoCacheAttention())
    logits = model.compute_logits(hidden[: min(num_tokens, sampling_rows)])
    torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, logits
    torch.cuda.empty_cache()
    return peak
