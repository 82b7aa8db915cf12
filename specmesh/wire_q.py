"""Draft distributions q that travel rounded (fp16 / bf16) and stay exact.

Exactness needs the verifier to use the very q each draft token was drawn from. When q travels in
fp16 or bf16, the drafter therefore rounds first and samples from the rounded q, and both sides turn
the rounded values into probabilities with one shared function, `wire_to_q`:

    drafter:  q32 = processed_probs(logits)          # float32, what the in-process drafter uses
              raw = q32.to(fp16)                      # what travels (dense or its exact support)
              q   = wire_to_q(raw)                    # renormalised in float64 on the CPU -> float32
              x   = sample(q, generator)              # the draft token is drawn from q
    verifier: q   = wire_to_q(raw)                    # bit-identical: same bytes, same function
float32 on the wire is not rounded: `wire_to_q` returns it unchanged, so a dense-fp32 run equals the
in-process `ModelDrafter` exactly. `RoundedQModelDrafter` is the in-process drafter with the fp16/bf16
behaviour, so an in-process run can be compared with a rounded over-the-wire run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specmesh.decoding.sampling import SamplingParams, processed_probs, sample
from specmesh.drafters.base import DraftProposal
from specmesh.drafters.model import ModelDrafter, ModelDraftState


def wire_to_q(raw: torch.Tensor) -> torch.Tensor:
    """Wire values [..., vocab] (float32 / float16 / bfloat16) -> float32 q on the CPU.

    float32 passes through unchanged; rounded dtypes are renormalised deterministically (float64 sum
    on the CPU, then float32) so every process computes the same bits from the same bytes."""
    raw = raw.detach().cpu()
    if raw.dtype == torch.float32:
        return raw
    wide = raw.double()
    return (wide / wide.sum(dim=-1, keepdim=True)).float()


@dataclass
class WireSamplingParams(SamplingParams):
    """SamplingParams plus the dtype q travels in (None / float32 = not rounded)."""

    q_wire_dtype: torch.dtype | None = None


class RoundedQModelDrafter(ModelDrafter):
    """ModelDrafter that draws from the wire-rounded q (see module doc) when params carry a rounded
    `q_wire_dtype`; `propose_many_raw` also returns the raw rounded rows to put on the wire."""

    def __init__(self, engine):
        super().__init__(engine)
        self._raw_rows: dict[int, list[torch.Tensor]] = {}  # id(generator) -> raw rows of this call

    def propose_many_raw(
        self,
        states: Sequence[ModelDraftState],
        accepted: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
    ) -> list[tuple[DraftProposal, torch.Tensor | None]]:
        """(proposal, raw [k, vocab] in the wire dtype or None) per session. The raw rows are exactly
        what `wire_to_q` turns into proposal.q."""
        self._raw_rows = {id(g): [] for g in generators}
        try:
            proposals = self.propose_many(states, accepted, max_tokens, params, generators)
            out = []
            for proposal, g, p in zip(proposals, generators, params):
                rows = self._raw_rows[id(g)]
                if rows:
                    raw = torch.stack(rows)
                elif proposal.q is not None:
                    raw = proposal.q.detach().cpu().to(_wire_dtype(p) or torch.float32)
                else:
                    raw = None
                out.append((proposal, raw))
            return out
        finally:
            self._raw_rows = {}

    def _draw(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
        wire_dtype = _wire_dtype(params)
        if params.is_greedy or wire_dtype is None:
            return ModelDrafter._draw(logits, params, generator)
        raw = processed_probs(logits, params)[0].to(wire_dtype).cpu()  # [vocab]
        self._raw_rows.setdefault(id(generator), []).append(raw)
        q = wire_to_q(raw).to(logits.device)
        return int(sample(q[None], generator)[0]), q


def _wire_dtype(params: SamplingParams) -> torch.dtype | None:
    dtype = getattr(params, "q_wire_dtype", None)
    return None if dtype in (None, torch.float32) else dtype
