"""servicekit.streams.read_ahead with `merge`: items that wait when the consumer asks are joined, in
order; the source's end and its exception come after every item before them."""

from __future__ import annotations

import asyncio

import pytest

from servicekit.streams import read_ahead


async def _numbers(n: int, error: Exception | None = None):
    for i in range(n):
        yield [i]
    if error is not None:
        raise error


def _join(items: list[list[int]]) -> list[int]:
    return [x for item in items for x in item]


async def _collect(source, depth: int, slow_consumer: bool) -> list[list[int]]:
    seen = []
    async for item in read_ahead(source, depth, merge=_join):
        seen.append(item)
        if slow_consumer:
            await asyncio.sleep(0.01)  # the source runs ahead meanwhile
    return seen


def test_waiting_items_are_joined_in_order():
    seen = asyncio.run(_collect(_numbers(20), depth=4, slow_consumer=True))
    assert [x for item in seen for x in item] == list(range(20))
    assert len(seen) < 20  # some were joined
    assert all(len(item) <= 4 for item in seen)  # never more than the depth allowed ahead


def test_a_consumer_that_keeps_up_gets_every_item_alone():
    seen = asyncio.run(_collect(_numbers(5), depth=1, slow_consumer=False))
    assert seen == [[0], [1], [2], [3], [4]]


def test_the_error_comes_after_the_items_before_it():
    async def main():
        seen = []
        with pytest.raises(KeyError):
            async for item in read_ahead(_numbers(6, KeyError("end")), 8, merge=_join):
                seen.append(item)
                await asyncio.sleep(0.01)
        return seen

    assert [x for item in asyncio.run(main()) for x in item] == list(range(6))


# interval_s: at most one hand-over per interval, the first and urgent items at once


async def _timed(n: int, gap_s: float, tail_s: float = 0.0):
    loop = asyncio.get_running_loop()
    for i in range(n):
        await asyncio.sleep(gap_s)
        yield [(i, loop.time())]
    await asyncio.sleep(tail_s)  # e.g. a stream closing its sessions after its last message


async def _handed(source, interval_s: float, urgent=None) -> list[tuple[list[int], float, float]]:
    """Per hand-over: the items, when it came, and the longest any of its items waited."""
    loop = asyncio.get_running_loop()
    seen = []
    async for item in read_ahead(source, 4, merge=_join, interval_s=interval_s, urgent=urgent):
        now = loop.time()
        seen.append(([i for i, _ in item], now, max(now - made for _, made in item)))
    return seen


def test_an_interval_joins_what_comes_within_it_and_holds_nothing_longer():
    seen = asyncio.run(_handed(_timed(24, 0.01), interval_s=0.08))
    assert [i for ids, _, _ in seen for i in ids] == list(range(24))
    assert seen[0][0] == [0]  # the first item at once
    assert len(seen) <= 24 // 4  # ~8 items a hand-over here
    times = [at for _, at, _ in seen[:-1]]  # (the source's end hands the last ones over at once)
    assert all(b - a >= 0.08 - 0.005 for a, b in zip(times, times[1:], strict=False))  # the rate
    assert max(waited for _, _, waited in seen) < 0.08 + 0.25  # (slack for a loaded machine)


def test_items_slower_than_the_interval_go_alone_and_at_once():
    seen = asyncio.run(_handed(_timed(4, 0.06), interval_s=0.02))
    assert [ids for ids, _, _ in seen] == [[0], [1], [2], [3]]


def test_an_urgent_item_goes_at_once_with_those_before_it():
    seen = asyncio.run(_handed(_timed(3, 0.001, tail_s=1.0), interval_s=0.5, urgent=lambda item: item[-1][0] == 2))
    assert [ids for ids, _, _ in seen] == [[0], [1, 2]]
    assert seen[1][2] < 0.4  # not held for the interval, nor for the source's tail


def test_an_interval_needs_merge():
    async def main():
        async for _ in read_ahead(_numbers(1), 4, interval_s=0.1):
            pass

    with pytest.raises(ValueError, match="needs merge"):
        asyncio.run(main())
