"""AdaptiveStopper: the adaptive (lossy, opt-in) cascade's per-chunk decision, for the pipeline to call.

Interface (stages 0..N-1, N-1 the final stage; one stopper per served cascade, one engine thread):

    stopper = AdaptiveStopper(predictor, stage_costs=[c_0, ..., c_{N-1}], lam=4.0)   # or .from_file(...)
    features = stopper.new_session(num_prompt_tokens)             # one per generation
    # stage j produced `out: StageOutput` for the chunk (its first `n` proposal tokens):
    x = features.chunk(j, out.features[:n], num_draft_tokens, out.num_accepted, num_generated_tokens)
    decision = stopper.decide(j, x, lam=request_lambda)           # lam=None: the stopper's default
    if decision.stop:  emit the chunk; report "stopped at j", decision.expected_loss, lossy
    else:              run stage j+1 on the chunk; when it has verified it:
                       stopper.observe(j, agreed=stage j+1 accepted the whole chunk)

- `decide(N-1, ...)` always stops (the final stage is never disagreed with); lam = inf never stops
  short of it, so lam = inf is exactly the lossless pipeline; lam = 0 stops at once.
- P(stage j+1 agrees) = shrinkage.shrink(j, predictor(x)); later stages' agreement is their observed
  rate (a point `Outlook`); the decision is `stopping.decide` (Bellman recursion, see stopping.py).
- `observe` is only called for chunks that went on, so the rates are measured on chunks the policy
  found doubtful: they lean pessimistic, which errs toward running more stages, i.e. toward lossless.
- stage_costs are per chunk in target-forward equivalents for the pipeline's own schedule; a predictor
  file carries measured per-forward costs (`predictor.info.stage_forward_costs`) to derive them from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from specmesh.cascade.features import SessionFeatures
from specmesh.cascade.identity import StageIdentity
from specmesh.cascade.predictor import AgreementPredictor
from specmesh.cascade.shrinkage import StageShrinkage
from specmesh.cascade.stopping import Outlook, StopDecision, decide


class AdaptiveStopper:
    def __init__(self, predictor: AgreementPredictor, stage_costs: Sequence[float], lam: float,
                 shrinkage: StageShrinkage | None = None):
        num_stages = predictor.schema.num_stages
        if len(stage_costs) != num_stages:
            raise ValueError(f"{len(stage_costs)} stage costs for a {num_stages}-stage predictor")
        if math.isnan(lam) or lam < 0:
            raise ValueError(f"lambda must be >= 0 (inf = lossless), got {lam}")
        self.predictor = predictor
        self.stage_costs = [float(c) for c in stage_costs]
        self.lam = lam
        rates = predictor.info.stage_agreement_rates or None
        self.shrinkage = shrinkage or StageShrinkage(predictor.schema.num_decision_stages, _open_interval(rates))

    @classmethod
    def from_file(cls, path: str | Path, stages: Sequence[StageIdentity], stage_costs: Sequence[float],
                  lam: float) -> AdaptiveStopper:
        """Load a predictor trained for exactly `stages` (else PredictorMismatchError)."""
        return cls(AgreementPredictor.load(path, expected_stages=stages), stage_costs, lam)

    @property
    def num_stages(self) -> int:
        return self.predictor.schema.num_stages

    def new_session(self, num_prompt_tokens: int) -> SessionFeatures:
        return SessionFeatures(self.predictor.schema, num_prompt_tokens)

    def agree_prob(self, stage: int, features: Sequence[float]) -> float:
        """P(stage + 1 agrees with this chunk): the predictor's, shrunk toward the stage's rate."""
        return self.shrinkage.shrink(stage, self.predictor.predict_one(features))

    def decide(self, stage: int, features: Sequence[float], lam: float | None = None) -> StopDecision:
        lam = self.lam if lam is None else lam
        if stage == self.num_stages - 1:
            return decide(stage, math.nan, self.stage_costs, [], lam)
        if math.isinf(lam) and lam > 0:  # lossless: no need to run the predictor
            return StopDecision(stage, False, math.inf, math.inf, math.nan, math.nan)
        outlooks = [Outlook.point(self.shrinkage.rate(i)) for i in range(stage + 1, self.num_stages - 1)]
        return decide(stage, self.agree_prob(stage, features), self.stage_costs, outlooks, lam)

    def observe(self, stage: int, agreed: bool) -> None:
        self.shrinkage.observe(stage, agreed)


def _open_interval(rates: list[float] | None, margin: float = 1e-3) -> list[float] | None:
    """Training rates of exactly 0 or 1 would make a degenerate Beta prior; keep them just inside."""
    return None if rates is None else [min(max(r, margin), 1.0 - margin) for r in rates]
