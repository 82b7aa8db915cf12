"""QuantLinear: a linear layer over a QuantWeight, float32 activations (weight-only quantization).

Every output row depends only on its own input row, so the layer is batch-invariant by construction:
with the compiled kernel, a call over k + 1 rows returns, bit for bit, the rows of k + 1 one-row
calls (kernel.cpp says why). Calls of more than `MAX_FUSED_ROWS` rows (prompt prefill) dequantize
the weight once and use sgemm instead, which is faster there and equal up to float rounding.
"""

from __future__ import annotations

import torch

from specmesh.models.lowbit.kernel import fused_matmul, reference_matmul
from specmesh.models.lowbit.qweight import QuantWeight

MAX_FUSED_ROWS = 64  # a verify batch of up to 64 rows (e.g. 8 sessions x 8 tokens) stays bit-identical


class QuantLinear:
    """y = x @ dequant(weight).T + bias for x: float32 [num_tokens, in_features]."""

    kernel = "lowbit"

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.float().contiguous()

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = fused_matmul(x, self.weight) if x.shape[0] <= MAX_FUSED_ROWS else None
        if y is None:
            y = reference_matmul(x, self.weight)
        return y if self.bias is None else y + self.bias
