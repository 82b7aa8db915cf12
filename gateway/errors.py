"""Errors in OpenAI's shape, and gRPC status codes as HTTP status codes.

Every error the gateway answers has OpenAI's body:
    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}
The SDKs read the HTTP status (400 BadRequestError, 404 NotFoundError, 429 RateLimitError, ...);
`type` follows the status, `code` names the case (`model_not_found`, `invalid_api_key`, or the
Coordinator's gRPC status code in lower case, e.g. `resource_exhausted`).
"""

from __future__ import annotations

import grpc

HTTP_STATUS_BY_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # the client went away (nginx's code); nobody reads it
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
    499: "cancelled",
    501: "not_implemented_error", 503: "service_unavailable_error", 504: "timeout_error",
}


class OpenAIError(Exception):
    """An error answered as HTTP `status` with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def from_grpc(exc: grpc.aio.AioRpcError) -> OpenAIError:
    """A failed Coordinator call: the status code mapped (anything unlisted is 500), its details kept."""
    code = exc.code()
    return OpenAIError(HTTP_STATUS_BY_GRPC.get(code, 500), f"coordinator: {exc.details() or code.name}",
                       code=code.name.lower())
