"""create_gateway(options) -> (handle, port): the tokenizer, the app, uvicorn serving it on a bound socket.

    handle, port = await create_gateway(GatewayOptions(port=0, coordinator="127.0.0.1:50050"))
    ...                                            # http://127.0.0.1:{port}/v1/chat/completions
    await handle.stop(grace_s=1.0)

Binding the socket here (port 0 = any free one) gives the port before serving starts, as the gRPC
services' `create_server` does; `servicekit.background.BackgroundServices.start` accepts it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from gateway.app import create_app
from gateway.options import GatewayOptions
from servicekit.engine_thread import run_aside

START_TIMEOUT_S = 30.0
MIN_GRACE_S = 0.05  # uvicorn reports a zero grace as exceeded even with nothing open


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals are the caller's (gateway.__main__ drains on the first, stops on the second)


@dataclass
class GatewayHandle:
    server: uvicorn.Server
    task: asyncio.Future
    port: int
    app: object

    @property
    def gateway(self):
        return self.app.state.gateway  # type: ignore[attr-defined]

    def drain(self, grace_s: float) -> None:
        """Stop accepting, give open requests up to `grace_s`, then cancel them and stop."""
        self.server.config.timeout_graceful_shutdown = grace_s
        self.server.should_exit = True

    def force(self) -> None:
        self.server.force_exit = True

    async def stop(self, grace_s: float | None = 1.0) -> None:
        self.drain(grace_s or MIN_GRACE_S)
        await self.task

    async def wait_for_termination(self) -> None:
        await self.task


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    from specmesh.models.resolve import resolve_model_spec

    return AutoTokenizer.from_pretrained(resolve_model_spec(spec))


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and without it
    # Nagle holds a response's second write for the client's delayed ACK (40 ms per request)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def create_gateway(options: GatewayOptions) -> tuple[GatewayHandle, int]:
    if bool(options.tls_cert) != bool(options.tls_key):
        raise ValueError("HTTPS needs both tls_cert and tls_key")
    if options.max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {options.max_n}")
    tokenizer = await run_aside(load_tokenizer, options.model)
    app = create_app(options, tokenizer)
    sock = bind(options.host, options.port)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", ws="none",
                            timeout_graceful_shutdown=options.drain_grace_s,
                            ssl_certfile=options.tls_cert or None, ssl_keyfile=options.tls_key or None)
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while not server.started:
        if task.done():
            task.result()  # raises why it stopped
            raise RuntimeError("the gateway stopped during start-up")
        if asyncio.get_running_loop().time() > deadline:
            server.should_exit = True
            raise TimeoutError("the gateway did not start in time")
        await asyncio.sleep(0.01)
    port = sock.getsockname()[1]
    return GatewayHandle(server, task, port, app), port
