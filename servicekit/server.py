"""Server bootstrap shared by the services: grpc.aio server with health, reflection, TLS, auth, limits, drain.

    handle = await start_service(options, metrics, servicer, ["specmesh.v1.VerifyService"])
    ... handle.port, handle.metrics_port ...
    await handle.drain(options.drain_grace_s)   # or handle.stop()

Every method of a specmesh service is registered from its descriptor behind one wrapper (the "edge"),
which receives the request as raw bytes and, in this order:
1. authenticates the caller and sets the principal (`servicekit.auth`): UNAUTHENTICATED /
   PERMISSION_DENIED;
2. bounds the request size before parsing (`request_byte_limits`): a request that only carries token
   ids may be as large as the model's context allows, one carrying q tensors `--max-message-mb`.
   Parsing 60 MB of token ids blocks the event loop for seconds (health checks included), measuring
   the bytes does not. Too large: INVALID_ARGUMENT naming the limit;
3. parses: undecodable bytes are INVALID_ARGUMENT (grpc's own deserializer answers UNKNOWN);
4. calls the servicer's method, whose errors `servicekit.errors.rpc_method` maps.
Health stays open without credentials (load balancers), reflection answers on v1 and v1alpha.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from servicekit.auth import AuthPolicy, principal_scope
from servicekit.errors import message_for, status_for
from servicekit.metrics import ServiceMetrics
from servicekit.options import ServerOptions

log = logging.getLogger("specmesh.services")

TOKEN_ID_BYTES = 6  # a uint32 id takes at most 5 bytes packed; one spare
TOKEN_REQUEST_SLACK_BYTES = 64 * 1024  # session id, sampling params, stop strings
DRAIN_POLL_S = 0.05
REFLECTION_V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"


@dataclass
class ServiceHandle:
    """A started service. `servicer` is exposed for tests and benchmarks (engine counters)."""

    server: grpc.aio.Server
    port: int
    servicer: Any
    health: Any
    metrics_port: int | None = None
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    service_names: list[str] = field(default_factory=list)  # health names: "" and each service
    edge: Edge | None = None
    _metrics_server: Any = None
    _stopping: asyncio.Future | None = None

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop serving (running calls get `grace_s`). Idempotent; a second call with a shorter grace
        cuts the first one's short (grpc keeps the shorter)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace_s))
        else:
            await self.server.stop(grace_s)
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        for hook in self.on_stop:
            await hook()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()

    async def drain(self, grace_s: float) -> None:
        """Stop without failing open sessions: health NOT_SERVING (load balancers move new work away),
        new sessions UNAVAILABLE, then wait up to `grace_s` for the open sessions to close and the
        running calls to end, polling every DRAIN_POLL_S; then `stop()`."""
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if hasattr(self.servicer, "start_draining"):
            self.servicer.start_draining()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while loop.time() < deadline and self.busy():
            await asyncio.sleep(DRAIN_POLL_S)
        await self.stop()

    def busy(self) -> bool:
        """Open sessions or running calls (a Generate stream holds no session)."""
        num_calls = self.edge.num_calls if self.edge is not None else 0
        return bool(getattr(self.servicer, "num_sessions", 0) or num_calls)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def server_options(max_message_mb: int) -> list[tuple[str, int]]:
    """Message limits; and no SO_REUSEPORT (gRPC's default on Linux), so a port another server holds is
    a bind error, not two servers answering on one port, each for some of the connections."""
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
            ("grpc.so_reuseport", 0)]


def token_request_bytes(max_context: int) -> int:
    """The largest request that only carries token ids (at most a context's worth) can need."""
    return 16 + TOKEN_ID_BYTES * max_context + TOKEN_REQUEST_SLACK_BYTES


def _carries_bytes(message: Descriptor, seen: set[str] | None = None) -> bool:
    """Whether `message` or one nested in it has a bytes field (in specmesh: the q tensors)."""
    seen = set() if seen is None else seen
    seen.add(message.full_name)
    for f in message.fields:
        if f.type == FieldDescriptor.TYPE_BYTES:
            return True
        if f.message_type is not None and f.message_type.full_name not in seen and _carries_bytes(f.message_type, seen):
            return True
    return False


def service_max_context(servicer: Any) -> int | None:
    """The context window of the model behind `servicer` (its own `max_context`, else its engine's)."""
    for owner in (servicer, getattr(servicer, "engine", None)):
        value = getattr(owner, "max_context", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def request_byte_limits(service: ServiceDescriptor, servicer: Any, max_message_mb: int) -> dict[str, int]:
    """Per method: the largest request parsed. Requests carrying q tensors (bytes fields) get
    `max_message_mb`; the others `token_request_bytes(max_context)` (no more than the message limit)."""
    max_message_bytes = max_message_mb * 1024 * 1024
    max_context = service_max_context(servicer)
    token_bytes = max_message_bytes if max_context is None else min(token_request_bytes(max_context), max_message_bytes)
    return {m.name: max_message_bytes if _carries_bytes(m.input_type) else token_bytes for m in service.methods}


@dataclass
class Edge:
    """What the wrapped methods of one server share: who may call, and how many calls are running
    (`ServiceHandle.drain` waits for them)."""

    policy: AuthPolicy
    num_calls: int = 0

    def handler(self, servicer: Any, method: MethodDescriptor, max_request_bytes: int) -> grpc.RpcMethodHandler | None:
        """The method's handler over raw request bytes; None for one the servicer leaves to the
        generated base class (grpc then answers UNIMPLEMENTED)."""
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client-streaming methods are not supported")
        implementation = getattr(type(servicer), method.name, None)
        if implementation is None or implementation.__module__.endswith("_pb2_grpc"):
            return None
        call = getattr(servicer, method.name)
        request_cls = message_factory.GetMessageClass(method.input_type)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        metrics: ServiceMetrics | None = getattr(servicer, "metrics", None)
        path = f"{method.containing_service.full_name}/{method.name}"

        async def admit(raw: bytes, context: grpc.aio.ServicerContext) -> tuple[Any, str]:
            try:
                principal = self.policy.resolve(context.invocation_metadata() or (), context.auth_context())
                if len(raw) > max_request_bytes:
                    raise ValueError(f"request of {len(raw)} bytes is larger than the {max_request_bytes}-byte limit of {path}")
                try:
                    return request_cls.FromString(raw), principal
                except DecodeError as exc:
                    raise ValueError(f"undecodable {method.input_type.full_name}: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - auth errors and ValueError, mapped by status_for
                code = status_for(exc)
                if metrics is not None:
                    metrics.requests.labels(method.name, code.name).inc()
                await context.abort(code, message_for(exc, code))
                raise  # not reached: abort raises

        if method.server_streaming:
            if not inspect.isasyncgenfunction(call):
                raise TypeError(f"{path}: expected an async generator method")

            async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> None:
                request, principal = await admit(raw, context)
                self.num_calls += 1
                try:
                    # A coroutine that writes each response, not an async generator handed to grpc: grpc
                    # drops a generator at its `yield` when the client leaves (the call's task is cancelled
                    # while it sends), and the garbage collector finalizes it later in a task of its own,
                    # where resetting the principal fails ("created in a different Context") and the
                    # servicer's `finally` blocks (closing sessions downstream) run late. Here the
                    # cancellation lands in this task: the servicer's generator is closed (aclosing) and
                    # the principal reset now, in this call's context.
                    with principal_scope(principal):
                        async with aclosing(call(request, context)) as responses:
                            async for response in responses:
                                await context.write(response)
                finally:
                    self.num_calls -= 1

            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=serialize)
        if not inspect.iscoroutinefunction(call):
            raise TypeError(f"{path}: expected an async method")

        async def unary(raw: bytes, context: grpc.aio.ServicerContext):
            request, principal = await admit(raw, context)
            self.num_calls += 1
            try:
                with principal_scope(principal):
                    return await call(request, context)
            finally:
                self.num_calls -= 1

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=None, response_serializer=serialize)

    def add_service(self, server: grpc.aio.Server, servicer: Any, service_name: str, max_message_mb: int) -> None:
        """Register every method of `service_name` (its pb2 module imported) on `server`."""
        try:
            service = descriptor_pool.Default().FindServiceByName(service_name)
        except KeyError:
            raise ValueError(f"unknown service {service_name!r}: import its _pb2 module first") from None
        limits = request_byte_limits(service, servicer, max_message_mb)
        handlers = {m.name: h for m in service.methods if (h := self.handler(servicer, m, limits[m.name])) is not None}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
        server.add_registered_method_handlers(service_name, handlers)


def _reflection_v1_descriptor() -> None:
    """Put grpc/reflection/v1/reflection.proto in the default pool, so reflection can describe its
    own v1 service: v1alpha's file with the package renamed (the messages are wire-identical)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_REFLECTION_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    rename = lambda name: new + name[len(old):] if name.startswith(old) else name

    def rename_fields(message: descriptor_pb2.DescriptorProto) -> None:
        for f in message.field:
            if f.type_name:
                f.type_name = rename(f.type_name)
        for nested in message.nested_type:
            rename_fields(nested)

    proto.name, proto.package = _REFLECTION_V1_FILE, new.strip(".")
    proto.ClearField("options")  # v1alpha's java/objc package options
    for message in proto.message_type:
        rename_fields(message)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = rename(method.input_type), rename(method.output_type)
    pool.AddSerializedFile(proto.SerializeToString())


def add_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Server reflection for `service_names` on v1alpha (grpcio-reflection) and v1 (what grpcurl and
    newer tools ask for): one servicer, its method registered under both paths."""
    _reflection_v1_descriptor()
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE]
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    for service in (reflection.SERVICE_NAME, REFLECTION_V1_SERVICE):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),))


