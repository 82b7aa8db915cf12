"""Cores lent between the model processes of one host, job by job, through a board in shared memory.

The local launcher pins each model process to cores of its own (`cpus`), so a Draft service drafting
ahead and a Verify service verifying run side by side without stalling each other's OpenMP teams. When
they take turns instead (ordinary speculation: a Propose, then the Verify of its draft), each would
run on half the host. So a process may borrow another's cores (`borrow_cpus`) for an engine job while
that process runs none, and the launcher's board says which do:

  - the board is a small file mapped into every process that lends or borrows; each has a slot of two
    bytes: `busy` (an engine job is running in it) and `borrowing` (the slots whose cores it runs on now,
    one bit each);
  - before a job a process marks itself busy; if none of its lenders is busy it marks what it borrows,
    checks once more (a lender may have begun meanwhile: then it borrows nothing) and runs the job on its
    own threads plus a thread per borrowed core;
  - a process whose own cores are borrowed waits for that job to end before it starts one (bounded by
    `LENDER_WAIT_S`), so two teams never share a core for more than the moment the check takes;
  - after the job it clears both marks.

Jobs that should never borrow (drafting ahead: the target's next Verify is about to come) pass
`may_borrow=False`; a run of them keeps the process marked busy between its jobs too (`hold`), so a
borrower does not take its cores in a gap and make the next one wait. What is lent is decided from
the board alone, so it holds across any number of clients and coordinators. A process that dies with
its marks set leaves its lender waiting at most `LENDER_WAIT_S` per job until it is restarted (the
restart clears its slot).

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "board")
    >>> CoreBoard.create(path)
    >>> draft = CoreShare(CoreBoard(path), slot=0, lenders=(1,), borrow_threads=1)
    >>> verify = CoreShare(CoreBoard(path), slot=1, lenders=(0,), borrow_threads=1)
    >>> draft.begin()          # the verify service is idle: the draft runs on its core too
    1
    >>> verify.begin(wait_s=0.01)  # the draft is busy (and holds its core): nothing lent; waited for
    0
    >>> draft.end(); verify.end()
    >>> verify.begin(), draft.begin(may_borrow=False, wait_s=0.01)  # drafting ahead borrows nothing
    (1, 0)
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from collections.abc import Callable, Sequence

from servicekit.options import CoreOptions

SLOTS = 8  # processes on one board (each `borrowing` byte has a bit per slot)
LENDER_WAIT_S = 0.25  # longest a lender waits for a borrowed job on its cores to end
POLL_S = 0.0002


class CoreBoard:
    """The launcher's board file, mapped: `SLOTS` slots of (busy, borrowing) bytes."""

    def __init__(self, path: str):
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 2 * SLOTS)

    @staticmethod
    def create(path: str) -> None:
        with open(path, "wb") as file:
            file.write(bytes(2 * SLOTS))
            file.flush()
            os.fsync(file.fileno())

    def busy(self, slot: int) -> bool:
        return self._map[2 * slot] != 0

    def borrowing(self, slot: int) -> int:
        return self._map[2 * slot + 1]

    def set(self, slot: int, busy: bool, borrowing: int) -> None:
        self._map[2 * slot] = int(busy)
        self._map[2 * slot + 1] = borrowing


class CoreShare:
    """One process's side of the board (module docstring): `begin()` before an engine job, the number
    of borrowed threads it may add; `end()` after it."""

    def __init__(self, board: CoreBoard, slot: int, lenders: Sequence[int], borrow_threads: int):
        for index in (slot, *lenders):
            if not 0 <= index < SLOTS:
                raise ValueError(f"core board slot {index} out of range 0-{SLOTS - 1}")
        if slot in lenders:
            raise ValueError(f"core board slot {slot} cannot lend to itself")
        self.board, self.slot, self.lenders, self.borrow_threads = board, slot, tuple(lenders), borrow_threads
        self._mask = sum(1 << lender for lender in self.lenders)
        self.held = False  # marked busy between jobs too (`hold`)
        self._in_job = False
        self.num_borrowed_jobs = 0
        self.num_jobs = 0
        board.set(slot, False, 0)  # a restarted process starts clean

    def begin(self, may_borrow: bool = True, wait_s: float = LENDER_WAIT_S) -> int:
        board, slot = self.board, self.slot
        self._in_job = True
        board.set(slot, True, 0)
        lent = 0
        if may_borrow and self.borrow_threads and self._mask and not any(map(board.busy, self.lenders)):
            board.set(slot, True, self._mask)
            if any(map(board.busy, self.lenders)):  # a lender began meanwhile: its cores are its own
                board.set(slot, True, 0)
            else:
                lent = self.borrow_threads
        deadline = time.monotonic() + wait_s
        while self._borrowed_from() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.num_jobs += 1
        self.num_borrowed_jobs += bool(lent)
        return lent

    def end(self) -> None:
        self._in_job = False
        self.board.set(self.slot, self.held, 0)

    def hold(self, held: bool) -> None:
        """Mark the process busy between jobs too (True) until released (False); a job running now
        applies it at its end."""
        self.held = held
        if not self._in_job:
            self.board.set(self.slot, held, 0)

    def lender_busy(self) -> bool:
        """Whether a process this one borrows from has begun a job (it waits for the borrowed job to end)."""
        return any(map(self.board.busy, self.lenders))

    def _borrowed_from(self) -> bool:
        """Whether another process runs on this one's cores now."""
        bit = 1 << self.slot
        return any(self.board.borrowing(other) & bit for other in range(SLOTS) if other != self.slot)


