"""Optimal stopping over the remaining stages of a cascade, by dynamic programming.

Glossary (stages 0..N-1 in increasing cost; N-1 is the final stage, the target):
    chunk          the tokens a stage hands up in one step
    a_i            P(stage i+1 agrees with stage i's whole chunk), i = 0..N-2
    cost c_i       what running stage i on one chunk costs, in target-forward equivalents (one forward
                   of the final stage = 1.0; measured, see `training.py`)
    quality loss   P(the final stage would disagree with the chunk we emit). Stopping at stage s emits
                   stage s's chunk; it survives to the final stage iff every stage from s up agrees:
                       loss(s) = 1 - a_s * a_{s+1} * ... * a_{N-2}      (loss(N-1) = 0)
                   The product runs from s UP to the final stage. (The reference design's error: a
                   product from stage 0 up to s, which is 1 for s = 0, so it always stops at stage 0.)
    lambda         how many target-forward equivalents one expected disagreement is worth:
                   minimise  expected cost still to pay + lambda * expected quality loss.
                   lambda = 0: never pay, stop at once; lambda = inf: always the final stage (lossless,
                   exactly the lossless pipeline, whatever the probabilities say).

At stage j, a_j is known (predicted from the chunk's features); a later stage's a_i is not yet, since
its chunk does not exist: it is a random variable described by an `Outlook` (values with weights;
a point mass at the stage's observed rate by default), independent across stages. Once stage i has
run, a_i becomes known and the policy decides again. Bellman recursion, with m_i = E[a_i] and
M_i = m_i * ... * m_{N-2} (M_{N-1} = 1):
    W_i(a)  = min( lambda * (1 - a * M_{i+1}),  c_{i+1} + U_{i+1} )      value at stage i knowing a_i = a
    U_i     = E over a ~ Outlook_i of W_i(a)        (U_{N-1} = 0: the final stage stops, loss 0)
Ties stop (equal value, fewer forwards spent). `tests/unit/test_cascade_adaptive.py` checks this
against brute force over every (history-dependent) stopping policy.

Worked example: 3 stages, c = [0.1, 0.3, 1.0], a_0 = 0.9, stage 1's outlook a point mass at 0.8:
    loss(0) = 1 - 0.9 * 0.8 = 0.28,  loss(1) = 1 - 0.8 = 0.2,  loss(2) = 0
    lambda = 2:  at 1: min(2 * 0.2 = 0.4, 1.0 + 0) = 0.4 (stop);  at 0: min(0.56, 0.3 + 0.4 = 0.7) -> stop at 0
    lambda = 4:  at 1: min(0.8, 1.0) = 0.8 (stop);                at 0: min(1.12, 0.3 + 0.8 = 1.1) -> go on, stop at 1
    lambda = 10: at 1: min(2.0, 1.0) = 1.0 (go on);               at 0: min(2.8, 0.3 + 1.0 = 1.3) -> the final stage
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Outlook:
    """The distribution of a not-yet-run stage's agreement probability a_i."""

    values: tuple[float, ...]  # possible a_i
    weights: tuple[float, ...]  # their probabilities, summing to 1

    def __post_init__(self) -> None:
        if not self.values or len(self.values) != len(self.weights):
            raise ValueError("an outlook needs as many weights as values, at least one")
        if not all(0.0 <= v <= 1.0 for v in self.values) or not all(w >= 0.0 for w in self.weights):
            raise ValueError("outlook values lie in [0, 1] and weights are >= 0")
        if abs(sum(self.weights) - 1.0) > 1e-9:
            raise ValueError(f"outlook weights sum to {sum(self.weights)}, not 1")

    @classmethod
    def point(cls, value: float) -> Outlook:
        return cls((value,), (1.0,))

    @property
    def mean(self) -> float:
        return sum(v * w for v, w in zip(self.values, self.weights))


@dataclass
class StopDecision:
    stage: int  # where the decision was taken
    stop: bool  # True: emit this stage's chunk; False: run stage + 1
    stop_value: float  # lambda * expected loss of stopping here
    continue_value: float  # expected cost + lambda * loss of going on optimally (inf at the final stage)
    agree_prob: float  # a_stage used (nan at the final stage)
    expected_loss: float  # P(final disagrees) if stopping here


