"""Weight-only quantization of a Hugging Face checkpoint into ggml block formats (`quantize=` kinds).

    int8  -> Q8_0 (int8, one float16 scale per 32 inputs)
    int4  -> Q4_1 (4-bit, float16 scale and min per 32 inputs)
    q4_0, q4_1, q8_0, q4_k, q6_k -> that format
The vocab projection (or the tied embedding) is the most sensitive matrix and gets 8 bits with a
4-bit kind (Q8_0; Q6_K for q4_k, as llama.cpp's Q4_K_M does). A matrix whose inputs do not fill
whole blocks (K-quants need multiples of 256) falls back to the 32-input format of the same width
(Q4_K -> Q4_1, Q6_K -> Q8_0), or stays float when even that does not fit.
"""

from __future__ import annotations

import torch

from specmesh.models.lowbit.blocks import block_inputs, quantize_weight
from specmesh.models.lowbit.qweight import QuantWeight

KIND_FORMATS = {"int8": "q8_0", "int4": "q4_1", "q4_0": "q4_0", "q4_1": "q4_1", "q8_0": "q8_0", "q4_k": "q4_k", "q6_k": "q6_k"}
HEAD_FORMATS = {"q4_0": "q8_0", "q4_1": "q8_0", "q8_0": "q8_0", "q4_k": "q6_k", "q6_k": "q6_k"}
FALLBACK_FORMATS = {"q4_k": "q4_1", "q6_k": "q8_0"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def format_for(fmt: str, in_features: int) -> str | None:
    """The format a matrix with `in_features` inputs gets (None: keep it float)."""
    while in_features % block_inputs(fmt):
        if fmt not in FALLBACK_FORMATS:
            return None
        fmt = FALLBACK_FORMATS[fmt]
    return fmt


def quantize_checkpoint(tensors: dict[str, torch.Tensor], kind: str, tie_word_embeddings: bool) -> dict[str, torch.Tensor | QuantWeight]:
    """Replace the projection matrices (and the vocab projection) of a Llama-family state dict."""
    if kind not in KIND_FORMATS:
        raise ValueError(f"unknown quantization kind {kind!r}; choose one of {', '.join(KIND_FORMATS)}")
    fmt = KIND_FORMATS[kind]
    head_name = "model.embed_tokens.weight" if tie_word_embeddings or "lm_head.weight" not in tensors else "lm_head.weight"
    out: dict[str, torch.Tensor | QuantWeight] = dict(tensors)
    for name, tensor in tensors.items():
        if name == head_name:
            chosen = format_for(HEAD_FORMATS[fmt], tensor.shape[1])
        elif name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            chosen = format_for(fmt, tensor.shape[1])
        else:
            continue
        if chosen is not None:
            out[name] = quantize_weight(tensor, chosen)
    return out