def core_share_from(options: CoreOptions) -> CoreShare | None:
    """The share a service's options describe (`core_board`, `core_slot`, `lender_slots`), or None."""
    if not options.core_board:
        return None
    lenders = tuple(int(part) for part in options.lender_slots.split(",") if part.strip())
    return CoreShare(CoreBoard(options.core_board), options.core_slot, lenders, options.borrow_threads if lenders else 0)


# measure_when_lent times the step in this many lent jobs, LENT_TIMING_SPACING_S apart, and keeps the
# fastest: the first lent job comes as the lenders go idle, while the cluster's other processes may still
# be starting (one timing read 14.5-15.8 ms where the lent step takes 11.6, and the prior it gave kept a lone
# session from ever drafting)
LENT_TIMINGS = 3
LENT_TIMING_SPACING_S = 2.0


async def measure_when_lent(engine_thread, engine, is_idle: Callable[[], bool] = lambda: True, tries: int = 40,
                            interval_s: float = 0.25) -> bool:
    """Time the engine's step (`measure_step`, the callers' k policy prior) again in jobs that get the
    threads the board lends while `is_idle()` (no session open: the timing's ~0.2 s of forwards would
    otherwise run between a request's rounds): at load the other processes were loading too, so it was
    timed on this process's own threads, where a lone session's rounds run on the lent ones as well. The
    first such job sets the figure; LENT_TIMINGS - 1 more, LENT_TIMING_SPACING_S apart, keep the fastest.
    True once timed; False without a board, or when nothing was lent in `tries` attempts."""
    if engine_thread.core_share is None or not engine_thread.core_share.borrow_threads:
        return False
    return await _retime_step(engine_thread, engine,
                              lambda: is_idle() and engine_thread.threads_now > engine_thread.num_threads,
                              tries, interval_s, keep_load_timing=False)


async def measure_when_settled(engine_thread, engine, is_idle: Callable[[], bool], tries: int = 40,
                               interval_s: float = 0.25) -> bool:
    """Time the engine's step again after start, in LENT_TIMINGS jobs LENT_TIMING_SPACING_S apart while
    `is_idle()` (no session open), keeping the fastest with the load-time figure: a service of one
    host that borrows no cores (a Stage service) timed its step at load beside the other processes
    loading, and a figure that reads high is what callers price its tokens at until a request runs them
    (measured: a bf16 Stage read 20.6 ms where its forwards take 10, and its cascade never drafted)."""
    return await _retime_step(engine_thread, engine, is_idle, tries, interval_s, keep_load_timing=True)


async def _retime_step(engine_thread, engine, may_time: Callable[[], bool], tries: int, interval_s: float,
                       keep_load_timing: bool) -> bool:
    """Time the step in jobs where `may_time()` (asked on the engine thread), LENT_TIMINGS of them, the
    fastest kept (with the figure already there when `keep_load_timing`)."""
    from specmesh.models.engine import TimingStopped, measure_step

    share = engine_thread.core_share
    lenders_busy = share.lender_busy if share is not None and share.lenders else (lambda: False)

    def stop() -> bool:  # a timing gives way as soon as a job of this process queues behind it, or the owner
        return engine_thread.jobs_waiting or lenders_busy()  # of borrowed cores begins one (it waits for this job)
    timings: list[tuple[float, float | None, tuple[tuple[int, float], ...] | None]] = []
    if keep_load_timing and engine.stats.step_ms is not None:
        timings.append((engine.stats.step_ms, engine.stats.prefill_ms_per_token, engine.stats.round_timings))
    num_loaded = len(timings)

    def timed_if_allowed() -> bool:
        if not may_time():
            return False
        step_ms, prefill_ms = engine.stats.step_ms, engine.stats.prefill_ms_per_token
        engine.stats.step_ms = engine.stats.prefill_ms_per_token = None  # timed afresh, not averaged in
        try:
            measure_step(engine, stop=stop)
        except TimingStopped:  # tried again later (a try used up)
            engine.stats.step_ms, engine.stats.prefill_ms_per_token = step_ms, prefill_ms
            return False
        if engine.stats.step_ms is not None:
            timings.append((engine.stats.step_ms, engine.stats.prefill_ms_per_token, engine.stats.round_timings))
            engine.stats.step_ms, engine.stats.prefill_ms_per_token, engine.stats.round_timings = min(timings, key=lambda t: t[0])
        return True

    for _ in range(tries):
        if await engine_thread.run(timed_if_allowed):
            if len(timings) - num_loaded >= LENT_TIMINGS:
                return True
            await asyncio.sleep(LENT_TIMING_SPACING_S)
            continue
        await asyncio.sleep(interval_s)
    return len(timings) > num_loaded
