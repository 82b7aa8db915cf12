"""Session tables with a time-to-live: a session untouched for `ttl_s` is closed by a reaper task.

Each entry has an asyncio lock: a session serves one call at a time (a second concurrent call waits),
and the reaper never expires a session while a call holds it. Closing goes through `on_close`
(an async callable that frees KV blocks on the engine thread).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from servicekit.errors import SessionNotFound


@dataclass
class SessionEntry:
    session_id: str
    value: Any
    last_used_s: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionTable:
    def __init__(self, ttl_s: float, on_close: Callable[[Any], Awaitable[None]]):
        self.ttl_s = ttl_s
        self._on_close = on_close
        self._entries: dict[str, SessionEntry] = {}
        self._reaper: asyncio.Task | None = None
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    def add(self, value: Any, session_id: str = "") -> str:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._entries:
            raise ValueError(f"session id {session_id!r} is already in use")
        self._entries[session_id] = SessionEntry(session_id, value)
        return session_id

    def get(self, session_id: str) -> SessionEntry:
        entry = self._entries.get(session_id)
        if entry is None:
            raise SessionNotFound(repr(session_id))
        entry.last_used_s = time.monotonic()
        return entry

    async def close(self, session_id: str) -> bool:
        """Forget the session and free what it holds; False if it was unknown."""
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return False
        await self._on_close(entry.value)
        return True

    async def close_all(self) -> None:
        for session_id in list(self._entries):
            await self.close(session_id)

    async def reap(self, now_s: float | None = None) -> int:
        """Close every idle session past its TTL; returns how many."""
        now_s = time.monotonic() if now_s is None else now_s
        expired = [e.session_id for e in self._entries.values()
                   if now_s - e.last_used_s > self.ttl_s and not e.lock.locked()]
        for session_id in expired:
            await self.close(session_id)
        self.num_expired += len(expired)
        return len(expired)

    def start_reaper(self, interval_s: float) -> None:
        async def loop():
            while True:
                await asyncio.sleep(interval_s)
                await self.reap()

        self._reaper = asyncio.get_running_loop().create_task(loop())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
        await self.close_all()
