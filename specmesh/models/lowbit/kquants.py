"""Writers for ggml's Q4_K and Q6_K blocks (the gguf package reads them but cannot write them).

Plain min/max (Q4_K) and abs-max (Q6_K) rounding, not llama.cpp's iterative scale search: the bytes
are valid blocks, and `quants.dequantize` of them is what the loaded QuantWeight computes.

Q4_K super-block (256 inputs, 144 bytes): d f16 | dmin f16 | 12 bytes scales | 128 bytes q.
    The 12 scale bytes hold 8 six-bit scales sc and 8 six-bit mins m (see `_pack_scale_min`).
    q: four chunks of 32 bytes; chunk j holds sub-block 2j in the low nibbles, 2j + 1 in the high.
Q6_K super-block (256 inputs, 210 bytes): 128 bytes ql (low 4 bits) | 64 bytes qh (high 2 bits) |
    16 int8 scales | d f16. Input p (0..255) of the block: half a = p // 128, r = p % 128:
    low bits in ql[64a + r % 64] nibble r // 64, high bits in qh[32a + r % 32] bits 2 * (r // 32).
"""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256


def _blocks(data: np.ndarray) -> np.ndarray:
    rows, cols = data.shape
    if cols % SUPER_BLOCK:
        raise ValueError(f"K-quants need rows of a multiple of {SUPER_BLOCK} inputs, not {cols}")
    return data.astype(np.float32).reshape(-1, SUPER_BLOCK)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> the 12 bytes `gguf.quants.Q4_K.get_scale_min` reads:
    bytes 0-3: sc[0:4] | top 2 bits of sc[4:8] << 6; bytes 4-7: m[0:4] | top 2 bits of m[4:8] << 6;
    bytes 8-11: low 4 bits of sc[4:8] | low 4 bits of m[4:8] << 4."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """float [out, in] -> Q4_K rows uint8 [out, in / 256 * 144]."""
    blocks = _blocks(data)
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # the format's mins are >= 0 and subtracted
    sub_scale = (sub.max(axis=-1) - low) / 15.0
    d = (sub_scale.max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(sub_scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(-low / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        scale = d[:, None] * sc.astype(np.float32)
        offset = dmin[:, None] * m.astype(np.float32)
        q = np.where(scale[..., None] > 0, np.rint((sub + offset[..., None]) / scale[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc, m), qs], axis=1)
    return out.reshape(data.shape[0], -1)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """float [out, in] -> Q6_K rows uint8 [out, in / 256 * 210]."""
    blocks = _blocks(data)
    sub = blocks.reshape(-1, 16, 16)
    sub_scale = np.abs(sub).max(axis=-1) / 31.0
    d = (sub_scale.max(axis=-1) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(sub_scale / d[:, None]), 0).clip(-128, 127).astype(np.int8)
        scale = d[:, None] * sc.astype(np.float32)
        q = np.where(scale[..., None] > 0, np.rint(sub / scale[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, SUPER_BLOCK)
    low = (q & 15).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return out.reshape(data.shape[0], -1)
