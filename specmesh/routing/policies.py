"""The router protocol and the policies that need no measurement: random, round robin, JSQ(2).

JSQ(2), "the power of two choices" (Mitzenmacher 2001): sample two distinct healthy replicas at
random and send the session to the one with fewer in flight. With n replicas and n sessions the
busiest replica holds O(log log n) instead of random choice's O(log n / log log n), while each pick
reads two queue lengths, not all n (so stale or sampled queue lengths do not make every router
stampede to the same idle replica).

Worked example (seeded, so the two samples are known):
    >>> import random
    >>> a, b, c = Replica("a", num_in_flight=3), Replica("b", num_in_flight=1), Replica("c", num_in_flight=0)
    >>> [r.id for r in random.Random(4).sample([a, b, c], 2)]    # what JSQ2 samples with seed 4
    ['a', 'b']
    >>> JSQ2().pick([a, b, c], random.Random(4)).id    # the shorter of a (3) and b (1); c was not sampled
    'b'
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from specmesh.routing.replica import Replica, healthy_replicas


class Router(Protocol):
    """Chooses the replica for a new session. Pure: reads the replicas, draws only from `rng`.

    The hooks tell a policy what happened so it can learn (capacity, say); they do not change the
    replicas' counts or health, which `ReplicaSet` keeps. The defaults do nothing (an explicit
    `return None`, so that mypy does not take them for abstract methods a policy must override).
    """

    def pick(self, replicas: Sequence[Replica], rng: random.Random) -> Replica:
        """A healthy replica; raises NoHealthyReplica when none is."""
        ...

    def on_start(self, replica: Replica) -> None:
        """A session was opened on `replica`."""
        return None

    def on_finish(self, replica: Replica, latency_s: float, num_tokens: int = 1) -> None:
        """A session on `replica` ended well after `latency_s`, having produced `num_tokens`."""
        return None

    def on_failure(self, replica: Replica) -> None:
        """A call to `replica` failed in a way that indicts the replica (unreachable, UNAVAILABLE)."""
        return None

    def on_health(self, replica: Replica, healthy: bool) -> None:
        """A health check of `replica` passed (True) or failed (False)."""
        return None


class RandomChoice(Router):
    """Uniform over the healthy replicas: the baseline the others are measured against."""

    def pick(self, replicas: Sequence[Replica], rng: random.Random) -> Replica:
        return rng.choice(healthy_replicas(replicas))


class RoundRobin(Router):
    """Each replica in list order, skipping unhealthy ones; draws nothing from `rng`.

    The cursor is a position in the list, so a skipped replica gets its turn back as soon as it is
    healthy again.

    >>> import random
    >>> replicas = [Replica("a"), Replica("b", healthy=False), Replica("c")]
    >>> router, rng = RoundRobin(), random.Random(0)
    >>> [router.pick(replicas, rng).id for _ in range(3)]
    ['a', 'c', 'a']
    >>> replicas[1].healthy = True
    >>> [router.pick(replicas, rng).id for _ in range(3)]
    ['b', 'c', 'a']
    """

    def __init__(self) -> None:
        self._next = 0  # index in the replica list of the next replica to try

    def pick(self, replicas: Sequence[Replica], rng: random.Random) -> Replica:
        healthy_replicas(replicas)  # raises when none is healthy
        num_replicas = len(replicas)
        for offset in range(num_replicas):
            index = (self._next + offset) % num_replicas
            if replicas[index].healthy:
                self._next = (index + 1) % num_replicas
                return replicas[index]
        raise AssertionError("unreachable: a healthy replica exists")


class JSQ2(Router):
    """Join the shorter queue of two random healthy replicas (ties: the first sampled)."""

    def pick(self, replicas: Sequence[Replica], rng: random.Random) -> Replica:
        healthy = healthy_replicas(replicas)
        if len(healthy) == 1:
            return healthy[0]
        first, second = rng.sample(healthy, 2)
        return second if second.num_in_flight < first.num_in_flight else first
