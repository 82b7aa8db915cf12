"""The Coordinator, seen from the gateway: one channel, and a request's choices as one stream.

    upstream = CoordinatorUpstream(options)                   # in the serving loop
    choices = ChoiceStreams([upstream.generate(r, end_user="alice") for r in plan.requests])
    await choices.start()                                     # every choice answered once, or OpenAIError
    async for index, response in choices.events():            # GenerateResponses of all choices, as they come
        ...
    await choices.close()                                     # cancels what still runs (a client that left)

(Not `client.coordinator_client`'s CoordinatorClient / Generation: those are the Python client's, which
collect one generation for a user; these serve the HTTP side.)

The gateway calls with its own token as a trusted caller and names the user in `specmesh-end-user`,
so the Coordinator (and the services behind it) see `<gateway>/<user>`: sessions and quotas per user.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import OpenAIError, from_grpc
from gateway.options import GatewayOptions
from servicekit.auth import END_USER_KEY
from servicekit.channels import open_channel
from specmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

HEALTH_TIMEOUT_S = 2.0


class CoordinatorUpstream:
    """The gateway's channel to the Coordinator: Generate streams on behalf of users, health, stats."""

    def __init__(self, options: GatewayOptions):
        token = Path(options.coordinator_token_file).read_text().strip() if options.coordinator_token_file else ""
        self.address = options.coordinator
        self.timeout_s = options.request_timeout_s
        self.channel = open_channel(options.coordinator, tls_ca=options.coordinator_tls_ca, token=token,
                                    client_cert=options.coordinator_client_cert, client_key=options.coordinator_client_key)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._max_context: int | None = None

    def generate(self, request: coordinator_pb2.GenerateRequest, end_user: str = "") -> grpc.aio.UnaryStreamCall:
        metadata = ((END_USER_KEY, end_user),) if end_user else None
        return self.stub.Generate(request, timeout=self.timeout_s, metadata=metadata)

    async def serving(self) -> str:
        """The Coordinator's health status name (SERVING, NOT_SERVING, ...), or the error reaching it."""
        try:
            response = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def stats(self) -> coordinator_pb2.GetStatsResponse:
        try:
            return await self.stub.GetStats(coordinator_pb2.GetStatsRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from exc

    async def max_context(self) -> int | None:
        """The target's context length in tokens (prompt + generated), from the Coordinator's GetStats:
        asked until it answers once, then kept; None while it is unknown (the Coordinator unreachable,
        or one too old to say)."""
        if self._max_context is None:
            try:
                stats = await self.stats()
            except OpenAIError:
                return None
            self._max_context = stats.max_context_tokens or None
        return self._max_context

    async def close(self) -> None:
        await self.channel.close()


class ChoiceStreams:
    """A request's choices, one Coordinator stream each, merged into one stream of
    (choice index, GenerateResponse) in arrival order. A failed stream raises `OpenAIError` (its
    gRPC code mapped); an in-band `error_message` is a 500."""

    def __init__(self, calls: Iterable[grpc.aio.UnaryStreamCall]):
        self.calls = list(calls)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(index, call)) for index, call in enumerate(self.calls)]
        self._early: list[tuple[int, coordinator_pb2.GenerateResponse | None]] = []

    async def _pump(self, index: int, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            async for response in call:
                self._queue.put_nowait((index, response))
        except grpc.aio.AioRpcError as exc:
            self._queue.put_nowait((index, from_grpc(exc)))
        else:
            self._queue.put_nowait((index, None))  # this choice's stream ended

    async def _next(self) -> tuple[int, coordinator_pb2.GenerateResponse | None]:
        index, item = await self._queue.get()
        if isinstance(item, OpenAIError):
            raise item
        if item is not None and item.error_message:
            raise OpenAIError(500, f"coordinator: {item.error_message}")
        return index, item

    async def start(self) -> None:
        """Wait until every choice's stream has answered once (admitted, first tokens) or one failed:
        then the HTTP status is known before any byte is sent. On failure everything is cancelled."""
        waiting = set(range(len(self.calls)))
        try:
            while waiting:
                index, item = await self._next()
                waiting.discard(index)
                self._early.append((index, item))
        except BaseException:
            await self.close()
            raise

    async def events(self) -> AsyncIterator[tuple[int, coordinator_pb2.GenerateResponse]]:
        num_open = len(self.calls)
        early, self._early = self._early, []
        for index, item in early:
            if item is None:
                num_open -= 1
            else:
                yield index, item
        while num_open:
            index, item = await self._next()
            if item is None:
                num_open -= 1
            else:
                yield index, item

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
