"""Read a GGUF file's tensors under Hugging Face names, quantized ones as QuantWeight (no fp32 copy).

llama.cpp's converter permutes the rows of q and k for Llama-architecture files (its rope pairs
adjacent dims, transformers' pairs halves); rows are whole blocks, so the permutation is undone on the
quantized rows, exactly as transformers undoes it on dequantized ones. Matrices in a format without a
low-bit layout here (Q5_K, IQ*, ...) and float tensors are dequantized to float32.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from specmesh.models.config import LlamaFamilyConfig
from specmesh.models.lowbit.blocks import FORMAT_OF_TYPE, from_ggml
from specmesh.models.lowbit.qweight import QuantWeight

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PERMUTED_ARCHITECTURES = ("llama", "mistral")  # q/k rows permuted by llama.cpp's converter
SKIPPED = ("rope_freqs.weight",)  # rope scaling comes from the config


def hf_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for unknown names."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: row r of the result is row index[r] of the file.

    Per head of d rows, llama.cpp stores rows [0, d/2, 1, d/2 + 1, ...]; e.g. one head of 4 rows:
    >>> unpermute_rows(4, 1).tolist()
    [0, 2, 1, 3]
    """
    head_dim = num_rows // num_heads
    return torch.arange(num_rows).view(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def read_gguf(path: str | Path, config: LlamaFamilyConfig) -> dict[str, torch.Tensor | QuantWeight]:
    """name -> float32 tensor or QuantWeight, named as in the model's Hugging Face checkpoint."""
    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for tensor in reader.tensors:
        if tensor.name in SKIPPED:
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"{Path(path).name}: tensor {tensor.name!r} has no place in a Llama-family model")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        value: torch.Tensor | QuantWeight
        if qtype in FORMAT_OF_TYPE and len(tensor.shape) == 2:
            value = from_ggml(np.asarray(tensor.data), FORMAT_OF_TYPE[qtype])
        else:
            data = np.asarray(tensor.data)
            if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                data = quants.dequantize(data, qtype)
            value = torch.from_numpy(np.array(data, dtype=np.float32))
        if architecture in PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            index = unpermute_rows(value.shape[0], heads)
            value = value.select_rows(index) if isinstance(value, QuantWeight) else value.index_select(0, index)
        out[name] = value
    return out
