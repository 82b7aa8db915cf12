"""Who is calling: the principal of the current RPC (placeholder until the server edge sets it)."""

from __future__ import annotations

import contextvars

ANONYMOUS = "anonymous"
_principal: contextvars.ContextVar[str] = contextvars.ContextVar("specmesh_principal", default=ANONYMOUS)


def current_principal() -> str:
    return _principal.get()
