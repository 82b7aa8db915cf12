"""The exact joint distribution of a target's next three tokens, for the chi-square tests of the
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


def target_joint(engine, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int, int], float]:
    """{(t1, t2, t3): probability} under the target alone (params should truncate, e.g. top_k=3)."""
    joint = {}
    p1 = next_probs(engine, prompt, params)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = next_probs(engine, prompt + [t1], params)
        for t2 in torch.nonzero(p2).flatten().tolist():
            p3 = next_probs(engine, prompt + [t1, t2], params)
            for t3 in torch.nonzero(p3).flatten().tolist():
                joint[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return joint
