"""WindowBatcher: the window ends as soon as every expected caller is queued, and not before."""

import asyncio
import time

from servicekit.batching import WindowBatcher
from servicekit.engine_thread import EngineThread


def _run(num_callers: int, expected: int, window_ms: float, stagger_s: float) -> tuple[list[list[int]], float]:
    """`num_callers` submit one after another (`stagger_s` apart): (the batches run, seconds to the last result)."""
    batches: list[list[int]] = []

    def run_batch(payloads):
        batches.append(list(payloads))
        return [p * 10 for p in payloads]

    async def main():
        engine = EngineThread("test-batcher")
        batcher = WindowBatcher(engine, run_batch, window_ms=window_ms, expected_callers=lambda: expected)
        start = time.perf_counter()

        async def caller(i: int):
            await asyncio.sleep(i * stagger_s)
            return await batcher.submit(i)

        results = await asyncio.gather(*(caller(i) for i in range(num_callers)))
        elapsed = time.perf_counter() - start
        await batcher.close()
        engine.shutdown()
        assert results == [i * 10 for i in range(num_callers)]
        return elapsed

    elapsed = asyncio.run(main())
    return batches, elapsed


def test_the_last_expected_caller_ends_the_window_at_once():
    batches, elapsed = _run(num_callers=3, expected=3, window_ms=2000, stagger_s=0.02)
    assert batches == [[0, 1, 2]]  # one batch, though the window would have been 2 s
    assert elapsed < 1.0, elapsed


def test_a_missing_caller_costs_the_whole_window_once():
    batches, elapsed = _run(num_callers=2, expected=3, window_ms=300, stagger_s=0.02)
    assert batches == [[0, 1]]
    assert 0.3 <= elapsed < 2.0, elapsed
