"""Exceptions -> gRPC status codes, in one place, for every servicer method.

| raised in the service or the library            | status code          |
|-------------------------------------------------|----------------------|
| SessionNotFound (unknown or expired session)    | NOT_FOUND            |
| FailedPrecondition (e.g. a finished session)    | FAILED_PRECONDITION  |
| ValueError, incl. ContextLengthError            | INVALID_ARGUMENT     |
| OutOfBlocksError (KV pool full)                 | RESOURCE_EXHAUSTED   |
| Unimplemented                                   | UNIMPLEMENTED        |
| anything else (a bug)                           | INTERNAL             |
Client mistakes are validated before any engine work and raise ValueError, so they never reach
INTERNAL. Deadlines and cancellation are grpc's own: the call's task is cancelled.
"""

from __future__ import annotations

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


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, OutOfBlocksError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, Unimplemented):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def _message(exc: BaseException, code: grpc.StatusCode) -> str:
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
        await context.abort(code, _message(exc, code))

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(self, request, context):
            start = time.perf_counter()
            try:
                async for item in fn(self, request, context):
                    yield item
            except (SessionNotFound, ValueError, OutOfBlocksError, Unimplemented) as exc:
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
