"""Services on a background event loop in this process (tests, benchmarks, the demo).

    with BackgroundServices() as services:
        verify = services.start(target_service.server.create_server(VerifyOptions(model=folder)))
        ... connect to f"127.0.0.1:{verify.port}" with any (sync or asyncio) client ...
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable

from servicekit.server import ServiceHandle


class BackgroundServices:
    def __init__(self):
        import torch

        from servicekit.engine_thread import threads_here

        self.loop = asyncio.new_event_loop()
        threads = torch.get_num_threads()  # the services' engine threads get the caller's intra-op threads

        def run() -> None:
            threads_here(threads)
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="services-loop", daemon=True)
        self._thread.start()
        self.handles: list[ServiceHandle] = []

    def call(self, coroutine: Awaitable, timeout_s: float = 120.0):
        """Run a coroutine on the services' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def start(self, create_server_coroutine: Awaitable) -> ServiceHandle:
        handle, _port = self.call(create_server_coroutine)
        self.handles.append(handle)
        return handle

    def stop(self, handle: ServiceHandle) -> None:
        self.call(handle.stop(0))
        self.handles.remove(handle)

    def close(self) -> None:
        for handle in list(self.handles):
            self.stop(handle)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> BackgroundServices:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
