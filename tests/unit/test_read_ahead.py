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
