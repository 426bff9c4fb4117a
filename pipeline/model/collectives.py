"""The collectives a tensor-parallel model calls: which rank this process is, all-reduce, all-gather.

This is all the model knows of parallelism, so it lives with the model; starting processes and sending
steps live above the engine, in `pipeline/parallel/`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel position of this process. `size == 1` means no communication at all."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's slice along the last dimension (used for vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
