"""What the Draft, Verify and Stage servicers share: owned sessions whose state lives on one engine thread.

    class VerifyServicer(SessionService, verify_pb2_grpc.VerifyServiceServicer):
        def free_session(self, session): ...             # engine thread: release KV, drafter state
        def session_tokens(self, session): ...           # KV tokens it holds (quota accounting)
    async with self.admission(len(prompt)):               # draining, quotas: before any engine work
        ...                                                # prefill
        session_id = await self.add_session(session)      # a server-made id, owned by the caller
    async with self.session_call(session_id) as session:  # one call at a time per session
        ...                                                # failure or cancel here -> closed (below)

Sessions belong to the principal that opened them (`servicekit.auth.current_principal`): another
principal's id answers NOT_FOUND. The rule, once for every service: a call that fails or is
cancelled while it holds a session closes that session (its state is then unknown to the client),
unless the error leaves the state as it was: a client mistake (ValueError: validated before any
state changes), a quota refusal, or a full KV pool (the engine rolls a failed forward back
completely, so the client may retry later). Closing runs in the background so the failing call
returns at once; sessions idle past the TTL are reaped.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from servicekit.auth import current_principal
from servicekit.core_share import measure_when_lent, measure_when_settled
from servicekit.engine_thread import EngineThread
from servicekit.errors import QuotaExceeded, SessionNotFound, Unavailable
from servicekit.metrics import ServiceMetrics
from servicekit.quotas import Holdings, QuotaOptions, Quotas
from servicekit.sessions import SessionTable, check_session_id
from servicekit.tasks import cancel_and_wait
from specmesh.kv.errors import OutOfBlocksError

# errors after which the session is exactly as it was before the call
STATE_PRESERVING_ERRORS = (ValueError, OutOfBlocksError, QuotaExceeded)


class SessionService:
    def __init__(self, name: str, session_ttl_s: float, metrics: ServiceMetrics, quotas: QuotaOptions | None = None,
                 engine_thread: EngineThread | None = None):
        self.metrics = metrics
        self.engine_thread = engine_thread or EngineThread(f"{name}-engine")
        if self.engine_thread.core_share is not None:
            metrics.watch_core_share(self.engine_thread.core_share)
        self.sessions = SessionTable(session_ttl_s, self._close_session, on_expire=metrics.expired_sessions.inc)
        self.quotas = Quotas(quotas or QuotaOptions())
        self._reserved: defaultdict[str, Holdings] = defaultdict(Holdings)  # admitted, not yet added
        self._background: set[asyncio.Task] = set()
        self.draining = False  # set by `start_draining`: open sessions go on, new ones are refused
        self.remeasure: list[asyncio.Task] = []  # steps timed again on lent threads (`measure_when_lent`), one task per engine

    def free_session(self, session: Any) -> None:
        """Engine thread: release what `session` holds. Each servicer says what that is."""
        raise NotImplementedError

    def session_tokens(self, session: Any) -> int:
        """KV tokens `session` holds, for the KV quota (0: not counted)."""
        return 0

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    def start_draining(self) -> None:
        """Refuse new sessions (UNAVAILABLE) from now on; calls on open sessions go on."""
        self.draining = True

    def holdings(self, principal: str | None = None) -> Holdings:
        """What `principal` (default: the caller) holds now, admissions in progress included."""
        principal = current_principal() if principal is None else principal
        reserved = self._reserved.get(principal, Holdings())
        held = Holdings(reserved.sessions, reserved.kv_tokens)
        for entry in self.sessions.owned_by(principal):
            held.sessions += 1
            held.kv_tokens += self.session_tokens(entry.value)
        return held

    @asynccontextmanager
    async def admission(self, kv_tokens: int, num_sessions: int = 1) -> AsyncIterator[None]:
        """Admit `num_sessions` new sessions holding `kv_tokens` in all, before any engine work:
        UNAVAILABLE while draining, RESOURCE_EXHAUSTED past a quota. Reserved until the block ends."""
        if self.draining:
            raise Unavailable("the service is draining before a shutdown: no new sessions")
        principal = current_principal()
        held = self.holdings(principal)
        for _ in range(num_sessions):
            self.quotas.check_new_session(held, 0)
            held.sessions += 1
        self.quotas.check_kv(held, kv_tokens)
        reserved = self._reserved[principal]
        reserved.sessions += num_sessions
        reserved.kv_tokens += kv_tokens
        try:
            yield
        finally:
            reserved.sessions -= num_sessions
            reserved.kv_tokens -= kv_tokens
            if not reserved.sessions and not reserved.kv_tokens:
                del self._reserved[principal]

    def check_kv_quota(self, extra_tokens: int) -> None:
        """Before a round that grows the caller's KV by `extra_tokens` (free without a KV quota)."""
        if self.quotas.options.quota_kv_tokens:
            self.quotas.check_kv(self.holdings(), extra_tokens)

    async def add_session(self, session: Any) -> str:
        """Register a session whose engine state exists, owned by the caller; frees it if refused."""
        if self.draining:
            await self.engine_thread.run(self.free_session, session)
            raise Unavailable("the service is draining before a shutdown: no new sessions")
        session_id = self.sessions.add(session, current_principal())
        self.metrics.sessions.set(len(self.sessions))
        return session_id

    @asynccontextmanager
    async def session_call(self, session_id: str) -> AsyncIterator[Any]:
        """The caller's session, locked for one call (module docstring for what a failure does)."""
        async with self.session_calls([session_id]) as sessions:
            yield sessions[0]

    @asynccontextmanager
    async def session_calls(self, session_ids: Sequence[str]) -> AsyncIterator[list[Any]]:
        """Several of the caller's sessions, locked together (in id order, so two such calls never
        wait on each other), all looked up before any is locked, each checked again once locked (a
        close may have come first). An error escaping the block closes them all (module docstring);
        per-session failures inside it are the caller's to handle."""
        principal = current_principal()
        entries = [self.sessions.get(i, principal) for i in session_ids]
        async with AsyncExitStack() as stack:
            for entry in sorted(entries, key=lambda e: e.session_id):
                await stack.enter_async_context(entry.lock)
            for entry in entries:
                if not self.sessions.holds(entry):
                    raise SessionNotFound(repr(entry.session_id))
            try:
                yield [entry.value for entry in entries]
            except STATE_PRESERVING_ERRORS:
                raise
            except BaseException:
                for entry in entries:
                    self.close_later(entry.session_id)
                raise

    async def close_session(self, session_id: str) -> bool:
        """Forget and free the caller's session once no call uses it; False if it was unknown."""
        check_session_id(session_id)
        return await self.sessions.close(session_id, current_principal())

    def close_later(self, session_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.sessions.close(session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _close_session(self, session: Any) -> None:
        await self.engine_thread.run(self.free_session, session)
        self.metrics.sessions.set(len(self.sessions))

    async def stop_batchers(self) -> None:
        """Servicers with batchers close them here, before the sessions go."""

    @property
    def settling(self) -> bool:
        """A step is still to be timed again after start (`time_step_when_lent`, `time_step_when_settled`)."""
        return any(not task.done() for task in self.remeasure)

    def time_step_when_lent(self, *engines) -> None:
        """With a core board, time each engine's step again once its lenders are idle and no session is
        open here (`servicekit.core_share.measure_when_lent`); cancelled at shutdown if still waiting."""
        if self.engine_thread.core_share is not None:
            loop = asyncio.get_running_loop()
            self.remeasure += [loop.create_task(measure_when_lent(self.engine_thread, engine, lambda: len(self.sessions) == 0))
                               for engine in engines]

    def time_step_when_settled(self, engine) -> None:
        """Time `engine`'s step again a moment after start while no session is open
        (`servicekit.core_share.measure_when_settled`); cancelled at shutdown if still waiting."""
        self.remeasure.append(asyncio.get_running_loop().create_task(
            measure_when_settled(self.engine_thread, engine, lambda: len(self.sessions) == 0)))

    async def shutdown(self) -> None:
        for task in self.remeasure:
            await cancel_and_wait(task)
        await self.stop_batchers()
        await self.sessions.stop()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        self.engine_thread.shutdown()