def server_credentials(options: ServerOptions) -> grpc.ServerCredentials | None:
    """TLS from --tls-cert / --tls-key; with --tls-client-ca, client certificates are required (mTLS)."""
    if bool(options.tls_cert) != bool(options.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    if options.tls_client_ca and not options.tls_cert:
        raise ValueError("--tls-client-ca needs TLS: --tls-cert and --tls-key")
    if not options.tls_cert:
        return None
    pair = (Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())
    if not options.tls_client_ca:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=Path(options.tls_client_ca).read_bytes(),
                                       require_client_auth=True)


async def start_service(
    options: ServerOptions,
    metrics: ServiceMetrics,
    servicer: Any,
    services: Sequence[str | tuple[Callable, str]],  # full service names; (add_fn, name) pairs are accepted, add_fn unused
    on_stop: Sequence[Callable[[], Awaitable[None]]] = (),
) -> ServiceHandle:
    credentials = server_credentials(options)
    edge = Edge(AuthPolicy.from_options(options))
    server = grpc.aio.server(options=server_options(options.max_message_mb))
    names = [s if isinstance(s, str) else s[1] for s in services]
    for name in names:
        edge.add_service(server, servicer, name, options.max_message_mb)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if options.reflection:
        add_reflection(server, [*names, health.SERVICE_NAME])
    address = f"{options.host}:{options.port}"
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpc's own words only point at GRPC_VERBOSITY
        port = 0
    if port == 0:
        raise OSError(f"could not bind {address}: the port is in use or the host is not this machine's")
    await server.start()
    for name in ["", *names]:  # the model is loaded before start_service: serving right away
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    handle = ServiceHandle(server, port, servicer, health_servicer, on_stop=list(on_stop), service_names=["", *names], edge=edge)
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
    "<label> listening on host:port[, metrics on :port]", serve until SIGINT/SIGTERM, then drain
    (`ServiceHandle.drain`, up to --drain-grace-s); a second signal stops at once."""
    from servicekit.options import parse_options

    options: Any = parse_options(options_cls, argv, description)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a parent's mask must not keep them out

    async def serve() -> None:
        handle = (await create_server(options))[0]
        metrics = f", metrics on :{handle.metrics_port}" if handle.metrics_port else ""
        print(f"{label(options)} listening on {options.host}:{handle.port}{metrics}", flush=True)
        signals: asyncio.Queue[int] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        await signals.get()
        log.info("draining: up to %.1f s for %d open session(s); a second signal stops at once",
                 options.drain_grace_s, getattr(handle.servicer, "num_sessions", 0))
        drain = asyncio.ensure_future(handle.drain(options.drain_grace_s))
        second = asyncio.ensure_future(signals.get())
        await asyncio.wait({drain, second}, return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            drain.cancel()
            await handle.stop(0)
        second.cancel()

    asyncio.run(serve())
    return 0
