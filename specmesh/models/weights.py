"""Read a Hugging Face folder's safetensors (single file or sharded) into a name -> tensor dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


def load_tensors(folder: str | Path, dtype: torch.dtype, prefix_filter: str = "") -> dict[str, torch.Tensor]:
    """All tensors whose name starts with `prefix_filter`, converted to `dtype` (on CPU)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name.startswith(prefix_filter):
                    tensors[name] = handle.get_tensor(name).to(dtype)
    return tensors
