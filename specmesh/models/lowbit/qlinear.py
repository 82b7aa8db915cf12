"""QuantLinear: a linear layer over a QuantWeight; its input rows are rounded to 8 bits per block of 32 (kernel.cpp).

Every output row depends only on its own input row, so the layer is batch-invariant by construction:
with the compiled kernel, a call over k + 1 rows returns, bit for bit, the rows of k + 1 one-row
calls (kernel.cpp says why), whatever the number of rows (a prompt's prefill, a verify batch of many
sessions). Without a compiler the torch reference computes the same numbers up to float rounding.
"""

from __future__ import annotations

import torch

from specmesh.models.lowbit.kernel import bind_matmul, reference_matmul
from specmesh.models.lowbit.qweight import QuantWeight


class QuantLinear:
    """y = quantize_activations(x) @ dequant(weight).T + bias for x: float32 [num_tokens, in_features]."""

    kernel = "lowbit"

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.float().contiguous()
        self._matmul = bind_matmul(weight)  # None: no compiled kernel here

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._matmul is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            y = self._matmul(x)
        else:
            y = reference_matmul(x, self.weight)
        return y if self.bias is None else y + self.bias
