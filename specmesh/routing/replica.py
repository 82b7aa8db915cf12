"""What a router sees of one replica, and the error when no replica can take a session."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class NoHealthyReplica(RuntimeError):
    """Every replica is unhealthy (or there is none); the Coordinator maps it to UNAVAILABLE."""


@dataclass(eq=False)
class Replica:
    """One replica of a service. `ReplicaSet` keeps these fields current; policies only read them.

    Compared by identity: two replicas with the same counts are still different machines.
    """

    id: str  # the address ("host:port") live; any unique name in the simulator
    weight: float = 1.0  # relative capacity from config (3.0: three times a 1.0 replica); a prior for measured weights
    num_in_flight: int = 0  # sessions routed here and not yet finished: the queue length JSQ compares
    healthy: bool = True  # may receive new sessions
    last_failure_s: float | None = None  # clock time of the last bad signal (failed call or failing health check)

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"replica {self.id!r}: weight must be > 0, got {self.weight}")


def healthy_replicas(replicas: Sequence[Replica]) -> list[Replica]:
    """The healthy ones, in order; raises NoHealthyReplica when there is none.

    >>> [r.id for r in healthy_replicas([Replica("a", healthy=False), Replica("b")])]
    ['b']
    >>> healthy_replicas([Replica("a", healthy=False)])
    Traceback (most recent call last):
    ...
    specmesh.routing.replica.NoHealthyReplica: none of 1 replicas is healthy: ['a']
    """
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise NoHealthyReplica(f"none of {len(replicas)} replicas is healthy: {[r.id for r in replicas]}")
    return healthy
