"""Server bootstrap shared by the services: grpc.aio server with health, reflection, TLS, limits.

    handle = await start_service(options, metrics, [(add_fn, servicer, "specmesh.v1.VerifyService")])
    ... handle.port, handle.metrics_port ...
    await handle.stop()
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from servicekit.metrics import ServiceMetrics
from servicekit.options import ServerOptions

log = logging.getLogger("specmesh.services")


@dataclass
class ServiceHandle:
    """A started service. `servicer` is exposed for tests and benchmarks (engine counters)."""

    server: grpc.aio.Server
    port: int
    servicer: Any
    health: Any
    metrics_port: int | None = None
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    _metrics_server: Any = None

    async def stop(self, grace_s: float | None = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        for hook in self.on_stop:
            await hook()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def server_options(max_message_mb: int) -> list[tuple[str, int]]:
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


async def start_service(
    options: ServerOptions,
    metrics: ServiceMetrics,
    servicer: Any,
    registrations: Sequence[tuple[Callable, str]],  # (add_XServicer_to_server, full service name)
    on_stop: Sequence[Callable[[], Awaitable[None]]] = (),
) -> ServiceHandle:
    server = grpc.aio.server(options=server_options(options.max_message_mb))
    names = []
    for add, name in registrations:
        add(servicer, server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{options.host}:{options.port}"
    if bool(options.tls_cert) != bool(options.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    if options.tls_cert:
        credentials = grpc.ssl_server_credentials([(Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())])
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    for name in ["", *names]:  # the model is loaded before start_service: serving right away
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    handle = ServiceHandle(server, port, servicer, health_servicer, on_stop=list(on_stop))
    if options.metrics_port >= 0:
        handle._metrics_server, handle.metrics_port = metrics.serve(options.host, options.metrics_port)
    return handle


def serve_main(
    options_cls: type,
    create_server: Callable[[Any], Awaitable[tuple[ServiceHandle, int]]],
    argv: Sequence[str] | None,
    description: str,
    label: Callable[[Any], str],
) -> int:
    """The whole `main` of a service: parse flags / YAML into `options_cls`, start the server, print
    "<label> listening on host:port[, metrics on :port]", serve until SIGINT/SIGTERM, stop cleanly."""
    from servicekit.options import parse_options

    options = parse_options(options_cls, argv, description)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def serve() -> None:
        handle = (await create_server(options))[0]
        metrics = f", metrics on :{handle.metrics_port}" if handle.metrics_port else ""
        print(f"{label(options)} listening on {options.host}:{handle.port}{metrics}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await handle.stop()

    asyncio.run(serve())
    return 0
