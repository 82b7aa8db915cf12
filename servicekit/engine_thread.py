"""The one thread that owns a service's model: every engine call goes through `EngineThread.run`.

Compute never runs on the asyncio loop, and because there is exactly one worker, engine calls are
serialised in submission order (the engines are not thread-safe).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor


class EngineThread:
    def __init__(self, name: str = "engine"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) on the engine thread. If the caller is cancelled the call still
        completes on the thread (engine state stays consistent); its result is dropped."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)
