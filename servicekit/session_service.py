"""What the Draft, Verify and Stage servicers share: sessions whose state lives on one engine thread.

    class VerifyServicer(SessionService, verify_pb2_grpc.VerifyServiceServicer):
        def free_session(self, session): ...            # engine thread: release KV, drafter state
    session_id = await self.add_session(session)         # freed again if the id cannot be used
    async with self.session_call(session_id) as session: # one call at a time per session
        ...                                              # failure or cancel here -> closed (below)

The rule, once for every service: a call that fails or is cancelled while it holds a session closes
that session (its state is then unknown to the client), unless the error is a client mistake
(ValueError: validated before any state changes), which leaves the session as it was. Closing runs
in the background so the failing call returns at once; sessions idle past the TTL are reaped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from servicekit.engine_thread import EngineThread
from servicekit.errors import Unavailable
from servicekit.metrics import ServiceMetrics
from servicekit.sessions import SessionTable


class SessionService:
    def __init__(self, name: str, session_ttl_s: float, metrics: ServiceMetrics):
        self.metrics = metrics
        self.engine_thread = EngineThread(f"{name}-engine")
        self.sessions = SessionTable(session_ttl_s, self._close_session)
        self._background: set[asyncio.Task] = set()
        self.draining = False  # set by `start_draining`: open sessions go on, new ones are refused

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    def start_draining(self) -> None:
        """Refuse new sessions (UNAVAILABLE) from now on; calls on open sessions go on."""
        self.draining = True

    def check_accepting(self) -> None:
        if self.draining:
            raise Unavailable("the service is draining before a shutdown: no new sessions")

    def free_session(self, session: Any) -> None:
        """Engine thread: release what `session` holds. Each servicer says what that is."""
        raise NotImplementedError

    async def add_session(self, session: Any, session_id: str = "") -> str:
        """Register a session whose engine state exists; frees it if the id cannot be used."""
        try:
            self.check_accepting()
            session_id = self.sessions.add(session, session_id)
        except (ValueError, Unavailable):
            await self.engine_thread.run(self.free_session, session)
            raise
        self.metrics.sessions.set(len(self.sessions))
        return session_id

    @asynccontextmanager
    async def session_call(self, session_id: str) -> AsyncIterator[Any]:
        """The session, locked for one call (module docstring for what a failure does)."""
        entry = self.sessions.get(session_id)
        async with entry.lock:
            try:
                yield entry.value
            except ValueError:
                raise
            except BaseException:
                self.close_later(session_id)
                raise

    async def close_session(self, session_id: str) -> bool:
        """Forget and free a session now; False if it was unknown."""
        return await self.sessions.close(session_id)

    def close_later(self, session_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.sessions.close(session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _close_session(self, session: Any) -> None:
        await self.engine_thread.run(self.free_session, session)
        self.metrics.sessions.set(len(self.sessions))

    async def stop_batchers(self) -> None:
        """Servicers with batchers close them here, before the sessions go."""

    async def shutdown(self) -> None:
        await self.stop_batchers()
        await self.sessions.stop()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        self.engine_thread.shutdown()
