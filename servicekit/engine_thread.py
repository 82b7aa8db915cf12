"""The one thread that owns a service's model: every engine call goes through `EngineThread.run`.

Compute never runs on the asyncio loop, and because there is exactly one worker, engine calls are
serialised in submission order (the engines are not thread-safe).

Threads and OpenMP. torch's intra-op threads are an OpenMP team per calling thread. Measured on a
2-core CPU (SmolLM2-135M, one decode step): 37 ms when only the engine thread ever runs torch ops,
51-66 ms once the event-loop thread has run a multi-threaded op too (two teams contend for the
cores). So the engine thread gets the process's intra-op threads (`num_threads`, by default those of
the thread that creates it, i.e. OMP_NUM_THREADS / torch's default), the model is loaded on it, and
`single_threaded_here()` leaves the loop thread's own (small, conversion) ops on one thread.

Blocking work that is not the model's (a grammar compiled for a new format, a BM25 index, a DNS
lookup) goes through `run_aside`, never `asyncio.to_thread`: its worker threads are single-threaded
for torch too. One multi-threaded op on a default-executor thread is enough: libgomp then counts
more OpenMP threads than cores and stops spinning at every barrier for the rest of the process's
life (measured: a decode step 35 -> 49-54 ms after one `torch.ones(10**7).sum()` on such a thread,
and 35 ms when that thread had called `single_threaded_here()` first).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from servicekit.core_share import CoreShare

if TYPE_CHECKING:
    from specmesh.models.engine import EngineStats

ASIDE_WORKERS = 2  # threads for blocking work beside the engine (module docstring)
_aside: ThreadPoolExecutor | None = None
_aside_lock = threading.Lock()


def threads_here(num_threads: int) -> None:
    """Give the calling thread's torch ops `num_threads` OpenMP threads, for good. torch applies the
    process-wide count (the last any thread set) to a thread at that thread's first op; so set alone,
    before that first op, a thread's count could later become another thread's (measured: an aside
    thread set to 1 ran with 2 once an engine thread had set 2). The first read does that now."""
    torch.get_num_threads()
    torch.set_num_threads(num_threads)


def single_threaded_here() -> None:
    """Make the calling thread's torch ops single-threaded (call it on the asyncio loop thread)."""
    threads_here(1)


async def run_aside(fn, *args, **kwargs):
    """Run blocking fn(*args, **kwargs) off the event loop on a thread whose torch ops stay on one
    OpenMP thread (module docstring: why not `asyncio.to_thread`)."""
    global _aside
    with _aside_lock:
        if _aside is None:
            _aside = ThreadPoolExecutor(ASIDE_WORKERS, thread_name_prefix="aside", initializer=single_threaded_here)
    return await asyncio.get_running_loop().run_in_executor(_aside, functools.partial(fn, *args, **kwargs))


class EngineThread:
    """`threads_for_job` (optional): asked on the engine thread before each job, the OpenMP threads
    that job's torch ops get (e.g. more while cores lent by another process are idle), given what the
    core board lends it now (`core_share`: None without a board); the count changes only when the
    answer does. Without it, every job gets `num_threads` plus what the board lends.
    `core_share` (optional, `servicekit.core_share`): the job's turn on the host's core board.
    `time_apart(stats)` (with a board that lends threads): the engine's per-token times (`step_ms`,
    `prefill_ms_per_token`: the prior callers' k policies get) are kept apart for jobs on the lent
    threads and jobs on this process's own, each averaged over its own kind (`per_token_ms`): a lone
    session's Propose runs lent, a busy service's on its own threads, and one figure averaging both
    priced neither (a lone session's drafts at 15-21 ms where they take 12, so it never drafted). A lent
    figure no lent job has timed yet is None, and the own threads' stands in for it where it is read;
    the first lent job's timing sets it instead of being averaged with that stand-in: a bf16 draft's lent
    step read 14.5 ms after its first lent forward of 10, from the 19 its one own thread takes, which kept
    a lone session's drafts shut."""

    def __init__(self, name: str = "engine", num_threads: int | None = None):
        self.num_threads = num_threads or torch.get_num_threads()
        self.threads_for_job: Callable[[int | None], int] | None = None
        self.core_share: CoreShare | None = None
        self._apart: EngineStats | None = None  # time_apart's stats
        self._times: dict[bool, tuple[float | None, float | None]] = {}  # lent? -> (step_ms, prefill_ms_per_token)
        self.threads_now = self.num_threads  # the engine thread's count (set by its initializer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                            initializer=threads_here, initargs=(self.num_threads,))
        self._submitted = self._started = 0  # jobs handed to the thread / begun there (each counted by one thread)

    @property
    def jobs_waiting(self) -> bool:
        """Jobs are queued behind the one running now (a long job may give way: `measure_step`'s `stop`)."""
        return self._submitted - self._started > 0

    async def run(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) on the engine thread. If the caller is cancelled the call still
        completes on the thread (engine state stays consistent); its result is dropped."""
        loop = asyncio.get_running_loop()
        self._submitted += 1
        return await loop.run_in_executor(self._executor, functools.partial(self._job, fn, args, kwargs, True))

    async def run_unlent(self, fn, *args, **kwargs):
        """`run`, borrowing no cores for this job (work another process's next call should not wait for)."""
        loop = asyncio.get_running_loop()
        self._submitted += 1
        return await loop.run_in_executor(self._executor, functools.partial(self._job, fn, args, kwargs, False))

    def time_apart(self, stats: EngineStats) -> None:
        """Keep `stats`' per-token times apart for lent and unlent jobs from now on (class docstring);
        the own threads' start from the figures it has (timed at load), the lent ones untimed."""
        self._apart = stats
        self._times = {False: (stats.step_ms, stats.prefill_ms_per_token), True: (None, None)}

    @property
    def kept_apart(self) -> bool:
        return self._apart is not None and self.core_share is not None and bool(self.core_share.borrow_threads)

    def per_token_ms(self, lent: bool) -> float | None:
        """With `time_apart`: the one-token forward of jobs on the lent threads (`lent`) or on this
        process's own, as recently averaged."""
        return self._figures(lent)[0] if self._times else None

    def _figures(self, lent: bool) -> tuple[float | None, float | None]:
        """The (step_ms, prefill_ms_per_token) of that kind of job, the own threads' standing in for a lent
        figure not timed yet."""
        (step, prefill), (own_step, own_prefill) = self._times[lent], self._times[False]
        return own_step if step is None else step, own_prefill if prefill is None else prefill

    def _job(self, fn, args, kwargs, may_borrow: bool):
        self._started += 1
        share = self.core_share
        lent = share.begin(may_borrow) if share is not None else None
        stats = self._apart if self.kept_apart else None
        if stats is not None:  # an untimed figure (None) is set by the job's first timing, not averaged with a stand-in
            stats.step_ms, stats.prefill_ms_per_token = self._times[bool(lent)]
        try:
            if self.threads_for_job is not None:
                wanted = self.threads_for_job(lent)
            else:
                wanted = self.num_threads + (lent or 0)
            if wanted != self.threads_now:
                torch.set_num_threads(wanted)
                self.threads_now = wanted
            return fn(*args, **kwargs)
        finally:
            if stats is not None:
                self._times[bool(lent)] = (stats.step_ms, stats.prefill_ms_per_token)
                stats.step_ms, stats.prefill_ms_per_token = self._figures(bool(lent))
            if share is not None:
                share.end()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)
