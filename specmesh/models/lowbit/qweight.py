"""QuantWeight: a weight matrix kept in a low-bit layout the fused kernel reads directly.

Two layouts cover every supported format (see kernel.cpp for the byte order):
- `q4`: 4-bit codes q in 0..15, groups of 32 inputs, w = scale * q + offset
  (ggml Q4_0: offset = -8 * scale; Q4_1: offset = min; Q4_K: scale = d * sc, offset = -dmin * m).
- `q8`: int8 codes, groups of 16 or 32 inputs, w = scale * q (ggml Q8_0; Q6_K: q - 32 in -32..31,
  scale = d * sc, groups of 16).
Scales keep the precision that makes them exact: float16 where the format stores float16 (Q4_0, Q4_1,
Q8_0), float32 where they are products of two stored numbers (the K-quants).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

LAYOUTS = ("q4", "q8")
Q4_GROUP = 32  # inputs per q4 group (ggml's block size)


@dataclass(frozen=True)
class QuantWeight:
    layout: str  # "q4" | "q8"
    codes: torch.Tensor  # q4: uint8 [out, in // 2] (two codes per byte); q8: int8 [out, in]
    scales: torch.Tensor  # [out, in // group_size] float16 or float32
    offsets: torch.Tensor | None  # q4: [out, in // 32], dtype of scales; q8: None
    group_size: int  # inputs per scale: 32 (q4, Q8_0) or 16 (Q6_K)
    source: str  # the format it was read or quantized from: "q4_0", "q4_1", "q8_0", "q4_k", "q6_k"

    def __post_init__(self):
        assert self.layout in LAYOUTS and (self.offsets is not None) == (self.layout == "q4")
        assert self.codes.is_contiguous() and self.scales.is_contiguous()
        assert self.scales.shape == (self.out_features, self.in_features // self.group_size)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * (2 if self.layout == "q4" else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes one matmul reads: codes, scales and offsets."""
        tensors = [self.codes, self.scales] + ([] if self.offsets is None else [self.offsets])
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out, in] (or [len(rows), in] for the given output rows: an embedding lookup)."""
        codes, scales = self.codes, self.scales
        offsets = self.offsets
        if rows is not None:
            codes, scales = codes.index_select(0, rows), scales.index_select(0, rows)
            offsets = None if offsets is None else offsets.index_select(0, rows)
        num_rows, num_groups = scales.shape
        if self.layout == "q4":
            packed = codes.view(num_rows, num_groups, Q4_GROUP // 2)
            q = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # [rows, groups, 32]
            assert offsets is not None
            w = q * scales.float().unsqueeze(-1) + offsets.float().unsqueeze(-1)
        else:
            w = codes.view(num_rows, num_groups, self.group_size).float() * scales.float().unsqueeze(-1)
        return w.reshape(num_rows, -1)

    def select_rows(self, index: torch.Tensor) -> QuantWeight:
        """The output rows `index` in that order (e.g. undoing llama.cpp's q/k row permutation)."""
        offsets = None if self.offsets is None else self.offsets.index_select(0, index)
        return replace(self, codes=self.codes.index_select(0, index), scales=self.scales.index_select(0, index), offsets=offsets)

    def to_scale_dtype(self, dtype: torch.dtype) -> QuantWeight:
        offsets = None if self.offsets is None else self.offsets.to(dtype)
        return replace(self, scales=self.scales.to(dtype), offsets=offsets)


def can_concatenate(weights: Sequence[QuantWeight]) -> bool:
    first = weights[0]
    return all(w.layout == first.layout and w.group_size == first.group_size and w.in_features == first.in_features for w in weights)


def concatenate(weights: Sequence[QuantWeight]) -> QuantWeight:
    """Stack weights of one layout along the output dimension (fused q/k/v, gate/up)."""
    assert can_concatenate(weights)
    dtype = torch.float32 if any(w.scales.dtype == torch.float32 for w in weights) else torch.float16
    weights = [w.to_scale_dtype(dtype) for w in weights]
    sources = sorted({w.source for w in weights})
    offsets = None if weights[0].offsets is None else torch.cat([w.offsets for w in weights])  # type: ignore[misc]
    return replace(
        weights[0],
        codes=torch.cat([w.codes for w in weights]),
        scales=torch.cat([w.scales for w in weights]),
        offsets=offsets,
        source="+".join(sources),
    )
