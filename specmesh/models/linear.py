"""Linear layers with the fastest kernel per dtype and device.

Decode on CPU is a matrix-vector product bound by reading the weights; verification multiplies a
few rows by the same weights and should cost little more. MKL's sgemm (plain `F.linear`) takes
~3.7x as long for 5 rows as for 1 on a 576 -> 49k matrix; oneDNN's linear (`mkldnn._linear_pointwise`)
~1.6x, and is also faster for 1 row. So:
- `plain`: `F.linear`; any dtype and device; float64 exactness tests use it.
- `onednn`: CPU float32 / bfloat16 through oneDNN, with the weight reordered once at load into
  oneDNN's blocked layout (`mkldnn._reorder_linear_weight`). Unpacked, oneDNN reorders the weight on
  every call; prepacked, one call reads it once: measured on a 576 -> 49k matrix, fp32 1 row 4.1 ms
  (same), 5 rows 3.5 ms (was 6.2), 9 rows 4.4 ms (was 7.2); bf16 1 row 2.0 ms (was 3.3). So verifying
  k + 1 <= 9 tokens costs about one decode step. The packing hint is `ONEDNN_PACK_ROWS` rows.
  Opt-in (`ONE_ROW_KERNEL = True`, bench/gpu.py `--one-row-kernel`): on CUDA a one-row product in
  bfloat16 / float16 (a B=1 decode step) takes a Triton kernel (specmesh/models/gemv_triton.py), rows
  from two up stay on `F.linear`. On an H100 it makes 1B plain decoding 1.10x faster, but one-token
  steps and verify forwards then round differently (a 9-token chain's logits 0.105 from the steps',
  one row's argmax flipped on random weights, against 0.055 and none with cuBLAS alone): greedy
  speculative decoding would drift further from plain decoding at near-ties. Off by default.
- `int8-dynamic`: dynamic int8 (per-output-channel weights, activations quantized per call), CPU
  float32 input. Fast, but NOT batch-invariant (one activation scale per call: k + 1 rows verified
  together get other numbers than one at a time), so only for drafters.
Low-bit weight-only layers (a `QuantWeight`) get `QuantLinear` (specmesh/models/lowbit), which is
batch-invariant; `make_linear` / `fused_linear` pick the class from the weight.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from specmesh.models.lowbit.qlinear import QuantLinear
from specmesh.models.lowbit.qweight import QuantWeight, can_concatenate, concatenate
from specmesh.models.paged_attention import triton_runs

WeightLike = torch.Tensor | QuantWeight

KERNELS = ("plain", "onednn", "int8-dynamic")
ONE_ROW_KERNEL = False  # `plain`: one-row bf16 / fp16 products on CUDA through gemv_triton (opt-in: module docstring)
ONEDNN_PACK_ROWS = 8  # rows the blocked layout is tuned for: verify-sized calls (1 + k tokens)


def default_kernel(dtype: torch.dtype, device: torch.device) -> str:
    """oneDNN's packed linear where it runs: fp32 on any x86 CPU with oneDNN; bf16 only where the CPU
    has bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU refuses to pack bf16)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return "plain"
    if dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "onednn"
    return "plain"


class Linear:
    """y = x @ weight.T + bias for x: [num_tokens, in_features] -> [num_tokens, out_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str = "plain", keep_weight: bool = False):
        """keep_weight: keep the row-major `weight` beside a packed copy (the float32 fast path reads it)."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown linear kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.weight: torch.Tensor | None = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self._packed: Any = None  # oneDNN blocked weight or fbgemm packed int8 params
        if kernel == "int8-dynamic":
            self._packed = _pack_int8(self.weight, self.bias)
            self.weight = None  # only the int8 copy is kept
        elif kernel == "onednn":
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, ONEDNN_PACK_ROWS)
            if not keep_weight:
                self.weight = None  # only the blocked copy is kept

    @property
    def nbytes(self) -> int:
        if self.kernel == "int8-dynamic":
            return self.out_features * self.in_features
        if self.kernel == "onednn":
            return self.out_features * self.in_features * self._packed.element_size()
        return self._plain_weight().numel() * self._plain_weight().element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        if self.kernel == "int8-dynamic":
            return self._int8(x)
        weight = self._plain_weight()
        if ONE_ROW_KERNEL and x.shape[0] == 1 and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and triton_runs(x):
            from specmesh.models.gemv_triton import gemv

            return gemv(x, weight, self.bias)
        return F.linear(x, weight, self.bias)

    def _plain_weight(self) -> torch.Tensor:
        assert self.weight is not None  # only the packed kernels drop it
        return self.weight

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed).to(x.dtype)


def _pack_int8(weight: torch.Tensor, bias: torch.Tensor | None):
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())


class ConcatLinear:
    """Several layers over one input, outputs side by side: a fused q/k/v or gate/up whose parts
    cannot share one matrix (a GGUF may store attn_v in Q6_K and attn_q in Q4_K)."""

    def __init__(self, parts: Sequence[Linear | QuantLinear]):
        self.parts = list(parts)
        self.out_features: int = sum(p.out_features for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def make_linear(weight: WeightLike, bias: torch.Tensor | None, kernel: str, keep_weight: bool = False) -> Linear | QuantLinear:
    """QuantLinear for a QuantWeight, else Linear with `kernel`."""
    if isinstance(weight, QuantWeight):
        return QuantLinear(weight, bias)
    return Linear(weight, bias, kernel, keep_weight)


def fused_linear(weights: Sequence[WeightLike], biases: Sequence[torch.Tensor] | None, kernel: str,
                 keep_weight: bool = False) -> Linear | QuantLinear | ConcatLinear:
    """One layer computing the given layers' outputs concatenated (q/k/v, gate/up)."""
    bias = None if biases is None else torch.cat(list(biases))
    if all(isinstance(w, torch.Tensor) for w in weights):
        return Linear(torch.cat(list(weights)), bias, kernel, keep_weight)  # type: ignore[arg-type]
    quantized = [w for w in weights if isinstance(w, QuantWeight)]
    if len(quantized) == len(weights) and can_concatenate(quantized):
        return QuantLinear(concatenate(quantized), bias)
    parts_bias = [None] * len(weights) if biases is None else list(biases)
    return ConcatLinear([make_linear(w, b, kernel) for w, b in zip(weights, parts_bias)])
