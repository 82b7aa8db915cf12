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


def same_proposal(mine, theirs) -> None:
    """Two drafters' proposals are one: the same tokens, and the same q where one was drawn."""
    assert mine.token_ids == theirs.token_ids
    assert (mine.q is None) == (theirs.q is None)
    if mine.q is not None:
        assert torch.equal(mine.q, theirs.q)


class PairedDrafters:
    """A drafter for the decoding loop that proposes with `mine` and, beside it, with `reference` on a twin
    of the session's generator, checks each proposal is the reference's (`same_proposal`) and returns mine;
    `after(state, k, params, generator)` runs after each (a subclass's hook)."""

    name = "model"

    def __init__(self, mine, reference):
        self.mine, self.reference, self.device = mine, reference, mine.device
        self.num_proposals = 0

    def open(self, prompt_ids):
        return {"mine": self.mine.open(prompt_ids), "reference": self.reference.open(prompt_ids), "generator": None}

    def check_call(self, state, accepted, k):
        self.mine.check_call(state["mine"], accepted, k)

    def propose(self, state, accepted, k, params, generator):
        if state["generator"] is None:  # the reference's twin of the session's generator
            state["generator"] = torch.Generator(device=generator.device)
            state["generator"].set_state(generator.get_state())
        mine = self.mine.propose(state["mine"], accepted, k, params, generator)
        same_proposal(mine, self.reference.propose(state["reference"], accepted, k, params, state["generator"]))
        self.num_proposals += 1
        self.after(state["mine"], k, params, generator)
        return mine

    def after(self, state, k, params, generator) -> None:
        return None

    def propose_many(self, states, accepted, max_tokens, params, generators):
        return [self.propose(*call) for call in zip(states, accepted, max_tokens, params, generators)]

    def close(self, state):
        self.mine.close(state["mine"])
        self.reference.close(state["reference"])

