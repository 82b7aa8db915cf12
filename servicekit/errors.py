"""Exceptions -> gRPC status codes, in one place, for every servicer method.

| raised in the service or the library            | status code          |
|-------------------------------------------------|----------------------|
| SessionNotFound (unknown or expired session)    | NOT_FOUND            |
| FailedPrecondition (e.g. a finished session)    | FAILED_PRECONDITION  |
| ValueError, incl. ContextLengthError            | INVALID_ARGUMENT     |
| OutOfBlocksError (KV pool full), QuotaExceeded  | RESOURCE_EXHAUSTED   |
| Unauthenticated (no or a wrong token)           | UNAUTHENTICATED      |
| PermissionDenied (acting for another principal) | PERMISSION_DENIED    |
| Unavailable (draining: no new sessions)         | UNAVAILABLE          |
| Unimplemented                                   | UNIMPLEMENTED        |
| anything else (a bug)                           | INTERNAL             |
Client mistakes are validated before any engine work and raise ValueError, so they never reach
INTERNAL. Deadlines and cancellation are grpc's own: the call's task is cancelled.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time

import grpc

from specmesh.kv.errors import OutOfBlocksError

log = logging.getLogger("specmesh.services")


class SessionNotFound(LookupError):
    """No such session (never opened, closed, or expired after its TTL)."""


class Unimplemented(NotImplementedError):
    """A valid request for a feature this service does not offer."""


class FailedPrecondition(ValueError):
    """A well-formed request the session's state does not allow (a round on a finished session).
    A ValueError: a client mistake, detected before anything changes."""


class QuotaExceeded(Exception):
    """A principal's quota (sessions, KV tokens, ...) would be exceeded; the message names the limit."""


class Unauthenticated(Exception):
    """No credentials, or ones the service does not know."""


class PermissionDenied(Exception):
    """An authenticated caller asked for something it may not do (e.g. act for another principal)."""


class Unavailable(Exception):
    """The service takes no new work right now (it is draining before a shutdown)."""


class Downstream(Exception):
    """A call to another service failed with `code`: passed on to our caller with the same code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (OutOfBlocksError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
)
CLIENT_ERRORS = (SessionNotFound, ValueError, OutOfBlocksError, Unimplemented, QuotaExceeded, Unauthenticated,
                 PermissionDenied, Unavailable)


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, Downstream):
        return exc.code
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    if isinstance(exc, Unimplemented):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException, code: grpc.StatusCode) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, SessionNotFound):
        return f"unknown or expired session {text}"
    return text if code is not grpc.StatusCode.INTERNAL else f"internal error: {type(exc).__name__}: {text}"


def rpc_method(fn):
    """Wrap a servicer method (unary or server-streaming): map exceptions to status codes and count
    requests in `self.metrics` (a `ServiceMetrics`) by method and code."""
    name = fn.__name__

    def record(self, code: grpc.StatusCode, start: float) -> None:
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.requests.labels(name, code.name).inc()
            metrics.request_seconds.labels(name).observe(time.perf_counter() - start)

    async def abort(self, context, exc: BaseException, start: float):
        code = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("%s failed", name, exc_info=exc)
        record(self, code, start)
        await context.abort(code, message_for(exc, code))

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(self, request, context):
            start = time.perf_counter()
            try:
                # aclosing: when this wrapper is closed early (the client left), the method's generator
                # is closed with it, in the same task, not left to the garbage collector
                async with contextlib.aclosing(fn(self, request, context)) as items:
                    async for item in items:
                        yield item
            except CLIENT_ERRORS as exc:
                await abort(self, context, exc, start)
            except Exception as exc:  # noqa: BLE001 - the catch-all is the INTERNAL mapping
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await abort(self, context, exc, start)
            else:
                record(self, grpc.StatusCode.OK, start)

        return stream_wrapper

    @functools.wraps(fn)
    async def unary_wrapper(self, request, context):
        start = time.perf_counter()
        try:
            response = await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped by status_for
            await abort(self, context, exc, start)
        record(self, grpc.StatusCode.OK, start)
        return response

    return unary_wrapper
