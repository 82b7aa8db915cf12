"""A stream the client leaves ends on the server at once, in the call's own task and context.

The failure this guards against: grpc dropped a servicer's response generator at its `yield` when the
client cancelled (the call's task was cancelled while it sent), and the garbage collector finalized
the generator later in a task of its own. There, leaving the principal's scope raised "ValueError:
<Token var=<ContextVar name='specmesh_principal'> ...> was created in a different Context", logged
as "Task exception was never retrieved" (31 times in one run-cluster log), and the servicer's
`finally` (closing sessions downstream, counting) ran late and as nobody. A servicer whose responses
are large keeps the server inside its send when the client leaves: every cancel lands there.
"""

from __future__ import annotations

import asyncio
import gc
import logging

import grpc
import pytest
import yaml
from service_helpers import wait_for

from servicekit.auth import current_principal
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from servicekit.errors import rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.options import ServerOptions
from servicekit.server import start_service
from specmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

TIMEOUT_S = 20
NUM_STREAMS = 8
RESPONSE_CHARS = 512 * 1024  # a few responses fill the HTTP/2 windows: the server waits in its send
TOKEN = "tok-alice-5e6f"


class Flood(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Generate: large responses for as long as the client reads; each call's `finally` notes the
    principal it ran as and whether it ran in the call's own task."""

    def __init__(self):
        self.metrics = ServiceMetrics("flood")
        self.closed: list[tuple[str, bool]] = []

    @rpc_method
    async def Generate(self, request, context):
        task = asyncio.current_task()
        try:
            while True:
                yield coordinator_pb2.GenerateResponse(text="x" * RESPONSE_CHARS)
        finally:
            self.closed.append((current_principal(), asyncio.current_task() is task))


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def asyncio_errors():
    recorder = Recorder()
    logging.getLogger("asyncio").addHandler(recorder)
    try:
        yield recorder.messages
    finally:
        logging.getLogger("asyncio").removeHandler(recorder)


def test_a_cancelled_stream_closes_in_its_own_task_and_logs_nothing(tmp_path, asyncio_errors):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump({"alice": TOKEN}))
    servicer = Flood()
    with BackgroundServices() as services:
        handle = services.start(_start(servicer, str(tokens)))

        async def leave_early() -> None:
            async with channel(f"127.0.0.1:{handle.port}") as ch:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
                for _ in range(NUM_STREAMS):
                    call = stub.Generate(coordinator_pb2.GenerateRequest(prompt="x"), timeout=TIMEOUT_S,
                                         metadata=(("authorization", f"Bearer {TOKEN}"),))
                    await call.read()  # the stream is under way; the server keeps writing
                    await asyncio.sleep(0.05)  # ... until the windows are full and it waits in its send
                    call.cancel()
                    assert (await call.code()) is grpc.StatusCode.CANCELLED

        asyncio.run(asyncio.wait_for(leave_early(), TIMEOUT_S))
        assert wait_for(lambda: len(servicer.closed) == NUM_STREAMS and handle.edge.num_calls == 0, TIMEOUT_S), servicer.closed
        services.call(asyncio.to_thread(gc.collect))  # anything left for the collector would be finalized (and logged) now
        services.call(asyncio.sleep(0.2))
        gc.collect()
    assert servicer.closed == [("alice", True)] * NUM_STREAMS  # closed as the caller, in the call's task
    assert not [m for m in asyncio_errors if "never retrieved" in m or "different Context" in m], asyncio_errors
    # anything else asyncio logged, but grpc's own poller callback, which a loaded machine can trip
    # ("Exception in callback PollerCompletionQueue._handle_events", seen once in a fresh-clone run)
    assert not [m for m in asyncio_errors if "PollerCompletionQueue" not in m], asyncio_errors


async def _start(servicer, token_file: str):
    handle = await start_service(ServerOptions(port=0, auth_token_file=token_file), servicer.metrics, servicer,
                                 ["specmesh.v1.CoordinatorService"])
    return handle, handle.port
