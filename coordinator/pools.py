"""The replicas of each downstream service, as the Coordinator sees them: a channel per replica, the
router of `specmesh.routing` choosing at session open, and a health checker that takes dead replicas
out and brings recovered ones back.

    pool = ServicePool("verify", ["127.0.0.1:50052", "127.0.0.1:50062"], "jsq2", open_channel_fn)
    pool.start_health_checks(interval_s=1.0)
    replica = pool.acquire()                     # NoHealthyReplica (-> UNAVAILABLE) when none is in
    stub = VerifyServiceStub(pool.channel(replica))
    pool.release(replica, latency_s, num_tokens) # or pool.fail(replica) when it died under us

Replicas that come and go. An address may be `dns:///name:port` or `ray:kind` (`coordinator.discovery`);
then the pool re-reads that source every `discovery_interval_s` (the health-check interval when not
given) and applies `specmesh.routing.discovery.plan_refresh`: a new replica joins pending (not
routed) and is health-checked at once, routed from its first passing check; a replica gone from the
answer is drained: out of routing, its channel kept while sessions it holds go on (or fail over, as
any failure does), closed when the last one ends. The answer at start (read in the constructor) is
trusted at once, as a static list always was: requests may come before the first health check.
The `ReplicaSet` is rebuilt on each change with the same router, so routing state (a round-robin
cursor, measured capacities) carries over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.discovery import DiscoverySource, source_for
from servicekit.engine_thread import run_aside
from specmesh.routing.discovery import DiscoveryPlan, plan_refresh
from specmesh.routing.replica import Replica
from specmesh.routing.replica_set import ReplicaSet

log = logging.getLogger("specmesh.coordinator")
HEALTH_TIMEOUT_S = 1.0


def parse_addresses(text: str) -> list[str]:
    """'a:1, b:2' -> ['a:1', 'b:2'] (empty entries dropped)."""
    return [part.strip() for part in text.split(",") if part.strip()]


class ServicePool:
    def __init__(self, kind: str, addresses: Sequence[str], router: str, open_channel: Callable[[str], grpc.aio.Channel],
                 cooldown_s: float | None = 10.0, *, source: DiscoverySource | None = None,
                 discovery_interval_s: float | None = None):
        self.kind = kind
        self.source = source if source is not None else source_for(addresses)
        self.discovery_interval_s = discovery_interval_s  # None: with each health check
        self._open_channel = open_channel
        self._draining: dict[str, Replica] = {}  # gone from the source, sessions still open on them
        self._closing: set[asyncio.Future] = set()
        self._tasks: list[asyncio.Task] = []
        self.num_readmissions: dict[str, int] = {}  # replica id -> health checks that found it back after it was out
        try:
            initial = self.source.resolve()
        except Exception as exc:  # noqa: BLE001 - a source that is not up yet: the refresh loop retries
            log.warning("%s discovery failed at start (%s); retrying while serving", kind, exc)
            initial = []
        # the answer at start is trusted at once, like a static list (a dead one fails over and goes out at the
        # first health check); replicas discovered later wait for a passing health check
        self.replicas = ReplicaSet(initial, router, cooldown_s=cooldown_s)
        self._channels = {replica.id: open_channel(replica.id) for replica in self.replicas.replicas}

    def __bool__(self) -> bool:
        """Configured with replicas: a static list that is not empty, or any discovery source."""
        return bool(self._channels) or self.source.dynamic

    def channel(self, replica: Replica) -> grpc.aio.Channel:
        return self._channels[replica.id]

    def acquire(self) -> Replica:
        return self.replicas.acquire()

    def release(self, replica: Replica, latency_s: float, num_tokens: int) -> None:
        self.replicas.finish(replica, latency_s, max(1, num_tokens))
        self._forget_drained()

    def fail(self, replica: Replica) -> None:
        log.warning("%s replica %s failed; taking it out", self.kind, replica.id)
        self.replicas.fail(replica)
        self._forget_drained()

    @property
    def draining(self) -> list[Replica]:
        """Replicas gone from the source with sessions still open on them."""
        return list(self._draining.values())

    async def refresh(self) -> DiscoveryPlan:
        """Read the source once and apply its answer; a failed read changes nothing."""
        try:
            answer = await run_aside(self.source.resolve)
        except Exception as exc:  # noqa: BLE001 - any lookup failure (DNS, Ray): keep the replicas as they are
            log.warning("%s discovery failed (%s); keeping %d replica(s)", self.kind, exc, len(self.replicas.replicas))
            return DiscoveryPlan()
        return await self.apply(answer)

    async def apply(self, answer: Sequence[str]) -> DiscoveryPlan:
        """Add, restore and drain replicas as `plan_refresh` says; newcomers are health-checked at once."""
        plan = plan_refresh([r.id for r in self.replicas.replicas], self._draining, answer)
        if plan.is_empty:
            return plan
        gone = set(plan.to_drain)
        kept = [r for r in self.replicas.replicas if r.id not in gone]
        for address in plan.to_drain:
            replica = self.replicas.get(address)
            self._draining[address] = replica
            log.info("%s replica %s left discovery: drained (%d session(s) still on it)", self.kind, address,
                     replica.num_in_flight)
        joining = [self._draining.pop(address) for address in plan.to_restore]
        for address in plan.to_add:
            joining.append(Replica(address))
            self._channels[address] = self._open_channel(address)
            log.info("%s replica %s discovered; health-checking it", self.kind, address)
        for replica in joining:  # pending: out until a health check passes (not re-admitted by cool-down)
            replica.healthy, replica.last_failure_s = False, None
        old = self.replicas
        self.replicas = ReplicaSet([*kept, *joining], old.router, rng=old.rng, cooldown_s=old.cooldown_s, clock=old.clock)
        self._forget_drained()
        await self._check_each(joining)
        return plan

    def _forget_drained(self) -> None:
        """Close the channels of drained replicas no session uses any more."""
        for address, replica in list(self._draining.items()):
            if replica.num_in_flight == 0:
                del self._draining[address]
                closing = asyncio.ensure_future(self._channels.pop(address).close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)

    async def check_health(self) -> None:
        """One health check of every replica (grpc.health.v1, the whole server)."""
        await self._check_each(self.replicas.replicas)

    async def _check_each(self, replicas: Sequence[Replica]) -> None:
        async def check(replica: Replica) -> None:
            channel = self._channels.get(replica.id)
            if channel is None:  # drained and forgotten meanwhile
                return
            try:
                response = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
                healthy = response.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                healthy = False
            if healthy != replica.healthy:
                log.info("%s replica %s is %s", self.kind, replica.id, "healthy again" if healthy else "not serving")
                if healthy:
                    self.num_readmissions[replica.id] = self.num_readmissions.get(replica.id, 0) + 1
            self.replicas.set_health(replica, healthy)

        await asyncio.gather(*(check(r) for r in replicas))

    def start_health_checks(self, interval_s: float) -> None:
        """Health checks every `interval_s`, and for a discovery source its refreshes (every
        `discovery_interval_s`, else with the health checks)."""
        async def every(interval_s: float, work: Callable[[], Awaitable[object]]) -> None:
            while True:
                await work()
                await asyncio.sleep(interval_s)

        loop = asyncio.get_running_loop()
        if self._channels or self.source.dynamic:
            self._tasks.append(loop.create_task(every(interval_s, self.check_health)))
        if self.source.dynamic:
            self._tasks.append(loop.create_task(every(self.discovery_interval_s or interval_s, self.refresh)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._closing, return_exceptions=True)
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))
