"""The core board (`servicekit.core_share`): who borrows whose cores, job by job, across processes."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from servicekit.core_share import SLOTS, CoreBoard, CoreShare, core_share_from
from servicekit.options import CoreOptions


@pytest.fixture
def board_path(tmp_path):
    path = str(tmp_path / "cores.board")
    CoreBoard.create(path)
    return path


def test_a_job_borrows_only_while_its_lenders_run_none(board_path):
    draft = CoreShare(CoreBoard(board_path), slot=0, lenders=(1,), borrow_threads=1)
    verify = CoreShare(CoreBoard(board_path), slot=1, lenders=(0,), borrow_threads=2)
    assert verify.begin() == 2  # the draft service is idle
    verify.end()
    draft.begin(may_borrow=False)  # e.g. drafting ahead on its own core
    assert verify.begin(wait_s=0.0) == 0
    verify.end()
    draft.end()
    assert (verify.num_jobs, verify.num_borrowed_jobs) == (2, 1)


def test_a_lender_waits_for_the_job_on_its_cores_and_not_longer(board_path):
    draft = CoreShare(CoreBoard(board_path), slot=0, lenders=(1,), borrow_threads=1)
    verify = CoreShare(CoreBoard(board_path), slot=1, lenders=(0,), borrow_threads=1)
    assert draft.begin() == 1
    start = time.monotonic()
    assert verify.begin(wait_s=0.05) == 0  # its core is borrowed: it waits, bounded
    assert time.monotonic() - start >= 0.05
    verify.end()
    draft.end()
    start = time.monotonic()
    verify.begin(wait_s=5.0)  # nobody on its cores: no wait
    assert time.monotonic() - start < 1.0
    verify.end()


def _borrow_in_another_process(path: str, began, release) -> None:
    share = CoreShare(CoreBoard(path), slot=2, lenders=(0,), borrow_threads=1)
    began.put(share.begin())
    release.wait(10)
    share.end()


def test_the_board_is_shared_between_processes(board_path):
    lender = CoreShare(CoreBoard(board_path), slot=0, lenders=(), borrow_threads=0)
    context = multiprocessing.get_context("spawn")
    began, release = context.Queue(), context.Event()
    child = context.Process(target=_borrow_in_another_process, args=(board_path, began, release))
    child.start()
    try:
        assert began.get(timeout=60) == 1
        start = time.monotonic()
        lender.begin(wait_s=0.1)  # the other process runs on its core
        assert time.monotonic() - start >= 0.1
        lender.end()
    finally:
        release.set()
        child.join(30)
    assert child.exitcode == 0
    start = time.monotonic()
    lender.begin(wait_s=5.0)  # the child ended its job: nothing to wait for
    assert time.monotonic() - start < 1.0


def test_hold_keeps_a_process_busy_between_its_jobs(board_path):
    draft = CoreShare(CoreBoard(board_path), slot=0, lenders=(1,), borrow_threads=1)
    verify = CoreShare(CoreBoard(board_path), slot=1, lenders=(0,), borrow_threads=1)
    draft.hold(True)
    draft.begin(may_borrow=False)
    draft.end()
    assert verify.begin() == 0  # between two forwards ahead: not lent
    verify.end()
    draft.hold(False)
    assert verify.begin() == 1
    verify.end()


def test_bad_slots_and_no_board(board_path):
    with pytest.raises(ValueError, match="out of range"):
        CoreShare(CoreBoard(board_path), slot=SLOTS, lenders=(), borrow_threads=0)
    with pytest.raises(ValueError, match="cannot lend to itself"):
        CoreShare(CoreBoard(board_path), slot=1, lenders=(1,), borrow_threads=1)
    assert core_share_from(CoreOptions(core_slot=0, lender_slots="1", borrow_threads=1)) is None
    share = core_share_from(CoreOptions(core_board=board_path, core_slot=3, borrow_threads=2))
    assert share is not None and share.borrow_threads == 0  # no lenders: nothing to borrow


def test_lent_and_unlent_jobs_per_token_times_are_kept_apart(board_path):
    """EngineThread.time_apart: the per-token times of jobs on the lent threads and of jobs on the
    process's own are averaged apart (both start from the figure at the call; the lent one's first
    timing replaces that stand-in)."""
    import asyncio

    from servicekit.engine_thread import EngineThread
    from specmesh.models.engine import EngineStats

    draft = CoreShare(CoreBoard(board_path), slot=0, lenders=(1,), borrow_threads=1)
    verify = CoreShare(CoreBoard(board_path), slot=1, lenders=(0,), borrow_threads=1)
    engine_thread = EngineThread("test-engine", num_threads=1)
    engine_thread.core_share = draft
    stats = EngineStats(step_ms=30.0, prefill_ms_per_token=3.0)  # timed at load, on its own threads
    engine_thread.time_apart(stats)

    def forward(ms: float) -> int:
        stats.record_step(ms, weight=0.5)
        return engine_thread.threads_now

    async def main():
        try:
            assert engine_thread.kept_apart and engine_thread.per_token_ms(lent=True) == 30.0
            assert await engine_thread.run(forward, 10.0) == 2  # the lender idle: lent
            assert (engine_thread.per_token_ms(lent=True), engine_thread.per_token_ms(lent=False)) == (10.0, 30.0)
            verify.begin(wait_s=0.0)  # the lender busy: its own thread
            assert await engine_thread.run(forward, 36.0) == 1
            assert (engine_thread.per_token_ms(lent=True), engine_thread.per_token_ms(lent=False)) == (10.0, 33.0)
            verify.end()
            assert await engine_thread.run(forward, 14.0) == 2  # the lent figure is averaged from now on
            assert (engine_thread.per_token_ms(lent=True), engine_thread.per_token_ms(lent=False)) == (11.25, 33.0)  # (14 capped at 1.25x)
            assert stats.prefill_ms_per_token == 3.0  # no job timed a prefill: the stand-in stays
        finally:
            engine_thread.shutdown()

    asyncio.run(main())


def test_a_step_timed_high_at_load_is_timed_again_once_settled(tiny_model_dir, monkeypatch):
    """measure_when_settled: a service without a board (a Stage service) times its step again while no
    session is open, keeping the fastest with the load-time figure; while a session is open it waits."""
    import asyncio

    from servicekit import core_share
    from servicekit.engine_thread import EngineThread
    from specmesh.models.load import load_engine

    monkeypatch.setattr(core_share, "LENT_TIMING_SPACING_S", 0.0)
    engine = load_engine(tiny_model_dir("llama"), dtype="float32")
    engine_thread = EngineThread("test-engine", num_threads=1)
    try:
        engine.stats.step_ms = 1e4  # timed while the host's other processes were loading
        busy = asyncio.run(core_share.measure_when_settled(engine_thread, engine, lambda: False, tries=3, interval_s=0.0))
        assert not busy and engine.stats.step_ms == 1e4  # a session was open throughout: not timed
        assert asyncio.run(core_share.measure_when_settled(engine_thread, engine, lambda: True, tries=5, interval_s=0.0))
        assert engine.stats.step_ms is not None and engine.stats.step_ms < 1e4
    finally:
        engine_thread.shutdown()
