"""Sibling branches start their verify rounds together, so the rounds meet in one target forward.

Why: each branch of a Skeleton-of-Thought answer is its own session, decoded by its own asyncio
task; the Verify service batches the calls that arrive within its short collection window (2 ms by
default). A call that misses it (its branch was slower to draft or to handle its last answer, the
host was busy, a sibling's fork is still prefilling) rides in a forward of its own, which the
others then wait behind. Measured with bench/skeleton.py's 4-point plan on 2 busy CPU cores: 111
target forwards for the longest branch's 95 rounds without the gate (16 forwards of one branch
between and after the forks, rounds split 3 + 1), 95-99 with it.

`RoundGate` is a barrier with a time bound. Every branch joins when it is launched (before its
fork) and leaves when its stream ends. `arrive(member)` returns once every member has arrived
(or left), so the released rounds go out in the same event-loop turn; a round is never held
longer than `max_wait_s` after the first member of its group started waiting (a stalled member,
a long prefill), and the next group forms again from whoever arrives. Waiting for a member that
is still forking or in another forward costs nothing: the one engine is busy with that work.

    gate = RoundGate(max_wait_s=0.5)
    gate.join(1); gate.join(2)
    await gate.arrive(1)     # (in branch 1's task) returns when 2 arrives or leaves, or after 0.5 s
    gate.leave(1)

No member's tokens change: which calls share a forward never changes a row's logits (batch invariance).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class RoundGate:
    def __init__(self, max_wait_s: float):
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self.members: set[Hashable] = set()
        self.waiting: dict[Hashable, asyncio.Future[None]] = {}
        self.num_releases = 0  # groups released (together or at the time bound)
        self.num_timeouts = 0  # of them, released at the time bound
        self._timer: asyncio.TimerHandle | None = None

    def join(self, member: Hashable) -> None:
        self.members.add(member)

    def leave(self, member: Hashable) -> None:
        """The member's stream ended (or failed): nobody waits for it any more."""
        self.members.discard(member)
        future = self.waiting.pop(member, None)
        if future is not None and not future.done():
            future.cancel()
        self._release_if_complete()

    async def arrive(self, member: Hashable) -> None:
        """Wait until every member has arrived or left, or `max_wait_s` passed (see the module docstring)."""
        if member not in self.members:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self.waiting[member] = future
        if self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._release, True)
        self._release_if_complete()
        try:
            await future
        finally:
            if self.waiting.get(member) is future:  # cancelled while waiting
                del self.waiting[member]
                self._release_if_complete()

    def _release_if_complete(self) -> None:
        if self.waiting and self.members <= self.waiting.keys():
            self._release(False)

    def _release(self, timed_out: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self.waiting = self.waiting, {}
        if not waiting:
            return
        self.num_releases += 1
        self.num_timeouts += timed_out
        for future in waiting.values():
            if not future.done():
                future.set_result(None)
