"""The replicas of one service: in-flight counts, health, and the router that picks among them.

Health rule. A replica is out (`healthy` False, skipped by every policy) from its last bad signal:
a failed call reported with `fail`, or a failing health check reported with `set_health(r, False)`.
It is back in at the first of
  - a passing health check, `set_health(r, True)`;
  - `cooldown_s` seconds of the clock with no new bad signal (checked at each `pick`), after which
    it gets sessions again; a failure sends it out for another `cooldown_s`.
With a health checker polling more often than `cooldown_s`, a replica that stays down stays out;
`cooldown_s=None` leaves re-admission to health checks alone. Report with `fail` only what indicts
the replica (unreachable, UNAVAILABLE), not a client's bad request.

Worked example (a fake clock: the simulator passes its virtual time, the Coordinator the default
`time.monotonic`):
    >>> import random
    >>> now_s = [0.0]
    >>> rs = ReplicaSet(["a:1", "b:2"], "round_robin", rng=random.Random(0), cooldown_s=5.0, clock=lambda: now_s[0])
    >>> a = rs.acquire(); b = rs.acquire(); (a.id, b.id, a.num_in_flight)
    ('a:1', 'b:2', 1)
    >>> rs.fail(a)                     # a's session failed: a is out, b takes every session
    >>> [rs.acquire().id for _ in range(2)], a.num_in_flight, b.num_in_flight
    (['b:2', 'b:2'], 0, 3)
    >>> now_s[0] = 5.0                 # cool-down over: a is back in
    >>> rs.pick().id
    'a:1'
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable

from specmesh.routing.policies import Router
from specmesh.routing.registry import make_router
from specmesh.routing.replica import Replica


class ReplicaSet:
    """Keeps `Replica` fields current and tells the router; not thread-safe (one event loop or sim).

    `rng` defaults to an OS-seeded generator so that several Coordinators do not sample alike; pass
    a seeded one for reproducible runs.
    """

    def __init__(
        self,
        replicas: Iterable[Replica | str],
        router: Router | str = "round_robin",
        *,
        rng: random.Random | None = None,
        cooldown_s: float | None = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.replicas = [r if isinstance(r, Replica) else Replica(r) for r in replicas]
        ids = [r.id for r in self.replicas]
        if len(set(ids)) != len(ids):
            raise ValueError(f"replica ids must be unique, got {ids}")
        if cooldown_s is not None and cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0 or None, got {cooldown_s}")
        self.router = make_router(router) if isinstance(router, str) else router
        self.rng = rng if rng is not None else random.Random()
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._by_id = {r.id: r for r in self.replicas}

    def get(self, replica_id: str) -> Replica:
        return self._by_id[replica_id]

    def pick(self) -> Replica:
        """The router's choice among the replicas in now; raises NoHealthyReplica. Counts nothing."""
        self._readmit_cooled_down()
        return self.router.pick(self.replicas, self.rng)

    def acquire(self) -> Replica:
        """`pick` and `start`: the replica for a new session, counted in flight."""
        replica = self.pick()
        self.start(replica)
        return replica

    def start(self, replica: Replica) -> None:
        replica.num_in_flight += 1
        self.router.on_start(replica)

    def finish(self, replica: Replica, latency_s: float, num_tokens: int = 1) -> None:
        """A session ended well after `latency_s` wall seconds with `num_tokens` generated."""
        self._end(replica)
        self.router.on_finish(replica, latency_s, num_tokens)

    def release(self, replica: Replica) -> None:
        """A session ended without a measurement to learn from (refused, cancelled early)."""
        self._end(replica)

    def fail(self, replica: Replica) -> None:
        """A session ended because the replica failed: it leaves the in-flight count and goes out."""
        self._end(replica)
        replica.healthy = False
        replica.last_failure_s = self.clock()
        self.router.on_failure(replica)

    def set_health(self, replica: Replica, healthy: bool) -> None:
        """A health check's verdict: True brings the replica back in at once, False sends it out."""
        replica.healthy = healthy
        if not healthy:
            replica.last_failure_s = self.clock()
        self.router.on_health(replica, healthy)

    def _end(self, replica: Replica) -> None:
        if replica.num_in_flight < 1:
            raise ValueError(f"replica {replica.id!r} has no session in flight to end")
        replica.num_in_flight -= 1

    def _readmit_cooled_down(self) -> None:
        if self.cooldown_s is None:
            return
        now_s = self.clock()
        for replica in self.replicas:
            if not replica.healthy and replica.last_failure_s is not None and now_s - replica.last_failure_s >= self.cooldown_s:
                replica.healthy = True
