"""Draft distributions q that travel rounded (float16 / bfloat16) and stay exact.

Exactness needs the verifier to use the very q each draft token was drawn from. When q travels in
float16 or bfloat16, the model drafter rounds first and samples from the rounded q, so the rows it
sends are the rows it sampled from:

    drafter:  q32 = processed_probs(logits)        # float32, what an unrounded drafter samples from
              raw = RoundQ(torch.float16)(q32)      # what travels (dense, or its exact support)
              x   = sample(normalize_q(raw))        # the draft token is drawn from the rounded q
    verifier: normalize_q(raw)                      # bit-identical: same values, same function

`ModelDrafter(engine, q_transform=RoundQ(dtype))` is that drafter; without a transform (float32 on
the wire) q travels unrounded and the proposal equals the plain in-process drafter's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WIRE_Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RoundQ:
    """q transform: float32 probabilities [n, vocab] -> the same rows rounded to `dtype`, on the CPU."""

    dtype: torch.dtype

    def __post_init__(self):
        if self.dtype not in WIRE_Q_DTYPES:
            raise ValueError(f"q travels as float32, float16 or bfloat16, not {self.dtype}")

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        return q.detach().to("cpu", self.dtype)


def q_transform_for(dtype: torch.dtype) -> RoundQ | None:
    """The transform a drafter needs for q travelling in `dtype` (None: float32 is not rounded)."""
    return None if dtype == torch.float32 else RoundQ(dtype)
