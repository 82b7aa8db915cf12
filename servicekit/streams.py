"""Read an async generator ahead of its consumer, so producing the next item overlaps consuming this one.

A server stream that yields each round's tokens would otherwise start round i + 1 only after the
write of round i to the client returned. `read_ahead` runs the source in its own task, at most
`depth` items ahead (backpressure: a slow client stops the source there, it does not buffer without
bound). Items and the source's exception arrive in order; closing or cancelling the consumer
cancels the source and waits for its `finally` blocks (so downstream sessions close at once).

    async for response in read_ahead(rounds(), depth=8):
        yield response          # meanwhile the next round's RPCs are already under way

>>> async def numbers():
...     for i in range(3):
...         yield i
...     raise KeyError("after three")
>>> async def collect():
...     seen = []
...     try:
...         async for n in read_ahead(numbers(), depth=1):
...             seen.append(n)
...     except KeyError as exc:
...         seen.append(str(exc))
...     return seen
>>> asyncio.run(collect())
[0, 1, 2, "'after three'"]
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def read_ahead(source: AsyncGenerator[T, None], depth: int = 8,
                     merge: Callable[[list[T]], T] | None = None) -> AsyncGenerator[T, None]:
    """`merge`: items already waiting when the consumer asks for the next one are handed over as one,
    `merge([item, ...])`, in order (a stream whose messages can be joined, e.g. token ids, sends fewer
    of them when its writes fall behind its source)."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    queue: asyncio.Queue = asyncio.Queue(depth)

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put((item, None))
            await queue.put((_END, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, in order
            await queue.put((_END, exc))
        finally:
            await source.aclose()

    task = asyncio.get_running_loop().create_task(pump())
    end = None  # the end (or the source's exception), met while merging the items before it
    try:
        while True:
            item, error = end if end is not None else await queue.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            if merge is not None and not queue.empty():
                items = [item]
                while not queue.empty():
                    waiting = queue.get_nowait()
                    if waiting[0] is _END:
                        end = waiting
                        break
                    items.append(waiting[0])
                item = merge(items) if len(items) > 1 else item
            yield item
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
