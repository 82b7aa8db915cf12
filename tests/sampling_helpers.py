"""The exact joint distribution of a target's next few tokens, for the chi-square tests of the
speculative loops (engine-level and cascade)."""

from __future__ import annotations

import torch

from specmesh.decoding.sampling import SamplingParams, processed_probs
from specmesh.models.engine import SeqInput


def next_probs(engine, prefix: list[int], params: SamplingParams) -> torch.Tensor:
    """[vocab] float64: the processed next-token distribution after `prefix`."""
    seq = engine.new_sequence()
    try:
        logits = engine.forward([SeqInput(seq, list(prefix), [len(prefix) - 1])])[0]
    finally:
        engine.free(seq)
    return processed_probs(logits, params)[0].double()


def target_joint(engine, prompt: list[int], params: SamplingParams, length: int = 3) -> dict[tuple[int, ...], float]:
    """{(t1, .., t_length): probability} under the target alone (params should truncate, e.g. top_k=3)."""
    joint: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], probability: float) -> None:
        if len(prefix) == length:
            joint[prefix] = probability
            return
        probs = next_probs(engine, prompt + list(prefix), params)
        for token in torch.nonzero(probs).flatten().tolist():
            extend(prefix + (token,), probability * float(probs[token]))

    extend((), 1.0)
    return joint
