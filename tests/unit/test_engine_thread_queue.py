"""`EngineThread.jobs_waiting`: a long job (a step timing) can tell that another job queued behind it."""

from __future__ import annotations

import asyncio
import threading

from servicekit.engine_thread import EngineThread


def test_jobs_waiting_says_whether_a_job_is_queued_behind_the_running_one():
    engine_thread = EngineThread("test-queue", num_threads=1)
    release, running = threading.Event(), threading.Event()
    seen = []

    def long_job():
        running.set()
        release.wait(10)
        seen.append(engine_thread.jobs_waiting)

    async def main():
        first = asyncio.ensure_future(engine_thread.run(long_job))
        await asyncio.to_thread(running.wait, 10)
        alone = engine_thread.jobs_waiting
        second = asyncio.ensure_future(engine_thread.run(lambda: seen.append(engine_thread.jobs_waiting)))
        await asyncio.sleep(0)  # the second is handed to the thread
        queued = engine_thread.jobs_waiting
        release.set()
        await asyncio.gather(first, second)
        return alone, queued

    try:
        alone, queued = asyncio.run(main())
    finally:
        engine_thread.shutdown()
    assert (alone, queued) == (False, True)
    assert seen == [True, False]  # the long job saw the second waiting; the second ran with nothing behind it
