"""ggml block formats <-> QuantWeight, without dequantizing to float.

A ggml quantized matrix [out, in] is stored row by row, each row a run of fixed-size blocks
(bytes per block / inputs per block):
    Q4_0  18 / 32    d f16, 16 bytes of 4-bit q            w = d * (q - 8)
    Q4_1  20 / 32    d f16, m f16, 16 bytes of q           w = d * q + m
    Q8_0  34 / 32    d f16, 32 int8 q                      w = d * q
    Q4_K 144 / 256   d, dmin f16; 8 x (6-bit sc, 6-bit m) packed in 12 bytes; 128 bytes of q
                     w = d * sc[j] * q - dmin * m[j] for sub-block j of 32
    Q6_K 210 / 256   128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 sc, d f16
                     w = d * sc[j] * (q - 32) for sub-block j of 16
`from_ggml` turns such rows into a QuantWeight (numbers exact: the same products the format's
dequantization computes); `quantize` goes the other way, through gguf's quantizers for Q4_0, Q4_1 and
Q8_0 and ours (kquants.py) for Q4_K and Q6_K.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from specmesh.models.lowbit.kquants import quantize_q4_k, quantize_q6_k
from specmesh.models.lowbit.qweight import QuantWeight

FORMATS = {
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q6_k": GGMLQuantizationType.Q6_K,
}
FORMAT_OF_TYPE = {qtype: name for name, qtype in FORMATS.items()}


def block_inputs(fmt: str) -> int:
    """Inputs per block: 32, or 256 for the K-quants."""
    return GGML_QUANT_SIZES[FORMATS[fmt]][0]


def quantize(weight: torch.Tensor, fmt: str) -> np.ndarray:
    """float [out, in] -> ggml rows uint8 [out, in / block_inputs * block_bytes] of format `fmt`."""
    data = weight.detach().float().cpu().numpy()
    if fmt == "q4_k":
        return quantize_q4_k(data)
    if fmt == "q6_k":
        return quantize_q6_k(data)
    return quants.quantize(data, FORMATS[fmt])


def dequantize(rows: np.ndarray, fmt: str) -> torch.Tensor:
    """gguf's own dequantization of ggml rows (the reference the tests compare with)."""
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(rows, FORMATS[fmt])))


def quantize_weight(weight: torch.Tensor, fmt: str) -> QuantWeight:
    return from_ggml(quantize(weight, fmt), fmt)


def _split(rows: np.ndarray, fmt: str) -> np.ndarray:
    """uint8 [out, row_bytes] -> [out, num_blocks, block_bytes]."""
    block_bytes = GGML_QUANT_SIZES[FORMATS[fmt]][1]
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    return rows.reshape(rows.shape[0], -1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block -> float32 [out, num_blocks]."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _pack_q4(values: np.ndarray) -> np.ndarray:
    """4-bit values [..., 32] -> bytes [..., 16] in Q4_0 order (byte b = value b | value b + 16 << 4)."""
    return values[..., :16] | (values[..., 16:] << 4)


def from_ggml(rows: np.ndarray, fmt: str) -> QuantWeight:
    """ggml rows uint8 [out, row_bytes] of format `fmt` -> QuantWeight."""
    blocks = _split(rows, fmt)
    num_out, num_blocks = blocks.shape[:2]
    if fmt in ("q4_0", "q4_1"):
        d = _f16(blocks, 0)
        offset = -8 * d if fmt == "q4_0" else _f16(blocks, 2)
        qs = blocks[..., 2 if fmt == "q4_0" else 4 :]
        return _q4(qs.reshape(num_out, -1), d.astype(np.float16), offset.astype(np.float16), fmt)
    if fmt == "q8_0":
        qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        return _q8(qs.reshape(num_out, -1), _f16(blocks, 0).astype(np.float16), 32, fmt)
    if fmt == "q4_k":
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, m = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        scale = d[..., None] * sc.reshape(num_out, num_blocks, 8).astype(np.float32)
        offset = -(dmin[..., None] * m.reshape(num_out, num_blocks, 8).astype(np.float32))
        qs = blocks[..., 16:].reshape(num_out, num_blocks, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        values = (qs & 15).reshape(num_out, num_blocks, 8, 32)  # sub-block 2j: low nibbles of 32 bytes, 2j + 1: high
        return _q4(_pack_q4(values).reshape(num_out, -1), scale.reshape(num_out, -1), offset.reshape(num_out, -1), fmt)
    if fmt == "q6_k":
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
        scale = _f16(blocks, 208)[..., None] * sc  # [out, blocks, 16]
        low = (ql.reshape(num_out, num_blocks, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15
        high = (qh.reshape(num_out, num_blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
        q = (low.reshape(num_out, num_blocks, 8, 32) | (high.reshape(num_out, num_blocks, 8, 32) << 4)).astype(np.int8) - 32
        return _q8(q.reshape(num_out, -1), scale.reshape(num_out, -1), 16, fmt)
    raise ValueError(f"no low-bit layout for format {fmt!r}; supported: {', '.join(FORMATS)}")


def _q4(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, fmt: str) -> QuantWeight:
    return QuantWeight(
        "q4",
        torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        torch.from_numpy(np.ascontiguousarray(offsets)),
        32,
        fmt,
    )


def _q8(codes: np.ndarray, scales: np.ndarray, group_size: int, fmt: str) -> QuantWeight:
    return QuantWeight(
        "q8",
        torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int8)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        None,
        group_size,
        fmt,
    )
