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
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
_END = object()
MAX_STREAM_INTERVAL_MS = 10_000  # a request's stream_interval_ms above this is refused


def whole_answer_interval_ms(stop: Sequence[str]) -> int | None:
    """The stream_interval_ms of a request whose caller reads only the whole answer (a gRPC client's
    `collect` without `on_text`, the gateway's non-streamed completions): the largest, so the Coordinator,
    and the Verify service under it, send the first tokens and the last and nothing between: each message
    costs CPU on the hosts' cores (on 2 cores, 50 ms apart, about 3% of a request's time). None (the
    Coordinator's own) for a request with stop strings: the Verify service does not know them and steps on
    until the Coordinator, reading its messages, finds one.

    >>> whole_answer_interval_ms([]), whole_answer_interval_ms(["\\n\\n"])
    (10000, None)
    """
    return None if stop else MAX_STREAM_INTERVAL_MS


def check_stream_interval(interval_ms: int) -> None:
    """A request's stream_interval_ms: ValueError (INVALID_ARGUMENT) past `MAX_STREAM_INTERVAL_MS`."""
    if interval_ms > MAX_STREAM_INTERVAL_MS:
        raise ValueError(f"stream_interval_ms must be at most {MAX_STREAM_INTERVAL_MS}, got {interval_ms}")


async def read_ahead(source: AsyncGenerator[T, None], depth: int = 8,
                     merge: Callable[[list[T]], T] | None = None, *, interval_s: float = 0.0,
                     urgent: Callable[[T], bool] | None = None) -> AsyncGenerator[T, None]:
    """`merge`: items already waiting when the consumer asks for the next one are handed over as one,
    `merge([item, ...])`, in order (a stream whose messages can be joined, e.g. token ids, sends fewer
    of them when its writes fall behind its source).

    `interval_s` (with `merge`): at most one hand-over per `interval_s`. The first item goes at once,
    as does an item that comes `interval_s` or more after the last hand-over; one that comes sooner
    waits until then, with the items that come meanwhile, joined. An item `urgent` says is urgent (a
    stream's last message) goes at once, with those waiting before it."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    if interval_s < 0 or (interval_s and merge is None):
        raise ValueError(f"interval_s must be >= 0 and needs merge, got {interval_s}")
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

    loop = asyncio.get_running_loop()
    task = loop.create_task(pump())
    end = None  # the end (or the source's exception), met while merging the items before it
    handed_at: float | None = None  # loop time of the last hand-over
    try:
        while True:
            item, error = end if end is not None else await queue.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            if merge is not None:
                items = [item]
                while end is None and not queue.empty():
                    waiting = queue.get_nowait()
                    if waiting[0] is _END:
                        end = waiting
                    else:
                        items.append(waiting[0])
                if interval_s and handed_at is not None and end is None:
                    end = await _hold(queue, items, handed_at + interval_s, urgent)
                item = merge(items) if len(items) > 1 else item
            handed_at = loop.time()
            yield item
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _hold(queue: asyncio.Queue, items: list, until: float, urgent: Callable | None) -> tuple | None:
    """Adds to `items` what `queue` brings until loop time `until`, or an urgent item, or the end
    (returned, else None)."""
    loop = asyncio.get_running_loop()
    while loop.time() < until and not (urgent is not None and urgent(items[-1])):
        try:
            async with asyncio.timeout_at(until):
                item, error = await queue.get()
        except TimeoutError:
            return None
        if item is _END:
            return item, error
        items.append(item)
    return None