def stop_value(lam: float, loss: float) -> float:
    """lambda * loss, with lambda = inf meaning "never stop short of the final stage" even at loss 0."""
    if math.isinf(lam):
        return math.inf
    return lam * loss


def _check(stage: int, stage_costs: Sequence[float], outlooks: Sequence[Outlook], lam: float) -> int:
    num_stages = len(stage_costs)
    if num_stages < 2:
        raise ValueError("a cascade has at least 2 stages")
    if not all(math.isfinite(c) and c >= 0 for c in stage_costs):
        raise ValueError(f"stage costs must be finite and >= 0, got {list(stage_costs)}")
    if math.isnan(lam) or lam < 0:
        raise ValueError(f"lambda must be >= 0 (inf = lossless), got {lam}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range 0..{num_stages - 1}")
    if len(outlooks) != max(num_stages - 2 - stage, 0):
        raise ValueError(f"at stage {stage} of {num_stages}, expected outlooks for stages {stage + 1}..{num_stages - 2}, "
                         f"got {len(outlooks)}")
    return num_stages


def continuation_values(stage: int, stage_costs: Sequence[float], outlooks: Sequence[Outlook], lam: float) -> tuple[float, float]:
    """(c_{stage+1} + U_{stage+1}, M_{stage+1}) for a decision at `stage` < N-1.

    outlooks[k] describes a_{stage+1+k} (stages stage+1 .. N-2).
    """
    num_stages = len(stage_costs)
    means = [o.mean for o in outlooks]
    tail = [1.0] * (len(outlooks) + 1)  # tail[k] = M_{stage+1+k}
    for k in range(len(outlooks) - 1, -1, -1):
        tail[k] = means[k] * tail[k + 1]
    future = 0.0  # U_{N-1}
    for k in range(len(outlooks) - 1, -1, -1):  # stage i = stage + 1 + k, from N-2 down
        i = stage + 1 + k
        go_on = stage_costs[i + 1] + future
        future = sum(w * min(stop_value(lam, 1.0 - v * tail[k + 1]), go_on)
                     for v, w in zip(outlooks[k].values, outlooks[k].weights))
    assert stage + 1 < num_stages
    return stage_costs[stage + 1] + future, tail[0]


def decide(stage: int, agree_prob: float, stage_costs: Sequence[float], outlooks: Sequence[Outlook], lam: float) -> StopDecision:
    """Stop at `stage` (whose chunk the next stage agrees with w.p. `agree_prob`) or go on?

    stage_costs: c_0..c_{N-1}; outlooks: for stages stage+1..N-2 (empty at N-2 and N-1).
    Example (the module's): decide(0, 0.9, [0.1, 0.3, 1.0], [Outlook.point(0.8)], 4.0).stop is False, and
    decide(1, 0.8, [0.1, 0.3, 1.0], [], 4.0).stop is True.
    """
    num_stages = _check(stage, stage_costs, outlooks, lam)
    if stage == num_stages - 1:
        return StopDecision(stage, True, 0.0, math.inf, math.nan, 0.0)
    if not 0.0 <= agree_prob <= 1.0:
        raise ValueError(f"agree_prob must lie in [0, 1], got {agree_prob}")
    go_on, tail = continuation_values(stage, stage_costs, outlooks, lam)
    loss = 1.0 - agree_prob * tail
    here = stop_value(lam, loss)
    return StopDecision(stage, here <= go_on, here, go_on, agree_prob, loss)


def plan_stop_stage(agree_probs: Sequence[float], stage_costs: Sequence[float], lam: float, start: int = 0) -> int:
    """Where the policy stops when every a_i is known in advance (point outlooks): a_0..a_{N-2}.

    Worked example (module docstring): plan_stop_stage([0.9, 0.8], [0.1, 0.3, 1.0], lam) is 0, 1, 2 for
    lam = 2, 4, 10.
    """
    if len(agree_probs) != len(stage_costs) - 1:
        raise ValueError(f"{len(agree_probs)} agreement probabilities for {len(stage_costs)} stages (want N-1)")
    stage = start
    while True:
        outlooks = [Outlook.point(a) for a in agree_probs[stage + 1:]]
        a = agree_probs[stage] if stage < len(agree_probs) else math.nan
        if decide(stage, a, stage_costs, outlooks, lam).stop:
            return stage
        stage += 1
