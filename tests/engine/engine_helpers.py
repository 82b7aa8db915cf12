"""Reference computations for engine tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specmesh.models.engine import SeqInput


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `token_ids`, float32 [len, vocab]."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def run_alone(engine, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Feed `token_ids` to a fresh sequence in chunks of the given sizes; logits at every position."""
    seq = engine.new_sequence()
    out, start = [], 0
    for size in chunks:
        piece = token_ids[start : start + size]
        out.append(engine.forward([SeqInput(seq, piece, list(range(len(piece))))])[0])
        start += size
    engine.free(seq)
    return torch.cat(out)


def random_ids(vocab_size: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


def with_sliding_window(folder: str | Path, path: Path, window: int) -> Path:
    """A copy of the model at `folder` in `path` whose config has `sliding_window = window`."""
    shutil.copytree(folder, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = window
    (path / "config.json").write_text(json.dumps(config))
    return path
