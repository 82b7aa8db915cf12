"""The replicas of each downstream service, as the Coordinator sees them: a channel per replica, the
router of `specmesh.routing` choosing at session open, and a health checker that takes dead replicas
out and brings recovered ones back.

    pool = ServicePool("verify", ["127.0.0.1:50052", "127.0.0.1:50062"], "jsq2", open_channel_fn)
    pool.start_health_checks(interval_s=1.0)
    replica = pool.acquire()                     # NoHealthyReplica (-> UNAVAILABLE) when none is in
    stub = VerifyServiceStub(pool.channel(replica))
    pool.release(replica, latency_s, num_tokens) # or pool.fail(replica) when it died under us
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.routing.replica import Replica
from specmesh.routing.replica_set import ReplicaSet

log = logging.getLogger("specmesh.coordinator")
HEALTH_TIMEOUT_S = 1.0


def parse_addresses(text: str) -> list[str]:
    """'a:1, b:2' -> ['a:1', 'b:2'] (empty entries dropped)."""
    return [part.strip() for part in text.split(",") if part.strip()]


class ServicePool:
    def __init__(self, kind: str, addresses: Sequence[str], router: str, open_channel: Callable[[str], grpc.aio.Channel],
                 cooldown_s: float | None = 10.0):
        self.kind = kind
        self.replicas = ReplicaSet(list(addresses), router, cooldown_s=cooldown_s)
        self._channels = {address: open_channel(address) for address in addresses}
        self._health_task: asyncio.Task | None = None

    def __bool__(self) -> bool:
        return bool(self._channels)

    def channel(self, replica: Replica) -> grpc.aio.Channel:
        return self._channels[replica.id]

    def acquire(self) -> Replica:
        return self.replicas.acquire()

    def release(self, replica: Replica, latency_s: float, num_tokens: int) -> None:
        self.replicas.finish(replica, latency_s, max(1, num_tokens))

    def fail(self, replica: Replica) -> None:
        log.warning("%s replica %s failed; taking it out", self.kind, replica.id)
        self.replicas.fail(replica)

    async def check_health(self) -> None:
        """One health check of every replica (grpc.health.v1, the whole server)."""
        async def check(replica: Replica) -> None:
            try:
                response = await health_pb2_grpc.HealthStub(self._channels[replica.id]).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
                healthy = response.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                healthy = False
            if healthy != replica.healthy:
                log.info("%s replica %s is %s", self.kind, replica.id, "healthy again" if healthy else "not serving")
            self.replicas.set_health(replica, healthy)

        await asyncio.gather(*(check(r) for r in self.replicas.replicas))

    def start_health_checks(self, interval_s: float) -> None:
        async def loop() -> None:
            while True:
                await self.check_health()
                await asyncio.sleep(interval_s)

        if self._channels:
            self._health_task = asyncio.get_running_loop().create_task(loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))
