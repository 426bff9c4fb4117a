"""`model.quant=fp8`: linears stored as float8_e4m3 rows with per-channel scales, multiplied W8A8 with
per-token activation scales by `kernels.fp8` (torch._scaled_mm: FP8 tensor cores, CUDA only).

Tensor parallelism: column-parallel ranks quantize their own rows; row-parallel ranks quantize whole rows
and keep their slice of the inputs, so every rank's scales equal the single-rank model's.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8, fp8_matmul, quantize_fp8_weight
from pipeline.model.layers import ParallelLinear


class Fp8Linear(ParallelLinear):
    def __init__(self, linear: ParallelLinear):
        device = linear.weight.device
        with torch.device(device):
            super().__init__(*linear.init_args())
            del self.weight
            self.register_buffer("qweight", torch.empty(self.out_features, self.in_features, dtype=FP8))
            self.register_buffer("scales", torch.empty(self.out_features, dtype=torch.float32))
        self.rows_loaded = 0

    def load(self, full: torch.Tensor, shard_id: int = 0, is_bias: bool = False) -> None:
        if is_bias:
            super().load(full, shard_id, is_bias)
            return
        if not isinstance(full, torch.Tensor):
            raise TypeError("quant=fp8 quantizes float weights itself; got pre-quantized blocks")
        if self.shard_dim == 1 and self.tp.size > 1:
            q, scales = quantize_fp8_weight(full)
            q = self.shard_of(q, shard_id)
        else:
            q, scales = quantize_fp8_weight(self.shard_of(full, shard_id))
        start, n = self.local_rows(shard_id)
        self.qweight.narrow(0, start, n).copy_(q)
        self.scales.narrow(0, start, n).copy_(scales)
        self.rows_loaded += n

    def quantize_from(self, weight: torch.Tensor) -> None:
        """Quantize this rank's already-loaded float weight [out_features, in_features] as a whole."""
        q, scales = quantize_fp8_weight(weight)
        self.qweight.copy_(q)
        self.scales.copy_(scales)
        self.rows_loaded = self.out_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = fp8_matmul(x, self.qweight, self.scales)
        return y if bias is None else y + bias
