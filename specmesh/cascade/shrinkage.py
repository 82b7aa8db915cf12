"""Bayesian shrinkage of the predictor's P(agree) toward each stage's observed agreement rate.

Per decision stage j a Beta(alpha_j, beta_j) posterior over the stage's agreement rate:
    prior      alpha_0 = prior_strength * prior_rate,  beta_0 = prior_strength * (1 - prior_rate)
               (prior_rate: the training rows' rate for the stage, or 0.5 without one)
    observe    agreed: alpha += 1; disagreed: beta += 1
    rate r_j   = alpha_j / (alpha_j + beta_j)            the posterior mean

"Uncertain" is defined by how far the predictor's p is from a coin flip: its confidence
    c = |2 p - 1|  in [0, 1]   (0 at p = 0.5, 1 at p = 0 or 1)
The predictor's output counts as n_pred = predictor_weight * c pseudo-observations with mean p, and the
stage's rate as shrink_strength pseudo-observations with mean r_j; the shrunk probability is their
pooled mean:
    p_shrunk = (shrink_strength * r_j + n_pred * p) / (shrink_strength + n_pred)
so p = 0.5 (no information) returns r_j exactly, and a confident p keeps at most
predictor_weight / (predictor_weight + shrink_strength) of its own weight (16 / 20 = 0.8 by default).
shrink_strength is fixed rather than alpha + beta: many observations make r_j more certain, but r_j is
still a per-stage average and must not drown the per-chunk signal.

Worked example (defaults: prior_strength 2, shrink_strength 4, predictor_weight 16), stage 0 with no
prior rate, then 8 agreements and 2 disagreements:
    alpha = 1 + 8 = 9, beta = 1 + 2 = 3, r = 9 / 12 = 0.75
    p = 0.9: c = 0.8, n_pred = 12.8, p_shrunk = (4 * 0.75 + 12.8 * 0.9) / 16.8 = 14.52 / 16.8 = 0.864286
    p = 0.6: c = 0.2, n_pred = 3.2,  p_shrunk = (3 + 1.92) / 7.2 = 0.683333
    p = 0.5: c = 0,   n_pred = 0,    p_shrunk = 0.75
Observations only exist for chunks that went on to the next stage (stopping hides the answer), so
the rates lean toward the chunks the policy found hard; see `policy.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class BetaPosterior:
    alpha: float
    beta: float

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    @property
    def num_observations(self) -> float:
        return self.alpha + self.beta


class StageShrinkage:
    """One Beta posterior per decision stage. Not thread-safe: one engine thread updates it."""

    def __init__(self, num_decision_stages: int, prior_rates: Sequence[float] | None = None, prior_strength: float = 2.0,
                 shrink_strength: float = 4.0, predictor_weight: float = 16.0):
        rates = list(prior_rates) if prior_rates is not None else [0.5] * num_decision_stages
        if len(rates) != num_decision_stages:
            raise ValueError(f"{len(rates)} prior rates for {num_decision_stages} decision stages")
        if not all(0.0 < r < 1.0 for r in rates):
            raise ValueError(f"prior rates must lie strictly between 0 and 1, got {rates}")
        if prior_strength <= 0 or shrink_strength <= 0 or predictor_weight < 0:
            raise ValueError("prior_strength and shrink_strength must be > 0, predictor_weight >= 0")
        self.posteriors = [BetaPosterior(prior_strength * r, prior_strength * (1 - r)) for r in rates]
        self.shrink_strength = shrink_strength
        self.predictor_weight = predictor_weight

    def _posterior(self, stage: int) -> BetaPosterior:
        if not 0 <= stage < len(self.posteriors):
            raise ValueError(f"stage {stage} is not a decision stage (0..{len(self.posteriors) - 1})")
        return self.posteriors[stage]

    def observe(self, stage: int, agreed: bool) -> None:
        posterior = self._posterior(stage)
        if agreed:
            posterior.alpha += 1.0
        else:
            posterior.beta += 1.0

    def rate(self, stage: int) -> float:
        return self._posterior(stage).mean

    def shrink(self, stage: int, predicted: float) -> float:
        if not 0.0 <= predicted <= 1.0:
            raise ValueError(f"a probability lies in [0, 1], got {predicted}")
        num_predictor = self.predictor_weight * abs(2.0 * predicted - 1.0)
        return (self.shrink_strength * self.rate(stage) + num_predictor * predicted) / (self.shrink_strength + num_predictor)
