"""Background asyncio tasks of the services (batchers, reapers, drafting ahead)."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has ended (its `finally` blocks have run); None: nothing to do."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
