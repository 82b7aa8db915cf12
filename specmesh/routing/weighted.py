"""Weighted join-shortest-queue, with each replica's weight measured while it serves.

A replica's *capacity* is the tokens per second one session on it sees: 1 / (an exponentially
weighted moving average of `latency_s / num_tokens` over the sessions it finished, `on_finish`).
Seconds are averaged, not rates: a rate is 1 / time, and one very short session would swamp an
average of rates. The capacity is low for a weaker device and also for an overloaded one, so the
policy steers away from a replica that is slow for any reason. A replica not measured yet gets a
prior: its configured `weight` times the measured fleet's capacity per unit of weight (the mean of
capacity / weight over the measured replicas); with nothing measured, the configured weights.

Worked example: a and b (weight 1) measured at 30 and 90 tok/s, c (weight 2) not yet measured:
    capacity per unit weight = mean(30 / 1, 90 / 1) = 60  ->  c: 2 * 60 = 120 tok/s

    >>> est = CapacityEstimator(ema_weight=0.5)
    >>> a, b, c = Replica("a"), Replica("b"), Replica("c", weight=2.0)
    >>> est.observe(a, latency_s=1.0, num_tokens=30); est.observe(b, latency_s=1.0, num_tokens=90)
    >>> [round(x, 6) for x in est.capacities([a, b, c])]
    [30.0, 90.0, 120.0]
    >>> est.observe(b, latency_s=0.5, num_tokens=10)    # mean of 1/90 and 1/20 s per token: 0.030556
    >>> round(est.capacity(b), 2)
    32.73

The policy sends a new session to the healthy replica with the least `(num_in_flight + 1) /
capacity`: the load it would have with the new session, per unit of capacity. The `+ 1` breaks the
tie between idle replicas toward the faster one; sessions that stay open fill replicas in
proportion to capacity (3 : 1 for a replica three times as fast; see the tests). Queues follow the
weights, so noise in the measurement becomes imbalance: report each session's tokens with its time
(a session's wall time alone varies with its length, not with the replica).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from specmesh.routing.policies import Router
from specmesh.routing.replica import Replica, healthy_replicas


class CapacityEstimator:
    """Per replica id: tokens per second one session saw, from an EWMA of seconds per token."""

    def __init__(self, ema_weight: float = 0.2):
        if not 0 < ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {ema_weight}")
        self.ema_weight = ema_weight  # weight of the newest observation
        self._s_per_token: dict[str, float] = {}

    def observe(self, replica: Replica, latency_s: float, num_tokens: int = 1) -> None:
        if latency_s <= 0 or num_tokens < 1:  # a coarse clock, or nothing produced: nothing learned
            return
        new = latency_s / num_tokens
        old = self._s_per_token.get(replica.id)
        self._s_per_token[replica.id] = new if old is None else old + self.ema_weight * (new - old)

    def capacity(self, replica: Replica) -> float | None:
        """The measured capacity in tokens/s, or None before the first observation."""
        s_per_token = self._s_per_token.get(replica.id)
        return None if s_per_token is None else 1.0 / s_per_token

    def capacities(self, replicas: Sequence[Replica]) -> list[float]:
        """Measured capacity, or the prior from the measured ones among `replicas`."""
        measured = [self.capacity(r) for r in replicas]
        per_weight = [c / r.weight for r, c in zip(replicas, measured) if c is not None]
        scale = sum(per_weight) / len(per_weight) if per_weight else 1.0
        return [c if c is not None else r.weight * scale for r, c in zip(replicas, measured)]


class WeightedJSQ(Router):
    """Least `(num_in_flight + 1) / capacity` among healthy replicas; ties broken by `rng`.

    `num_choices=None` compares every healthy replica. With `num_choices=d` it compares d distinct
    replicas sampled in proportion to capacity (weighted JSQ(d): O(d) per pick and no stampede of
    many routers onto one replica; sampling by capacity keeps a large replica from being capped at
    d / n of the sessions).
    """

    def __init__(self, ema_weight: float = 0.2, num_choices: int | None = None):
        if num_choices is not None and num_choices < 1:
            raise ValueError(f"num_choices must be >= 1 or None, got {num_choices}")
        self.num_choices = num_choices
        self.estimator = CapacityEstimator(ema_weight)

    def pick(self, replicas: Sequence[Replica], rng: random.Random) -> Replica:
        healthy = healthy_replicas(replicas)
        capacities = self.estimator.capacities(healthy)
        candidates = list(range(len(healthy)))
        if self.num_choices is not None and self.num_choices < len(healthy):
            candidates = _sample_weighted(candidates, capacities, self.num_choices, rng)
        scores = [(healthy[i].num_in_flight + 1) / capacities[i] for i in candidates]
        best = min(scores)
        ties = [i for i, score in zip(candidates, scores) if score == best]
        return healthy[ties[0] if len(ties) == 1 else rng.choice(ties)]

    def on_finish(self, replica: Replica, latency_s: float, num_tokens: int = 1) -> None:
        self.estimator.observe(replica, latency_s, num_tokens)


def _sample_weighted(items: list[int], weights: list[float], num_samples: int, rng: random.Random) -> list[int]:
    """`num_samples` distinct items, each draw in proportion to weight among those not drawn yet."""
    items, weights = list(items), list(weights)
    chosen = []
    for _ in range(num_samples):
        (index,) = rng.choices(range(len(items)), weights)
        chosen.append(items.pop(index))
        weights.pop(index)
    return chosen
