"""Session tables with owners and a time-to-live: a session untouched for `ttl_s` is closed by a reaper.

    table = SessionTable(ttl_s=300, on_close=free)          # free: async callable, frees engine state
    session_id = table.add(value, owner="alice")             # 32 hex chars: 128 random bits
    entry = table.get(session_id, owner="alice")             # another owner -> SessionNotFound

Ids are made here from a CSPRNG, so a session is usable only by whoever holds its id; and each
entry remembers the principal that opened it: another principal's lookup answers "not found" (the
same as a made-up id, so ids of others cannot be probed). Each entry has an asyncio lock: a session
serves one call at a time (a second concurrent call waits), the reaper never expires a session while
a call holds it, and `close` of a session in use waits for that call to finish before freeing (the
call ends normally; later calls see "not found").
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from servicekit.errors import SessionNotFound
from servicekit.tasks import cancel_and_wait

SESSION_ID_BYTES = 16  # 128 random bits, as 32 hex characters
MAX_SESSION_ID_CHARS = 64  # longer ids are malformed, not merely unknown


@dataclass
class SessionEntry:
    session_id: str
    value: Any
    owner: str
    last_used_s: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def check_session_id(session_id: str) -> None:
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise ValueError(f"a session id has at most {MAX_SESSION_ID_CHARS} characters, got {len(session_id)}")


class SessionTable:
    def __init__(self, ttl_s: float, on_close: Callable[[Any], Awaitable[None]],
                 on_expire: Callable[[int], None] | None = None):
        self.ttl_s = ttl_s
        self._on_close = on_close
        self._on_expire = on_expire
        self._entries: dict[str, SessionEntry] = {}
        self._reaper: asyncio.Task | None = None
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def session_ids(self) -> set[str]:
        return set(self._entries)

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    def owned_by(self, owner: str) -> Iterator[SessionEntry]:
        return (entry for entry in self._entries.values() if entry.owner == owner)

    def holds(self, entry: SessionEntry) -> bool:
        """Whether `entry` is still in the table (not closed since it was looked up)."""
        return self._entries.get(entry.session_id) is entry

    def add(self, value: Any, owner: str) -> str:
        session_id = secrets.token_hex(SESSION_ID_BYTES)
        while session_id in self._entries:  # 2**-128: never, but an id must never be shared
            session_id = secrets.token_hex(SESSION_ID_BYTES)
        self._entries[session_id] = SessionEntry(session_id, value, owner)
        return session_id

    def get(self, session_id: str, owner: str) -> SessionEntry:
        check_session_id(session_id)
        entry = self._entries.get(session_id)
        if entry is None or entry.owner != owner:
            raise SessionNotFound(repr(session_id))
        entry.last_used_s = time.monotonic()
        return entry

    async def close(self, session_id: str, owner: str | None = None) -> bool:
        """Forget the session and free what it holds once no call uses it; False if it was unknown
        (or, with `owner`, not that owner's)."""
        entry = self._entries.get(session_id)
        if entry is None or (owner is not None and entry.owner != owner):
            return False
        del self._entries[session_id]  # from now on, new calls get "not found"
        async with entry.lock:  # a call in progress finishes first
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
        if expired and self._on_expire is not None:
            self._on_expire(len(expired))
        return len(expired)

    def start_reaper(self, interval_s: float) -> None:
        async def loop():
            while True:
                await asyncio.sleep(interval_s)
                await self.reap()

        self._reaper = asyncio.get_running_loop().create_task(loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._reaper)
        await self.close_all()
