"""Work a service runs ahead of its sessions' next calls (a Draft service drafting ahead, a Stage service
extending ahead), one engine job at a time.

    ahead = AheadQueue(engine_thread, step, wait_idle, "drafting ahead")
    ahead.add(id(session), session)      # after answering a call: the session has work ahead to do
    ...
    await ahead.close()                  # at shutdown

A task, started with the first `add`, runs `step(items)` on the engine thread for the queued items while
any are queued, each job after `wait_idle()` (the service's calls go first) and on this process's own
cores (`EngineThread.run_unlent`: another process's next call should not wait for it); with a core board
the process stays marked busy between those jobs (`CoreShare.hold`), so a borrower does not take its cores
in a gap and make the next one wait. `step` takes out of `items` the keys it is done with. A step that
fails empties the queue (the work ahead is an optimisation: the sessions are served on demand).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from servicekit.engine_thread import EngineThread
from servicekit.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class AheadQueue:
    def __init__(self, engine_thread: EngineThread, step: Callable[[Sequence[Any]], None],
                 wait_idle: Callable[[], Awaitable[Any]], what: str):
        self.engine_thread = engine_thread
        self.step = step  # engine thread: one job for the queued items
        self.wait_idle = wait_idle
        self.what = what  # for the log
        self.items: dict[int, Any] = {}  # key (a session's id) -> what `step` needs of it
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def add(self, key: int, item: Any) -> None:
        self.items[key] = item
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        assert self._wakeup is not None
        self._wakeup.set()

    def discard(self, key: int) -> None:
        self.items.pop(key, None)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            share = self.engine_thread.core_share  # busy between jobs ahead too (servicekit.core_share)
            if share is not None and self.items:
                share.hold(True)
            try:
                while self.items:
                    await self.wait_idle()
                    try:
                        await self.engine_thread.run_unlent(self.step, list(self.items.values()))
                    except Exception:  # noqa: BLE001 - work ahead is an optimisation: stop it, serve on demand
                        log.exception("%s failed; the sessions queued for it are served on demand", self.what)
                        self.items.clear()
            finally:
                if share is not None:
                    share.hold(False)
