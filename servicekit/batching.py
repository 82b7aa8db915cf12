"""Collect concurrent calls for a short window and run them as ONE batch on the engine thread.

    batcher = WindowBatcher(engine_thread, run_batch, window_ms=2, max_batch_cost=4096, cost=len)
    result = await batcher.submit(payload)    # many tasks at once -> few run_batch calls

`run_batch(payloads) -> results` runs on the engine thread and returns one result per payload, in
order; a result that is an Exception is raised in that caller only. Batches are taken first in, first
out, up to `max_batch_cost` (at least one call per batch, however costly), so no caller starves.
With `expected_callers` (e.g. the open sessions), the window ends as soon as that many calls are
queued: a lone session never waits for company that cannot come, and the last of several sessions
to arrive starts the batch at once.
While the engine runs one batch, new calls queue up and ride in the next (continuous batching). A
caller cancelled while waiting is skipped; one cancelled during its batch gets no result.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from servicekit.engine_thread import EngineThread
from servicekit.tasks import cancel_and_wait


class WindowBatcher:
    def __init__(
        self,
        engine_thread: EngineThread,
        run_batch: Callable[[Sequence[Any]], list[Any]],
        window_ms: float = 2.0,
        max_batch_cost: int = 4096,
        cost: Callable[[Any], int] = lambda payload: 1,
        on_batch: Callable[[Sequence[Any]], None] | None = None,
        on_queue_depth: Callable[[int], None] | None = None,
        expected_callers: Callable[[], int] | None = None,
    ):
        self.engine_thread = engine_thread
        self.run_batch = run_batch
        self.window_ms = window_ms
        self.max_batch_cost = max_batch_cost
        self.cost = cost
        self.on_batch = on_batch
        self.on_queue_depth = on_queue_depth
        self.expected_callers = expected_callers
        self._queue: deque[tuple[Any, asyncio.Future]] = deque()
        self._wakeup: asyncio.Event | None = None
        self._all_queued: asyncio.Event | None = None  # set while a window is open and every expected caller is in
        self._task: asyncio.Task | None = None
        self._running = False  # a batch taken from the queue has not been answered yet
        self._idle: asyncio.Event | None = None  # set (and dropped) when the queue drains

    def busy(self) -> bool:
        """Calls are waiting, or a batch is on the engine thread."""
        return bool(self._queue) or self._running

    async def wait_idle(self) -> None:
        """Until no call waits and no batch runs: background engine work (e.g. drafting ahead) yields to calls."""
        while self.busy():
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()

    async def submit(self, payload: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._run())
        future = loop.create_future()
        self._queue.append((payload, future))
        self._report_depth()
        self._wakeup.set()
        if self._all_queued is not None and self._all_expected_queued():
            self._all_queued.set()
        return await future

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        while self._queue:
            _, future = self._queue.popleft()
            if not future.done():
                future.set_exception(RuntimeError("the service is shutting down"))
        self._running = False
        self._wake_idle()

    async def _window(self) -> None:
        """Wait `window_ms`, or less: until every expected caller is queued."""
        self._all_queued = asyncio.Event()
        try:  # asyncio.timeout: a cancel (shutdown) is never swallowed, as wait_for's can be on Python 3.11
            async with asyncio.timeout(self.window_ms / 1e3):
                await self._all_queued.wait()
        except TimeoutError:
            pass
        finally:
            self._all_queued = None

    def _all_expected_queued(self) -> bool:
        return self.expected_callers is not None and len(self._queue) >= self.expected_callers()

    def _report_depth(self) -> None:
        if self.on_queue_depth is not None:
            self.on_queue_depth(len(self._queue))

    def _take(self) -> list[tuple[Any, asyncio.Future]]:
        batch, budget = [], self.max_batch_cost
        while self._queue:
            payload, future = self._queue[0]
            if future.done():  # cancelled while waiting
                self._queue.popleft()
                continue
            item_cost = self.cost(payload)
            if batch and item_cost > budget:
                break
            batch.append(self._queue.popleft())
            budget -= item_cost
        self._report_depth()
        return batch

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                if self.window_ms > 0 and not self._all_expected_queued():
                    await self._window()
                batch = self._take()
                if not batch:
                    continue
                payloads = [payload for payload, _ in batch]
                self._running = True
                try:
                    results = await self.engine_thread.run(self.run_batch, payloads)
                except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch
                    results = [exc] * len(batch)
                finally:
                    self._running = False
                if self.on_batch is not None:
                    self.on_batch(payloads)
                for (_, future), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
            self._wake_idle()

    def _wake_idle(self) -> None:
        if self._idle is not None and not self._queue:
            self._idle.set()
            self._idle = None
